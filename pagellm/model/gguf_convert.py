"""Turn a llama.cpp GGUF file into a Hugging Face-style model directory.

Contract: ``convert_gguf_to_hf(gguf_path, out_dir)`` writes into ``out_dir``

- ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when the
  float32 weights pass ``MAX_SHARD_BYTES``): every tensor but the blocks' matrices (below: the norms, biases,
  routers, and matrices in the 1-to-3-bit IQ and ternary types) dequantized to float32 under its Hugging Face name,
  with llama.cpp's rotary row permutation of q/k undone (``model/gguf_tensors.py``), so the weights are exactly what
  transformers' own GGUF loader produces;
- ``config.json`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, or for mixtures of experts
  ``MixtralForCausalLM`` (a ``llama`` file with experts), ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``: llama.cpp
  stacks each layer's experts in one tensor, written back out as one tensor per expert),
  ``generation_config.json`` (bos/eos ids);
- ``tokenizer.json`` + ``tokenizer_config.json`` (chat template, special tokens, ``add_bos_token``;
  ``model/gguf_tokenizer.py``);
- ``gguf_weight_types.json``: how many of the decoder layers' weight matrices the file stored in each type
  (``four_bit_hint`` reads it: a 4-bit file's weights are dequantized here, and ``--quantization w4a16_int4`` or
  ``w4a8_int4`` keeps them in 4 bits);
- ``gguf_blocks.safetensors``: the decoder matrices, embeddings and LM head stored in a block type pagellm decodes
  (Q4_0 to Q8_0, the K-quants, IQ4_NL, IQ4_XS, float16, bfloat16; ``gguf_blocks.KINDS``), as the file's own blocks
  (``model/gguf_blocks.py``), which the 4-bit kernels take as they are (a decoder layer's Q4 matrices) and
  ``loader.iter_weights`` decodes for the others; ``loader.hf_model_dir`` adds their float32 copies for readers other
  than pagellm (transformers).

It writes in place and is not atomic: the caller (``loader.resolve_model_dir``) converts into a temporary
directory and renames it. Unsupported files raise ``ValueError`` naming what is supported. Bump
``CONVERTER_VERSION`` whenever the output changes, so cached conversions are redone.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.model import gguf_gpt_oss, gguf_tokenizer
from pagellm.model.gguf_families import (REQUIRED, arch_value, cohere_config, experts_config, gemma_config,
                                         gpt_oss_config, granite_config, phi3_config, post_norm_config,
                                         shortest_float, smollm3_config)
from pagellm.model.gguf_tensors import (MIXTRAL, NORM_OFFSET_ARCHITECTURES, PERMUTED_ARCHITECTURES,
                                        SUPPORTED_ARCHITECTURES, hf_arrays, hf_tensor_name)

logger = logging.getLogger(__name__)

# 2: partial_rotary_factor from rope.dimension_count; gguf_weight_types.json; 3: the 4-bit blocks (gguf_blocks);
# 4: no float32 copy of the 4-bit blocks' matrices (loader.hf_model_dir writes one for other readers); 5: Q8_0 kept
# as blocks too, in gguf_blocks.safetensors; 6: the embeddings and the LM head kept as blocks too; 7: Q5, Q6_K,
# Q2_K, Q3_K, IQ4 and float16/bfloat16 matrices kept as blocks too; 8: gpt-oss
CONVERTER_VERSION = 8
MAX_SHARD_BYTES = 4 * 1024**3
WEIGHT_TYPES_FILE = "gguf_weight_types.json"
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")

# Instruct GGUFs sometimes name the base model's eos; the chat template's turn terminator is what ends a reply.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
# gpt-oss's generation_config.json: the final answer's end, a tool call's, the document's
_HARMONY_ENDS = ("<|return|>", "<|call|>", "<|endoftext|>")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write the Hugging Face directory for ``gguf_path`` into ``out_dir`` (created if missing)."""
    start = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _reader_class()(str(gguf_path))
    meta = _read_metadata(reader)
    arch = _architecture(meta, gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _hf_config(meta, arch, tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_weights(tensors, config, arch, out_dir)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    _write_tokenizer(gguf_path, meta, arch, out_dir)
    _write_json(out_dir / WEIGHT_TYPES_FILE, _weight_types(tensors))
    logger.info("converted %s (%s, %d tensors) in %.1fs", gguf_path, arch, len(tensors), time.perf_counter() - start)


def _weight_types(tensors: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, tensor in tensors.items():
        if name.startswith("blk.") and name.endswith(".weight") and len(tensor.shape) >= 2:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def four_bit_hint(model_dir: Path) -> str | None:
    """A line suggesting ``--quantization w4a16_int4`` for a model converted from a GGUF that stored most of its
    decoder weights in 4 bits (dequantized at conversion), or ``None``."""
    path = Path(model_dir) / WEIGHT_TYPES_FILE
    if not path.is_file():
        return None
    counts = json.loads(path.read_text())
    if 2 * sum(n for kind, n in counts.items() if kind in FOUR_BIT_TYPES) <= sum(counts.values()):
        return None
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return (f"this model's GGUF stores its decoder weights in 4 bits ({kinds}), dequantized here; --quantization "
            "w4a16_int4 keeps them in 4 bits (about a third of bfloat16's memory; Q4_0, Q4_1 and Q4_K blocks as the "
            "file has them), and w4a8_int4 with int8 activations")


@functools.cache
def _reader_class() -> type:
    """gguf's ``GGUFReader`` over a plain ndarray view of its memory map.

    The reader slices its map once per string of the metadata (a vocabulary and a merge table: about 100,000 for
    SmolLM2), and slicing an ``np.memmap`` runs its Python hooks (``__getitem__``, ``__array_finalize__``) every
    time: two thirds or more of a 2.6-3.6 s parse. A plain view of the same pages slices in C, and the tensors it hands
    out are views of the same map, as before.
    """
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain_data = mapped.view(np.ndarray)

    return PlainViewReader


def _read_metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _architecture(meta: dict[str, Any], gguf_path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _hf_config(meta: dict[str, Any], arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    def get(key: str, default: Any = REQUIRED) -> Any:
        return arch_value(meta, arch, key, default)

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    rope_theta = shortest_float(get("rope.freq_base", 10000.0))
    experts = int(get("expert_count", 0))
    hf_class, model_type = MIXTRAL if arch == "llama" and experts else SUPPORTED_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", get("expert_feed_forward_length", 0))),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        # Cohere's LayerNorms have their own key (gguf_families.cohere_config)
        "rms_norm_eps": shortest_float(get("attention.layer_norm_rms_epsilon", None) or
                                       get("attention.layer_norm_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(get("context_length")),
        # The embedding's row count is the model's vocabulary, whatever the tokenizer lists.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    config.update(_family_config(meta, arch, tensors, hidden // n_head, head_dim))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:  # Phi-4-mini turns 96 of each head's 128 dimensions
        config["partial_rotary_factor"] = rope_dim / head_dim
    if experts:
        config.update(experts_config(meta, arch, experts))
    config.update(_special_ids(meta))
    rope_scaling = _rope_scaling(meta, arch, tensors, head_dim, rope_theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
        if rope_scaling["rope_type"] == "longrope":  # Phi-3 reads it beside rope_scaling (its default: 4096)
            config["original_max_position_embeddings"] = rope_scaling["original_max_position_embeddings"]
    return config


def _family_config(meta: dict[str, Any], arch: str, tensors: dict[str, Any], hidden_per_head: int,
                   head_dim: int) -> dict[str, Any]:
    """The config keys of the file's architecture beyond the common ones (``model/gguf_families.py``)."""
    layers = int(arch_value(meta, arch, "block_count"))
    config: dict[str, Any] = {}
    if arch in ("llama", "qwen3", "qwen3moe", "smollm3", "granite", "olmo2", "exaone4", "gpt-oss"):
        config.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False)
    if arch == "qwen2moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "smollm3":
        config.update(smollm3_config())
    elif arch == "granite":
        config.update(granite_config(meta, head_dim))
    elif arch in ("olmo2", "exaone4"):
        config.update(post_norm_config(meta, arch, layers))
    elif arch == "phi3":
        config.update(phi3_config(meta))
    elif arch in ("command-r", "cohere2"):
        config.update(cohere_config(meta, arch))
    elif arch == gguf_gpt_oss.ARCH:
        config.update(gpt_oss_config(meta, layers, gguf_gpt_oss.all_mxfp4(tensors)))
    elif arch in NORM_OFFSET_ARCHITECTURES:
        config.update(gemma_config(meta, arch, hidden_per_head, head_dim, layers))
    return config


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    names = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    return {
        hf_key: int(meta[f"tokenizer.ggml.{gguf_key}"])
        for hf_key, gguf_key in names.items()
        if f"tokenizer.ggml.{gguf_key}" in meta
    }


def _rope_scaling(
    meta: dict[str, Any], arch: str, tensors: dict[str, Any], head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3 128k, Phi-3.5): its two sets of factors as tensors
        original = int(arch_value(meta, arch, "rope.scaling.original_context_length"))
        return {"rope_type": "longrope", "original_max_position_embeddings": original,
                "long_factor": [shortest_float(f) for f in np.asarray(tensors["rope_factors_long.weight"].data)],
                "short_factor": [shortest_float(f) for f in np.asarray(tensors["rope_factors_short.weight"].data)]}
    kind = arch_value(meta, arch, "rope.scaling.type", "none")
    if kind != "none":
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(arch_value(meta, arch, "rope.scaling.factor"))}
        original = arch_value(meta, arch, "rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        if kind == "yarn":  # the keys llama.cpp's converters copy from the model's config (attn_factor: its own)
            for key, hf_key in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                ("yarn_beta_slow", "beta_slow")):
                if (value := arch_value(meta, arch, f"rope.scaling.{key}", None)) is not None:
                    scaling[hf_key] = shortest_float(value)
        if kind == "yarn" and arch == gguf_gpt_oss.ARCH:  # its config's (llama.cpp rounds the range; it stores no key)
            scaling["truncate"] = False
        return scaling
    if "rope_freqs.weight" in tensors:
        divisors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
        return _llama3_rope_scaling(divisors, head_dim, rope_theta)
    return None


def _llama3_rope_scaling(divisors: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's per-frequency divisors (``rope_freqs``).

    GGUF keeps only the resulting divisors. Every Llama 3.x release uses low/high frequency factors 1 and 4
    around an 8192-token original context, so the factor is the largest divisor; recompute the curve from
    those numbers and refuse the file if it differs, rather than run a silently wrong rotary embedding.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": shortest_float(divisors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(llama3_rope_divisors(scaling, head_dim, rope_theta), divisors, rtol=1e-4):
        raise ValueError(
            "GGUF rope_freqs do not follow Llama 3's rope scaling; convert the original HF checkpoint instead"
        )
    return scaling


def llama3_rope_divisors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """How much llama3 scaling divides each rotary frequency by: 1 for short wavelengths, ``factor`` for
    wavelengths longer than the original context allows, and a smooth blend between the two."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (original / wavelength - low) / (high - low)
    divisors = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = np.where(wavelength < original / high, 1.0, divisors)
    return np.where(wavelength > original / low, factor, divisors)


def _write_weights(tensors: dict[str, Any], config: dict[str, Any], arch: str, out_dir: Path) -> None:
    from pagellm.model import gguf_blocks  # torch: the frontend resolves a converted model without it

    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    heads = heads if arch in PERMUTED_ARCHITECTURES else {}
    mixtral = config["model_type"] == "mixtral"
    blocks, planned = [], []  # the tensors kept as the file's blocks; (bytes, producer) of the ones written here
    for name, tensor in tensors.items():
        if arch == gguf_gpt_oss.ARCH and gguf_gpt_oss.expert_tensor(name):
            continue  # a layer's experts go together (below)
        if (hf_name := hf_tensor_name(name, arch)) is None:
            continue
        if gguf_blocks.kept(hf_name, tensor.tensor_type.name):
            blocks.append((hf_name, tensor))
        else:
            size = 4 * int(np.prod([int(d) for d in tensor.shape]))
            planned.append((size, functools.partial(hf_arrays, tensor, hf_name, heads, mixtral)))
    if arch == gguf_gpt_oss.ARCH:
        planned.extend(gguf_gpt_oss.planned(tensors, packed="quantization_config" in config))
    shards = _plan_shards(planned)
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        arrays = {name: values for _, produce in shard for name, values in produce()}
        if arch in NORM_OFFSET_ARCHITECTURES:  # the file's 1 + w back to w
            arrays = {name: values - 1.0 if name.endswith("norm.weight") else values for name, values in arrays.items()}
        _save_safetensors(arrays, out_dir / filename)
        weight_map.update(dict.fromkeys(arrays, filename))
        del arrays  # one shard of float32 in memory at a time
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": sum(size for size, _ in planned)}, "weight_map": weight_map}
        _write_json(out_dir / "model.safetensors.index.json", index_doc)
    kept = {name: (raw, tensor.tensor_type.name) for hf_name, tensor in blocks
            for name, raw in hf_arrays(tensor, hf_name, heads, mixtral, blocks=True)}
    if kept:  # the matrices as the file holds them
        gguf_blocks.save(kept, out_dir / gguf_blocks.BLOCKS_FILE)


def _plan_shards(planned: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
    """The planned ``(bytes, producer)`` items in shards of at most ``MAX_SHARD_BYTES`` (or one item larger)."""
    shards: list[list[tuple[int, Any]]] = [[]]
    size = 0
    for item in planned:
        if shards[-1] and size + item[0] > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[0]
    return shards


def _save_safetensors(arrays: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(arrays, str(path), metadata={"format": "pt"})


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    ids = _special_ids(meta)
    eos = [ids["eos_token_id"]] if "eos_token_id" in ids else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta:
            eos.append(int(meta[key]))
    eos = list(dict.fromkeys(_reply_ends(meta, eos)))
    generation: dict[str, Any] = {k: v for k, v in ids.items() if k != "eos_token_id"}
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return generation


def _reply_ends(meta: dict[str, Any], eos: list[int]) -> list[int]:
    """The file's own end ids ``eos`` and the chat template's end-of-turn tokens; in a harmony vocabulary (gpt-oss's)
    harmony's ends instead, and never its <|end|>, which ends one message, not a reply (llama.cpp drops it too)."""
    template = meta.get("tokenizer.chat_template") or ""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    control = {token: index for index, (token, kind) in enumerate(zip(tokens, types)) if kind == 3}
    if "<|return|>" in control:
        return [i for i in eos if i != control.get("<|end|>")] + [control[t] for t in _HARMONY_ENDS if t in control]
    return eos + [control[token] for token in _END_OF_TURN_TOKENS if token in control and token in template]


def _write_tokenizer(gguf_path: Path, meta: dict[str, Any], arch: str, out_dir: Path) -> None:
    context = int(arch_value(meta, arch, "context_length", 2048))
    backend, tokenizer_config = gguf_tokenizer.build_tokenizer(gguf_path, meta, context)
    backend.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
