"""The decoder layers of the Llama family and its kin (``model/llama.py`` stacks them): attention with its q/k/v
fused into one GEMM, the gated MLP, and the layer around them, whose norms sit where the family puts them
(``ArchConfig.norms``): before each sublayer (Llama, Mistral, Qwen, Phi-3, SmolLM, Granite), before and after each
(Gemma 2 and 3), after each sublayer's output only (OLMo 2 and 3, EXAONE 4), or one before attention and the MLP
side by side (Cohere, with LayerNorms). Granite scales each sublayer's output
before it joins the residual stream; SmolLM3's NoPE layers (and EXAONE 4's full-attention ones beside sliding ones)
attend without a rotary embedding; OLMo's q and k norms span all heads.

A layer's ``forward(positions, x, residual)`` takes the last sublayer's output and the residual stream before it
(None for the first layer: ``x`` is the embeddings) and returns the same pair, so the stream is ``x + residual``
and the model's final norm adds them (``RMSNorm``'s fused add)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.base import current_lora
from pagellm.distributed.groups import ParallelState
from pagellm.model.arch import NORMS_PARALLEL, NORMS_POST, NORMS_PRE, NORMS_SANDWICH, ArchConfig
from pagellm.model.layers.activation import GeluAndMul, SiluAndMul
from pagellm.model.layers.attention import Attention
from pagellm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.model.layers.moe import SparseMoeBlock
from pagellm.model.layers.norm import LayerNorm, RMSNorm
from pagellm.model.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype, parallel: ParallelState,
                 layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # its index, for LoRA adapters
        self.parallel = parallel
        self.num_heads = parallel.shard(cfg.num_heads, "attention heads")
        self.num_kv_heads = parallel.shard(cfg.num_kv_heads, "key/value heads")
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, dtype, parallel)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, dtype, parallel)
        self.rotary = rotary  # None: a NoPE layer (SmolLM3's)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.attn_scale or cfg.head_dim ** -0.5,
                              cfg.layer_window(layer), cfg.attn_softcap)
        # q and k normed per head (Qwen3, Gemma 3), or each across all heads (OLMo 2: over every rank's heads)
        self.qk_norm_all_heads = cfg.qk_norm_all_heads
        q_width, k_width = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim) \
            if self.qk_norm_all_heads else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        # gpt-oss's sinks, one logit per head (this rank's heads), kept in float32 as the kernels read them
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if cfg.attention_sinks else None
        if self.sinks is not None:
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.parallel.tp_rank * self.num_heads, self.num_heads))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv, lora = self.qkv_proj(x), current_lora()
        if lora is not None:
            lora.add(qkv, x, self.layer, (("q_proj", 0, q_size), ("k_proj", q_size, kv_size),
                                          ("v_proj", q_size + kv_size, kv_size)))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._norm_qk(q, k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        attended = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), self.sinks)
        out = self.o_proj(attended)
        if lora is not None:
            lora.add(out, attended, self.layer, (("o_proj", 0, out.shape[-1]),))
        return out

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.q_norm is not None and self.k_norm is not None
        if not self.qk_norm_all_heads:  # per head: rows of head_dim
            return self.q_norm(q.reshape(-1, self.head_dim))[0], self.k_norm(k.reshape(-1, self.head_dim))[0]
        parallel = self.parallel
        if parallel.tp_size == 1:
            return self.q_norm(q)[0], self.k_norm(k)[0]
        # Across all heads under tensor parallelism: every rank's heads gathered, normed whole, this rank's taken back.
        ours = []
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            width = x.shape[-1]
            whole = norm(parallel.all_gather_last_dim(x.contiguous()))[0]
            ours.append(whole[:, parallel.tp_rank * width:(parallel.tp_rank + 1) * width])
        return ours[0], ours[1]


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype,
                                                 parallel)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype, parallel)
        self.act_fn = SiluAndMul() if cfg.hidden_act == "silu" else \
            GeluAndMul("tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = current_lora()
        if lora is None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        width = gate_up.shape[-1] // 2
        lora.add(gate_up, x, self.layer, (("gate_proj", 0, width), ("up_proj", width, width)))
        h = self.act_fn(gate_up)
        out = self.down_proj(h)
        lora.add(out, h, self.layer, (("down_proj", 0, out.shape[-1]),))
        return out


class LlamaDecoderLayer(nn.Module):
    """Norms before attention and the MLP (``NORMS_PRE``); Granite's sublayer outputs scaled by its
    ``residual_multiplier`` before they join the residual stream."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype, parallel: ParallelState,
                 layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, dtype)
        self.self_attn = LlamaAttention(cfg, rotary, dtype, parallel, layer)
        self.post_attention_layernorm = make_norm(cfg, dtype)
        self.mlp: nn.Module = SparseMoeBlock(cfg.moe, cfg.hidden_size, dtype, parallel) \
            if cfg.moe is not None and cfg.moe.is_sparse(layer) else LlamaMLP(cfg, dtype, parallel, layer)
        scale = cfg.residual_multiplier
        self.residual_multiplier = None if scale in (None, 1.0) else scale
        # what the native decoder stack computes (model/native_stack.py): this layer (gpt-oss's too), OLMo's,
        # Gemma's and Cohere's, with SwiGLU or GeGLU's tanh form (OLMo's q/k norms across all heads on one rank: the
        # stack has no all-gather)
        self.native = cfg.hidden_act in ("silu", "gelu_pytorch_tanh") and \
            (cfg.norms in (NORMS_PRE, NORMS_SANDWICH, NORMS_PARALLEL) or
             (cfg.norms == NORMS_POST and not (cfg.qk_norm_all_heads and parallel.tp_size > 1)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self._scaled(self.self_attn(positions, h))
        h, residual = self.post_attention_layernorm(h, residual)
        return self._scaled(self.mlp(h)), residual

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier is None else h * self.residual_multiplier


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Gemma 2 and 3's layer (``NORMS_SANDWICH``): each sublayer's output normed before it joins the residual stream
    (``post_attention_`` and ``post_feedforward_layernorm``), and the MLP's input by a norm of its own
    (``pre_feedforward_layernorm``)."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype, parallel: ParallelState,
                 layer: int = 0) -> None:
        super().__init__(cfg, rotary, dtype, parallel, layer)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """OLMo 2 and 3's and EXAONE 4's layer (``NORMS_POST``): no norm before either sublayer; each one's output normed
    (``post_attention_`` and ``post_feedforward_layernorm``) before it joins the residual stream."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype, parallel: ParallelState,
                 layer: int = 0) -> None:
        super().__init__(cfg, rotary, dtype, parallel, layer)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        h = self.post_attention_layernorm(self.self_attn(positions, stream))[0]
        stream = stream + h
        return self.post_feedforward_layernorm(self.mlp(stream))[0], stream


class CohereDecoderLayer(LlamaDecoderLayer):
    """Cohere's layer (``NORMS_PARALLEL``): one norm, then attention and the MLP side by side on its output, both
    added to the residual stream (the attention's first, as transformers adds them)."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype, parallel: ParallelState,
                 layer: int = 0) -> None:
        super().__init__(cfg, rotary, dtype, parallel, layer)
        del self.post_attention_layernorm

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        return self.mlp(h), residual + self.self_attn(positions, h)


def make_norm(cfg: ArchConfig, dtype: torch.dtype) -> RMSNorm:
    """A norm over the hidden states: Cohere's LayerNorm, else RMSNorm."""
    return (LayerNorm if cfg.layer_norm else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps, dtype)


_LAYERS = {NORMS_PRE: LlamaDecoderLayer, NORMS_SANDWICH: GemmaDecoderLayer, NORMS_POST: Olmo2DecoderLayer,
           NORMS_PARALLEL: CohereDecoderLayer}


def decoder_layer(cfg: ArchConfig, rotary: RotaryEmbedding | None, dtype: torch.dtype, parallel: ParallelState,
                  layer: int) -> LlamaDecoderLayer:
    """Decoder layer ``layer`` (its index in the whole model) of the family ``cfg`` describes."""
    return _LAYERS[cfg.norms](cfg, rotary, dtype, parallel, layer)
