"""Tiny GGUF files written the way llama.cpp's converter writes them (its tensor names via gguf-py's own name
map, its q/k row permutation written out independently here), from tiny random transformers models and a
small trained tokenizer: the model tests' fixtures (test_gguf_convert.py, test_loader.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM, Ernie4_5Config,
                          Ernie4_5ForCausalLM, Exaone4Config, Exaone4ForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM, GraniteConfig,
                          GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "pagellm converts gguf files into hugging face directories",
    "numbers 12345 and symbols !?#@ café",
] * 4




def train_tiny_tokenizer() -> BackendTokenizer:
    """A real (trained) GPT-2 style byte-level BPE, small enough to be instant."""
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def tiny_config(arch: str, vocab_size: int, tied: bool, rope_scaling: dict[str, Any] | None = None,
                **sizes: int) -> Any:
    """A tiny config of ``arch``; ``sizes`` overrides its sizes (hidden_size, intermediate_size, ...)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=16384,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=2,
    ) | {name: size for name, size in sizes.items() if name != "moe_intermediate_size"}
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "phi3":  # with the sliding window its 4k models have
        return Phi3Config(**common, pad_token_id=None, sliding_window=40)
    if arch == "gemma":
        return GemmaConfig(**common, pad_token_id=None)
    if arch == "gemma2":  # caps low enough to matter at this size
        return Gemma2Config(**common, pad_token_id=None, sliding_window=6, query_pre_attn_scalar=common["head_dim"],
                            attn_logit_softcapping=1.0, final_logit_softcapping=3.0)
    if arch == "gemma3":  # what llama.cpp fixes for it: a global layer every sixth, a local rope base of 10,000
        rope = {"full_attention": {"rope_type": "default", "rope_theta": common.pop("rope_theta")},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        return Gemma3TextConfig(**common, pad_token_id=None, sliding_window=6, sliding_window_pattern=6,
                                query_pre_attn_scalar=common["head_dim"], rope_parameters=rope)
    if arch in _FAMILIES:
        return _family_config(arch, common)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=sizes.get("moe_intermediate_size", 48))
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2moe":  # with its gated shared expert
        return Qwen2MoeConfig(**common, **experts, shared_expert_intermediate_size=80)
    if arch == "qwen3moe":
        return Qwen3MoeConfig(**common, **experts, norm_topk_prob=True)
    # transformers writes rope_theta into the dict it is given: hand it a copy.
    return LlamaConfig(**common, rope_scaling=dict(rope_scaling) if rope_scaling else None)


# The families beyond Llama's own and Gemma's, as the tests write them: what makes each one's own parts show.
_FAMILIES = ("smollm3", "granite", "olmo2", "olmo3", "ernie4_5", "command-r", "cohere2", "exaone4")


def _family_config(arch: str, common: dict[str, Any]) -> Any:
    if arch == "smollm3":  # four layers: the fourth without a rotary embedding, as llama.cpp fixes it
        return SmolLM3Config(**{**common, "num_hidden_layers": 4}, pad_token_id=None)
    if arch == "granite":  # Granite 3's multipliers, an attention scale not 1/sqrt(head size)
        return GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                             logits_scaling=8.0)
    if arch == "olmo2":
        return Olmo2Config(**common, pad_token_id=None)
    if arch == "olmo3":  # a sliding layer (a window the test's prompt passes) and a full one
        return Olmo3Config(**common, pad_token_id=None, sliding_window=6,
                           layer_types=["sliding_attention", "full_attention"])
    if arch == "ernie4_5":
        return Ernie4_5Config(**common, pad_token_id=None)
    if arch == "command-r":
        return CohereConfig(**common, pad_token_id=None, logit_scale=0.25, layer_norm_eps=1e-5)
    if arch == "cohere2":  # four layers: the fourth full-attention and without rotary, as llama.cpp fixes the pattern
        return Cohere2Config(**{**common, "num_hidden_layers": 4}, pad_token_id=None, logit_scale=0.25,
                             layer_norm_eps=1e-5, sliding_window=6, layer_types=["sliding_attention"] * 3 +
                             ["full_attention"])
    # exaone4: its 32B's hybrid, a sliding layer, then a full one without a rotary embedding
    return Exaone4Config(**common, pad_token_id=None, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"])


def random_model(config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model_cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "mixtral": MixtralForCausalLM,
                 "qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
                 "phi3": Phi3ForCausalLM, "gemma": GemmaForCausalLM,
                 "gemma2": Gemma2ForCausalLM, "gemma3_text": Gemma3ForCausalLM, "smollm3": SmolLM3ForCausalLM,
                 "granite": GraniteForCausalLM, "olmo2": Olmo2ForCausalLM,
                 "olmo3": Olmo3ForCausalLM, "exaone4": Exaone4ForCausalLM,
                 "ernie4_5": Ernie4_5ForCausalLM, "cohere": CohereForCausalLM,
                 "cohere2": Cohere2ForCausalLM}.get(config.model_type, LlamaForCausalLM)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norm weights away from 1 and biases away from 0, so a misplaced tensor cannot go unnoticed.
            param.copy_(torch.randn_like(param) * (0.3 if "norm" in name else 0.05) + ("norm" in name))
    return model


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for q/k, written independently of the converter: within each head, row ``i`` of
    the first half and row ``i`` of the second half become neighbours (rotate-half → interleaved pairs)."""
    head_dim = weight.shape[0] // n_head
    half = head_dim // 2
    order = [h * head_dim + part * half + i for h in range(n_head) for i in range(half) for part in (0, 1)]
    return weight[order]


def llama3_divisors_loop(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's per-frequency divisors, spelled as a plain loop over frequencies."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(
    path: Path, model: torch.nn.Module, tokenizer: BackendTokenizer, arch: str, f16: bool = False,
    checkpoint: dict[str, torch.Tensor] | None = None, extra: dict[str, np.ndarray] | None = None,
    original_context: int | None = None, rope_dim: int | None = None, types: dict[str, str] | None = None,
    per_expert: bool = False,
) -> None:
    """``arch`` is llama.cpp's name (``mixtral`` is written as a ``llama`` file with experts). A mixture of experts
    needs its ``checkpoint`` tensors (one per expert, as saved; transformers holds them stacked in memory).
    ``extra``: more tensors under llama.cpp's names; ``original_context``: a LongRoPE file's original context;
    ``rope_dim``: the rotated dimensions of each head, where fewer than all (Phi-4-mini's); ``types``: a block type
    per kind of decoder matrix (``attn_v``, ``ffn_down_exps``; ``*`` for the others), and for the embeddings and the
    LM head where named (``token_embd``, ``output``), as llama.cpp's files have them (``{"*": "Q4_1"}``: the built-in
    model's; Q4_K_M's mixes; Q4_K and Q6_K through ``quantize_q4_k`` and ``quantize_q6_k``, the others through gguf's
    own quantizer); ``per_expert``: a Mixtral's experts one tensor each (``blk.N.ffn_gate.E``), as llama.cpp wrote
    them before it stacked them (April 2024)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch={"mixtral": "llama", "olmo3": "olmo2"}.get(arch, arch))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope["full_attention"] if arch in ("gemma3", "olmo3") else rope)["rope_theta"])
    _add_family_metadata(writer, config, arch)
    if original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(original_context)
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converters write YaRN
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
    if rope_dim is not None:
        writer.add_rope_dimension_count(rope_dim)
    _add_tokenizer(writer, tokenizer)
    _add_tensors(writer, model, arch, f16, checkpoint, types, per_expert)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_family_metadata(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    """The keys llama.cpp's converters write for a family: norms' epsilon, experts, windows, multipliers, caps."""
    if arch in ("command-r", "cohere2"):  # LayerNorms, and their logit scale
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_logit_scale(config.logit_scale)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch in ("mixtral", "qwen2moe", "qwen3moe"):
        _add_experts_metadata(writer, config, arch)
    if arch in ("phi3", "gemma2", "gemma3", "olmo3", "exaone4", "cohere2"):
        writer.add_sliding_window(config.sliding_window)
    if arch in ("olmo3", "exaone4"):  # as llama.cpp's converters write their layer types
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    if arch == "granite":  # its multipliers under llama.cpp's names
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma", "gemma2", "gemma3"):  # as llama.cpp's converter writes Gemma's head size
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: BackendTokenizer) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in SPECIALS else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)


def _add_experts_metadata(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    writer.add_expert_count(config.num_local_experts if arch == "mixtral" else config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(config.norm_topk_prob)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _stack_experts(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's layout: each layer's experts of one projection stacked into ``[experts, out, in]``, under the
    name without the expert's index (``...experts.w1.weight``, ``...experts.gate_proj.weight``); a [1, hidden]
    shared-expert gate as a vector."""
    stacked: dict[str, list[torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.items():
        match = re.search(r"\.experts\.(\d+)\.", name)
        if match is None:
            out[name] = tensor.reshape(-1) if name.endswith("shared_expert_gate.weight") else tensor
            continue
        group = stacked.setdefault(name[:match.start()] + ".experts." + name[match.end():], [])
        assert int(match.group(1)) == len(group), "experts in order"
        group.append(tensor)
    return out | {name: torch.stack(tensors) for name, tensors in stacked.items()}


def _add_tensors(writer: gguf.GGUFWriter, model: torch.nn.Module, arch: str, f16: bool,
                 checkpoint: dict[str, torch.Tensor] | None, types: dict[str, str] | None = None,
                 per_expert: bool = False) -> None:
    config = model.config
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                  "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
                  "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "phi3": gguf.MODEL_ARCH.PHI3,
                  "gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2,
                  "gemma3": gguf.MODEL_ARCH.GEMMA3, "smollm3": gguf.MODEL_ARCH.SMOLLM3,
                  "granite": gguf.MODEL_ARCH.GRANITE, "olmo2": gguf.MODEL_ARCH.OLMO2,
                  "olmo3": gguf.MODEL_ARCH.OLMO2, "exaone4": gguf.MODEL_ARCH.EXAONE4,
                  "ernie4_5": gguf.MODEL_ARCH.ERNIE4_5, "command-r": gguf.MODEL_ARCH.COMMAND_R,
                  "cohere2": gguf.MODEL_ARCH.COHERE2}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    tensors = checkpoint if per_expert else _stack_experts(checkpoint) if checkpoint is not None else \
        model.state_dict()
    for hf_name, tensor in tensors.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module, _, suffix = hf_name.rpartition(".")
        values = tensor.numpy().astype(np.float32)
        if arch in ("llama", "mixtral", "smollm3", "granite") and module.split(".")[-1] in heads:
            values = llama_cpp_permute(values, heads[module.split(".")[-1]])
        if arch.startswith("gemma") and module.endswith("norm"):  # llama.cpp stores the 1 + w its norms scale by
            values = values + np.float32(1.0)
        if f16 and values.ndim == 2:  # as llama.cpp's f16 files do: matrices in F16, norms and biases in F32
            values = values.astype(np.float16)
        expert = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])", module)
        if expert is not None:  # only with per_expert: the old files' names
            kind = {"w1": "ffn_gate", "w2": "ffn_down", "w3": "ffn_up"}[expert.group(3)]
            name = f"blk.{expert.group(1)}.{kind}.{expert.group(2)}.{suffix}"
        else:
            name = f"{name_map.get_name(module)}.{suffix}"
        if name.startswith("blk."):  # llama-quantize leaves the router in float
            kind = (types or {}).get(name.split(".")[2], (types or {}).get("*")) \
                if name.split(".")[2] != "ffn_gate_inp" else None
        else:  # the embeddings and the LM head: only where named ("token_embd", "output")
            kind = (types or {}).get(name.split(".")[0])
        if kind is not None and values.ndim >= 2:
            block_type = gguf.GGMLQuantizationType[kind]
            own = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(kind)
            raw = own(values) if own else gguf.quants.quantize(values, block_type)
            writer.add_tensor(name, raw, raw_dtype=block_type)
            continue
        writer.add_tensor(name, values)
    scaling = config.rope_parameters if arch == "llama" else {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_divisors_loop(scaling["rope_theta"], config.head_dim, scaling))


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K blocks (uint8 [..., K / 256 · 144]) of float ``values`` [..., K], by each 32's range (gguf's
    Python package reads Q4_K but does not write it): per super-block of 256, float16 ``d`` and ``dmin``, eight 6-bit
    scales and minima in twelve bytes, then each 64 inputs' nibbles (the first 32 low, the next 32 high); each value
    is ``d · sc · q - dmin · mn``."""
    shape = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(axis=2), 0), x.max(axis=2)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)

    def six_bits(t: np.ndarray, unit: np.ndarray) -> np.ndarray:
        return np.clip(np.round(t / np.where(unit > 0, unit, 1).astype(np.float32)[:, None]), 0, 63).astype(np.uint8)

    sc, mn = six_bits(scale, d), six_bits(mins, dmin)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((x + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, nibbles],
                            axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """llama.cpp's Q6_K blocks (uint8 [..., K / 256 · 210]) of float ``values`` [..., K], by each 16's largest
    magnitude (gguf's Python package reads Q6_K but does not write it): per super-block of 256, 128 bytes of the
    6-bit values' low nibbles, 64 of their top two bits, sixteen signed 8-bit scales and a float16 ``d``; each value
    is ``d · sc · (q - 32)``. Input ``128 h + 32 t + i`` keeps its low nibble in byte ``64 h + 32 (t % 2) + i`` (the
    high nibble for ``t >= 2``) and its top bits at bit ``2 t`` of byte ``128 + 32 h + i``."""
    shape = values.shape
    x = values.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16)
    unit = np.where(d > 0, d, 1).astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / unit), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(x / np.where(step > 0, step, 1)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [super-block, h, t, i]
    low, top = q & 15, q >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 210)


def assert_serves_as_transformers(gguf_path: Path, model: torch.nn.Module, ids: list[int]) -> None:
    """The engine's greedy tokens from the GGUF file are transformers' from the model it was written from (8 of them,
    after the prompt ``ids``, in float32)."""
    from pagellm import LLM, SamplingParams

    llm = LLM(str(gguf_path), dtype="float32", max_model_len=64)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    prompt = torch.tensor([ids])
    with torch.no_grad():
        theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == theirs
