"""GGUF tensors as Hugging Face tensors, for ``model/gguf_convert.py``: which architectures convert (and to which
Hugging Face classes), llama.cpp's tensor names as Hugging Face's (``hf_tensor_name``), and each tensor's values
(``hf_arrays``: dequantized to float32, llama.cpp's q/k row permutation undone, a layer's stacked experts split back
into one tensor per expert)."""

from __future__ import annotations

from typing import Any

import numpy as np

# general.architecture -> (HF architecture class, HF model_type).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "granite": ("GraniteForCausalLM", "granite"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),  # OLMo 3 too: a file with a sliding window (gguf_families)
    "exaone4": ("Exaone4ForCausalLM", "exaone4"),
    "ernie4_5": ("Ernie4_5ForCausalLM", "ernie4_5"),  # its q/k rows as the checkpoint's (its loader reorders them)
    "command-r": ("CohereForCausalLM", "cohere"),  # Command R, Aya (q/k rows likewise)
    "cohere2": ("Cohere2ForCausalLM", "cohere2"),  # Command R7B
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),  # Gemma 3's text models (270m, 1b)
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),  # its experts: model/gguf_gpt_oss.py
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")  # a ``llama`` file whose layers have experts
# llama.cpp's converter reorders q/k rows only for these (its LlamaModel and the models built on it); Qwen2, Qwen3,
# OLMo 2, EXAONE 4, ERNIE 4.5 and Cohere's are written unpermuted.
PERMUTED_ARCHITECTURES = frozenset({"llama", "smollm3", "granite"})
# llama.cpp's converter stores Gemma's RMSNorm weights as the 1 + w they scale by; Hugging Face's hold w.
NORM_OFFSET_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
    # mixtures of experts: the router, each layer's experts stacked in one tensor ({} is the expert's index), and
    # Qwen2-MoE's shared expert with its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Mixtral files written before llama.cpp stacked the experts (April 2024) hold one tensor per expert:
# blk.N.ffn_gate.E, blk.N.ffn_up.E, blk.N.ffn_down.E.
_EXPERT_TENSORS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Where an architecture's tensor means something else: Phi-3's ffn_up is its fused gate/up, Gemma 2 and 3's ffn_norm
# the norm before the MLP (their post-attention norm has a name of its own, as OLMo 2's and EXAONE 4's, which have no
# norms before).
_SANDWICH = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}  # Gemma 2 and 3's norms around each sublayer
_ARCH_BLOCK_TENSORS = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _SANDWICH, "gemma3": _SANDWICH,
                       "olmo2": _SANDWICH, "exaone4": _SANDWICH,
                       "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
                                   "attn_sinks": "self_attn.sinks"}}
# Parameters that transformers names without a suffix (llama.cpp writes ``.weight``)
_BARE = frozenset({"self_attn.sinks"})
# Mixtral's own names for the same tensors.
MIXTRAL_NAMES = ((".mlp.gate.", ".block_sparse_moe.gate."), (".mlp.experts.", ".block_sparse_moe.experts."),
                 (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))
# rope_freqs is llama 3.1's rotary scaling and rope_factors_long/short Phi-3's LongRoPE, which become
# config.rope_scaling; attn_rot_embd is a cache that old converters wrote and that the model recomputes.
_SKIPPED_TENSORS = frozenset({"rope_freqs", "rope_factors_long", "rope_factors_short", "attn_rot_embd"})


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name for a llama.cpp tensor name of a file of ``arch`` (``general.architecture``),
    or ``None`` for tensors HF does not store."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3].isdigit() \
            and parts[2] in _EXPERT_TENSORS:  # a Mixtral file from before llama.cpp stacked the experts
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_EXPERT_TENSORS[parts[2]]}.{suffix}"
    kind = parts[-1]
    if kind in _SKIPPED_TENSORS:
        return None
    block = {**_BLOCK_TENSORS, **_ARCH_BLOCK_TENSORS.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and kind in block:
        return f"model.layers.{parts[1]}.{block[kind]}" + ("" if block[kind] in _BARE else f".{suffix}")
    if len(parts) == 1 and kind in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[kind]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in pagellm's converter; only plain "
        f"{sorted(SUPPORTED_ARCHITECTURES)} models are supported (convert the original checkpoint instead)"
    )


def float_values(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values, dequantized to float32, in numpy's (and Hugging Face's) order of dimensions."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    # GGUF lists dimensions fastest-varying first; numpy (and HF) list them slowest first.
    return values.reshape([int(d) for d in reversed(tensor.shape)])


def unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF's rotary embedding pairs dimension ``i`` with ``i + d/2`` inside each head ("rotate half"); llama.cpp
    pairs ``2i`` with ``2i + 1``. Its converter therefore reorders the rows of each head from
    ``[half0 | half1]`` to interleaved ``(h0[0], h1[0], h0[1], h1[1], ...)``:
    ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``. Undoing it reads the interleaved pairs back out:
    ``w.reshape(n_head, d/2, 2, ...).swapaxes(1, 2)``. Works for weights and biases alike.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot undo rotary permutation: {rows} rows do not split into {n_head} heads of pairs")
    pairs = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def hf_arrays(tensor: Any, hf_name: str, heads: dict[str, int], mixtral: bool = False,
              blocks: bool = False) -> list[tuple[str, np.ndarray]]:
    """The Hugging Face tensors of one GGUF tensor (``hf_name`` from ``hf_tensor_name``), dequantized to float32,
    q/k rows unpermuted for the architectures in ``heads`` (projection → its heads): itself, or one per expert of a
    stacked ``[experts, out, in]`` tensor (``hf_name`` holding ``{}`` for the expert's index); under Mixtral's own
    names with ``mixtral``. With ``blocks``, the same rows as the file's quantized blocks (uint8 [out, bytes per
    row]; ``model/gguf_blocks.py``) instead of their values."""
    if blocks:  # the reader shapes a quantized tensor [..., out, bytes per row]: its rows, as the values' rows
        values = np.asarray(tensor.data).view(np.uint8)  # a float16 tensor's [..., out, in] as its bytes
    else:
        values = float_values(tensor)
    for ours, theirs in MIXTRAL_NAMES if mixtral else ():
        hf_name = hf_name.replace(ours, theirs)
    if "{}" in hf_name:
        return [(hf_name.format(e), np.ascontiguousarray(expert)) for e, expert in enumerate(values)]
    if hf_name.endswith("shared_expert_gate.weight"):
        values = values.reshape(1, -1)  # llama.cpp holds this [1, hidden] gate as a vector
    projection = hf_name.split(".")[-2]
    if projection in heads:
        values = unpermute_rotary_rows(values, heads[projection])
    return [(hf_name, np.ascontiguousarray(values))]
