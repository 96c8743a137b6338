"""The Llama family's models: Llama 2/3 (with Llama-3 rope scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (an
RMSNorm over each head's q and k before the rotary embedding), Phi-3 (q/k/v and gate/up fused in its checkpoint),
SmolLM2 and SmolLM3 (every fourth layer without a rotary embedding), Cohere's Command R, R7B and Aya (LayerNorms,
attention and the MLP side by side, interleaved rotary pairs; Command R7B's full-attention layers without a rotary
embedding), Granite and Granite MoE (embeddings, sublayer
outputs, attention scores and logits scaled by its multipliers), OLMo 2 and 3 (norms after each sublayer, q and k normed
across all heads; OLMo 3 slides a window in three layers of four), EXAONE 4, ERNIE 4.5 (its interleaved rotary
pairs made Llama's by reordering q and k's rows as they load), and their mixture-of-experts kin, Mixtral,
Qwen2-MoE and Qwen3-MoE, whose sparse layers replace the dense MLP with experts (``layers/moe.py``); and Gemma,
Gemma 2 and Gemma 3's text model (``GemmaForCausalLM``: scaled embeddings, GeGLU, RMSNorm weights as 1 + w; Gemma 2
and 3 add norms after attention and the MLP and their own attention scale; Gemma 2 soft-caps attention scores and
logits; Gemma 3 has q/k norms and sliding layers with a rope base of their own). Their decoder layers are
``model/decoder.py``'s.

The forward pass takes one flat batch of tokens (prompt chunks and decode tokens of many requests mixed) with
their positions; attention reads everything else from the forward context. ``compute_logits`` runs the LM head
only on the hidden states the runner selects (the tokens that are sampled).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model import weight_only
from pagellm.model.arch import ArchConfig
from pagellm.model.decoder import decoder_layer, make_norm
from pagellm.model.layers.attention import Attention
from pagellm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.model.layers.linear import loaded_whole, pack_weights
from pagellm.model.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from pagellm.model.native_stack import run_native, run_native_stage
from pagellm.ops import gemm, gemm_mxfp4, gemm_w8a8

Embeds = tuple[torch.Tensor, torch.Tensor]  # flat token positions, and the embedding rows that go there


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.mrope_section, dtype,
                                       cfg.mrope_interleaved) if cfg.mrope_section else \
            RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling, dtype, cfg.rotary_dim)
        local = self.rotary if cfg.local_rope_theta is None else RotaryEmbedding(  # Gemma 3's, OLMo 3's sliding layers'
            cfg.head_dim, cfg.context_length, cfg.local_rope_theta, None, dtype, cfg.rotary_dim)
        self.layer_range = parallel.layer_range(cfg.num_layers)  # all of them, or this pipeline stage's
        self.layers = nn.ModuleList(decoder_layer(cfg, self._layer_rotary(cfg, i, local), dtype, parallel, i)
                                    for i in self.layer_range)
        self.norm = make_norm(cfg, dtype)
        # Gemma's sqrt(hidden_size), rounded to the embeddings' dtype as transformers has it (made once, not per step);
        # Granite's embedding_multiplier, a float
        self.embed_scale: torch.Tensor | float | None = torch.tensor(cfg.embed_scale, dtype=dtype) \
            if cfg.embed_scale is not None else None if cfg.embedding_multiplier in (None, 1.0) \
            else cfg.embedding_multiplier

    def _layer_rotary(self, cfg: ArchConfig, layer: int, local: RotaryEmbedding) -> RotaryEmbedding | None:
        if layer in cfg.nope_layers:
            return None
        return local if cfg.layer_window(layer) else self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                embeds: Embeds | None = None) -> torch.Tensor:
        """Final-norm hidden states after all layers, or after the first ``num_layers`` (self-speculation).
        ``embeds``: (flat positions, rows) that replace those positions' token embeddings (embeddings prompts).
        bfloat16 steps on the cpu_paged backend run the layers as one native call (``model/native_stack.py``)."""
        if self.parallel.pp_size > 1:
            return self._forward_stage(input_ids, positions, embeds)
        x, residual = self.embed(input_ids, embeds), None
        native = run_native(self, x, positions, num_layers)
        if native is not None:
            return native
        for layer in self.layers[:num_layers]:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor, embeds: Embeds | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if embeds is not None:
            x.index_copy_(0, embeds[0], embeds[1])
        return x

    def _forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       embeds: Embeds | None = None) -> torch.Tensor:
        """One pipeline stage: the previous stage's hidden states and residual (or the embeddings) through this
        stage's layers, on to the next; every stage returns the last one's final hidden states."""
        stage = self.parallel
        dtype = self.norm.weight.dtype
        if stage.is_first_stage:
            x, residual = self.embed(input_ids, embeds), None
        else:
            x, residual = stage.recv_prev((input_ids.shape[0], self.norm.weight.shape[0]), dtype)
        native = run_native_stage(self, x, residual, positions, stage.is_last_stage)
        if native is not None:
            x, residual = native
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        if stage.is_last_stage:
            hidden = x if native is not None else self.norm(x, residual)[0].contiguous()
        else:
            stage.send_next(x, residual)
            hidden = torch.empty(input_ids.shape[0], self.norm.weight.shape[0], dtype=dtype)
        return stage.broadcast_from_last(hidden)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_QK_ROWS = re.compile(r"\.[qk]_proj\.(weight|bias|weight_groups|weight_scale)$")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment → (our parameter name fragment, shard id)
    STACKED = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }
    RENAMES: tuple[tuple[str, str], ...] = ()  # checkpoint name fragment → ours, before STACKED

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, dtype, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        if cfg.num_labels:  # a sequence classifier's head, kept in float32 (a few rows)
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False, dtype=torch.float32)
        if cfg.quantization == gemm_w8a8.FORMAT:  # a W8A8 checkpoint: its linear layers come with scales
            for module in self.modules():
                if hasattr(module, "expect_scales"):
                    module.expect_scales()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                embeds: Embeds | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, num_layers, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        if self.cfg.logits_scaling not in (None, 1.0):  # Granite's
            logits = logits / self.cfg.logits_scaling
        if self.cfg.logit_scale not in (None, 1.0):  # Cohere's
            logits = logits * self.cfg.logit_scale
        cap = self.cfg.final_softcap  # Gemma 2's
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a pooling request gets of its last token's final hidden state: the state itself (float32), or a
        classifier's class logits."""
        hidden = hidden.float()
        return self.score(hidden) if self.cfg.num_labels else hidden

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        """Copy checkpoint tensors (Hugging Face names) into place through each parameter's own loader, then pack
        the bfloat16 GEMM weights for the native kernel, or quantize the decoder layers' ones (``quantization``, or
        a quantized checkpoint's own int8 weights and scales; ``linear.pack_weights``)."""
        if quantization in gemm.FOUR_BIT and self.cfg.quantization in (None, weight_only.SCHEME):
            for module in self.modules():  # 4-bit layers of a checkpoint or a GGUF come with groups; others quantize
                if hasattr(module, "expect_groups"):
                    module.expect_groups()
        quantize = quantization or (self.cfg.quantization if self.cfg.quantization in gemm.QUANTIZED else None)
        modules = dict(self.named_modules(remove_duplicate=False))
        params = dict(self.named_parameters(remove_duplicate=False))
        # A quantized checkpoint's scales: only its quantized layers have them (the others keep float weights).
        missing = {name for name in params if not (self.cfg.tie_word_embeddings and name == "lm_head.weight")
                   and not name.endswith((".weight_scale", ".weight_groups", ".input_order"))}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = self._target(name)
            if target is None:  # another pipeline stage's layer
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor.to(param.dtype))
            else:
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
            missing.discard(target)
            module = modules.get(target.rpartition(".")[0])
            if quantize and hasattr(module, "quantize_weight") and loaded_whole(module):
                module.quantize_weight(quantize)  # now: one layer at a time in bfloat16
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(sorted(missing)[:8])}")
        pack_weights(self, quantize)

    def load_dummy_weights(self, quantization: str | None = None, seed: int = 0) -> None:
        """Random weights instead of a checkpoint's (``load_format="dummy"``, vLLM's): each parameter uniform in
        [-1e-3, 1e-3], as vLLM's are, then packed or quantized as loaded ones are. For timing a model's shape
        without its weights: its text means nothing."""
        gen = torch.Generator().manual_seed(seed)
        for param in self.parameters():
            if param.dtype.is_floating_point and param.numel():
                param.data.copy_(torch.rand(param.shape, generator=gen).mul_(2e-3).sub_(1e-3))
        pack_weights(self, quantization)

    def _target(self, name: str) -> tuple[str | None, str | int | None]:
        """Our parameter's name for a checkpoint tensor, and its shard of a fused matrix; None for a layer that
        belongs to another pipeline stage (a stage numbers its own layers from 0) or an expert that belongs to
        another rank (a rank numbers its own experts from 0)."""
        if self.cfg.base_model and not name.startswith("model."):  # a base model's names start at its layers
            name = f"model.{name}"
        layers = self.model.layer_range
        if len(layers) != self.cfg.num_layers and (match := _LAYER.match(name)):
            index = int(match.group(1))
            if index not in layers:
                return None, None
            name = f"model.layers.{index - layers.start}.{name[match.end():]}"
        for fragment, ours in self.RENAMES:
            name = name.replace(fragment, ours)
        experts = self.model.parallel.expert_range(self.cfg.moe.num_experts) if self.cfg.moe else None
        if experts is not None and len(experts) != self.cfg.moe.num_experts and (match := _EXPERT.search(name)):
            index = int(match.group(1))
            if index not in experts:
                return None, None  # another rank's expert (expert parallelism)
            name = f"{name[:match.start()]}.mlp.experts.{index - experts.start}.{name[match.end():]}"
        for fragment, (ours, shard) in self.STACKED.items():
            if fragment in name:
                return name.replace(fragment, ours), shard
        return name, None


def _gate_up(fused: torch.Tensor, gate_name: str, up_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused gate/up tensor (gate rows first, then up rows) as the two tensors every gated MLP loads."""
    gate, up = fused.chunk(2)
    yield gate_name, gate
    yield up_name, up


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma, Gemma 2 and Gemma 3's text model: their RMSNorms scale by 1 + w, so each norm weight is loaded as
    1 + w (in float32, as transformers adds it) and the norms run as every other model's."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        super().load_weights(((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                              for name, tensor in weights), quantization)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention and experts under their own names (``block_sparse_moe``, w1/w3/w2 for the
    gate, up and down projections)."""

    RENAMES = ((".block_sparse_moe.", ".mlp."), (".w2.", ".down_proj."))
    STACKED = {**LlamaForCausalLM.STACKED, ".w1.": (".gate_up_proj.", 0), ".w3.": (".gate_up_proj.", 1)}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (Llama's layers, Mistral's sliding window, LongRoPE in the 128k models): its checkpoint fuses q/k/v
    into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (gate first), which are split back into the shards
    every fused layer loads (so tensor-parallel ranks take their slice of each)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        super().load_weights(self._unfused(weights), quantization)

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, tensor in weights:  # a W8A8 checkpoint's [N, 1] weight_scale splits as its weight's rows do
            if ".self_attn.qkv_proj." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                    yield name.replace(".qkv_proj.", f".{part}."), piece
            elif ".mlp.gate_up_proj." in name:
                yield from _gate_up(tensor, name.replace(".gate_up_proj.", ".gate_proj."),
                                    name.replace(".gate_up_proj.", ".up_proj."))
            else:
                yield name, tensor


class GraniteMoeForCausalLM(LlamaForCausalLM):
    """Granite MoE (granite-3.x-1b-a400m, -3b-a800m): Granite's multipliers, and its experts stacked in one tensor per
    layer (``block_sparse_moe.input_linear``: each expert's gate and up rows; ``output_linear``: its down rows), which
    are split back into one tensor per expert as every mixture's experts load, its router renamed to the gate; and
    Granite 4.0's attention-only models, whose one MLP is the shared one (``shared_mlp``: gate and up rows in
    ``input_linear``, down in ``output_linear``)."""

    RENAMES = ((".block_sparse_moe.router.layer.", ".mlp.gate."), (".shared_mlp.output_linear.", ".mlp.down_proj."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        super().load_weights(self._per_expert(weights), quantization)

    @staticmethod
    def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            stacked = name.partition(".block_sparse_moe.")
            if stacked[2] == "input_linear.weight":
                for e, expert in enumerate(tensor):
                    yield from _gate_up(expert, f"{stacked[0]}.mlp.experts.{e}.gate_proj.weight",
                                        f"{stacked[0]}.mlp.experts.{e}.up_proj.weight")
            elif stacked[2] == "output_linear.weight":
                for e, expert in enumerate(tensor):
                    yield f"{stacked[0]}.mlp.experts.{e}.down_proj.weight", expert
            elif ".shared_mlp.input_linear." in name:
                yield from _gate_up(tensor, name.replace(".shared_mlp.input_linear.", ".mlp.gate_proj."),
                                    name.replace(".shared_mlp.input_linear.", ".mlp.up_proj."))
            else:
                yield name, tensor


class InterleavedRopeForCausalLM(LlamaForCausalLM):
    """Models whose rotary embedding turns interleaved pairs of each head's dimensions (2i, 2i + 1) where Llama's turns
    (i, i + d/2): ERNIE 4.5's dense models (ERNIE-4.5-0.3B), Cohere's. q and k's rows are reordered as they load, each
    head's even rows first, then its odd ones, which makes the rotation Llama's (the attention scores, q and k
    reordered alike, are unchanged)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        super().load_weights(self._rotate_half_order(weights), quantization)

    def _rotate_half_order(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        head_dim = self.cfg.head_dim
        order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
        for name, tensor in weights:
            if _QK_ROWS.search(name):  # the rows of q and k: weights, biases, 4-bit groups, int8 scales
                heads = tensor.shape[0] // head_dim
                tensor = tensor.reshape(heads, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)
            yield name, tensor


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (gpt-oss-20b, -120b): Llama's layer with biases on every attention projection and attention sinks, a
    sliding window in every other layer, YaRN, and experts stacked in one tensor per layer (transformers' float
    layout: ``gate_up_proj`` ``[experts, hidden, 2 * intermediate]`` with gate and up columns interleaved,
    ``down_proj`` ``[experts, intermediate, hidden]``, and their biases; an MXFP4 checkpoint's come through
    ``mxfp4.weights`` in that layout). Each expert's matrices are split out and transposed as they load, its gate
    rows the even ones, its up rows the odd ones; the router is the gate."""

    RENAMES = ((".mlp.router.", ".mlp.gate."),)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        """With ``quantization`` ``w4a16_mxfp4`` (an MXFP4 checkpoint in bfloat16), the experts take their codes and
        groups (``mxfp4.weights(keep=True)``) and stay in 4 bits; every other layer stays bfloat16."""
        if quantization == gemm_mxfp4.FORMAT:
            for layer in self.model.layers:
                for expert in getattr(layer.mlp, "experts", ()):
                    expert.gate_up_proj.expect_groups()
                    expert.down_proj.expect_groups()
        super().load_weights(self._per_expert(weights), quantization)

    @staticmethod
    def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            layer, found, part = name.partition(".mlp.experts.")
            if not found:
                yield name, tensor
                continue
            experts = f"{layer}.mlp.experts"
            for e, expert in enumerate(tensor):
                if part == "gate_up_proj":  # [hidden, 2I] → gate and up rows [I, hidden]
                    yield f"{experts}.{e}.gate_proj.weight", expert[:, 0::2].t()
                    yield f"{experts}.{e}.up_proj.weight", expert[:, 1::2].t()
                elif part in ("gate_up_proj_bias", "gate_up_proj_groups"):  # by output rows, interleaved
                    suffix = "bias" if part.endswith("bias") else "weight_groups"
                    yield f"{experts}.{e}.gate_proj.{suffix}", expert[0::2]
                    yield f"{experts}.{e}.up_proj.{suffix}", expert[1::2]
                elif part == "down_proj_groups":
                    yield f"{experts}.{e}.down_proj.weight_groups", expert
                elif part == "down_proj":  # [I, hidden] → [hidden, I]
                    yield f"{experts}.{e}.down_proj.weight", expert.t()
                elif part == "down_proj_bias":
                    yield f"{experts}.{e}.down_bias", expert
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in GptOssForCausalLM")
