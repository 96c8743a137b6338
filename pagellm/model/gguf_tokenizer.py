"""The tokenizer of a GGUF file, for ``model/gguf_convert.py``: ``build_tokenizer(gguf_path, meta, context_length)``
gives the ``tokenizers`` backend to save as ``tokenizer.json`` and the ``tokenizer_config.json`` document.

The vocabulary, merges and control tokens come from transformers' own GGUF tokenizer conversion, fed the metadata the
converter already parsed; the rest is what that conversion does not know: SmolLM's digit-splitting pre-tokenizer,
and the BOS/EOS template llama.cpp applies, baked into the file so every consumer adds the same specials.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Pre-tokenizer rules transformers' GGUF tokenizer does not know. SmolLM's vocabulary was trained with every
# digit split apart (llama.cpp's "smollm" pre-type puts `\p{N}` first), before the GPT-2 byte-level regex.
_DIGIT_SPLIT_PRE_TYPES = frozenset({"smollm"})


def build_tokenizer(gguf_path: Path, meta: dict[str, Any], context_length: int) -> tuple[Any, dict[str, Any]]:
    """(backend tokenizer, tokenizer_config) for the GGUF file whose parsed metadata is ``meta``."""
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{gguf_path} has no tokenizer (tokenizer.ggml.tokens); pagellm needs one to serve text")
    backend = _gguf_backend_tokenizer(gguf_path, meta)
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE_TYPES:
        from tokenizers import pre_tokenizers

        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokenizer_config = _tokenizer_config(meta, context_length)
    backend.post_processor = _special_token_template(meta, tokenizer_config)
    return backend, tokenizer_config


def _gguf_backend_tokenizer(gguf_path: Path, meta: dict[str, Any]) -> Any:
    """transformers' own GGUF tokenizer conversion (vocabulary, merges, control tokens), fed the metadata read here.

    Its ``AutoTokenizer`` route would parse the file's metadata twice more (once with gguf's slow reader, for a
    config it does not need here) and import the auto classes: 5-6 s of a cold start. Transformers releases
    without the ``integrations.gguf`` package (5.0 has none, 5.24 has it) take that route; both write the same
    tokenizer (tests/model/test_loader.py).
    """
    builder = _tokenizer_builder()
    if builder is None:
        return _auto_backend_tokenizer(gguf_path)
    renames, convert = builder
    tokenizer_dict = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
    backend, _ = convert(meta["general.architecture"], tokenizer_dict)
    return backend


def _tokenizer_builder() -> tuple[dict[str, str], Any] | None:
    """(GGUF tokenizer key -> builder argument, builder) from transformers, or None where it has no such module."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        return None
    return GGUF_TOKENIZER_MAPPING["tokenizer"], convert_gguf_tokenizer


def _auto_backend_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    return hf_tokenizer.backend_tokenizer


def _tokenizer_config(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless the file says otherwise.
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return {key: value for key, value in config.items() if value is not None}


def _special_token_template(meta: dict[str, Any], tokenizer_config: dict[str, Any]) -> Any:
    """BOS/EOS insertion baked into tokenizer.json, so every consumer of the file adds the same specials."""
    from tokenizers import processors

    prefix, suffix, specials = [], [], {}
    if tokenizer_config["add_bos_token"] and "bos_token" in tokenizer_config:
        prefix = [tokenizer_config["bos_token"]]
        specials[prefix[0]] = int(meta["tokenizer.ggml.bos_token_id"])
    if tokenizer_config["add_eos_token"] and "eos_token" in tokenizer_config:
        suffix = [tokenizer_config["eos_token"]]
        specials[suffix[0]] = int(meta["tokenizer.ggml.eos_token_id"])
    single = [*prefix, "$A:0", *suffix]
    pair = [*single, *prefix, "$B:1", *suffix]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(specials.items()))
