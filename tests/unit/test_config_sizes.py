"""Sizes in bytes (``kv_cache_memory``) are taken as users write them: plain bytes, binary units (4GiB, 4G, 4g),
decimal ones (4GB) and fractions (1.5GiB), from the CLI, ``LLM`` keyword arguments and the config alike; anything
else is an error that shows what to write."""

from __future__ import annotations

import re

import pytest

from pagellm.cli import build_parser, engine_kwargs
from pagellm.config import CacheConfig, EngineConfig, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("4294967296", 4 << 30), ("4GiB", 4 << 30), ("4G", 4 << 30), ("4g", 4 << 30), (" 2 gib ", 2 << 30),
    ("512MiB", 512 << 20), ("512m", 512 << 20), ("64KiB", 64 << 10), ("1TiB", 1 << 40), ("4GB", 4 * 10**9),
    ("250MB", 250 * 10**6), ("1.5GiB", 3 << 29), ("100B", 100), (4096, 4096),
])
def test_sizes_parse_in_binary_and_decimal_units(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["4 lots", "GiB", "", "-1G", "4GiBs", "1e9", "4 G B"])
def test_what_is_not_a_size_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size: write bytes \(4294967296\) or a number with a unit"):
        parse_size(text, "kv_cache_memory")


def test_a_size_that_is_no_number_or_string_is_refused() -> None:
    for value in (True, 4.0, None):
        with pytest.raises(ValueError, match="kv_cache_memory must be a number of bytes or a size such as 4GiB"):
            CacheConfig(kv_cache_memory=value)


def test_kv_cache_memory_takes_sizes_from_kwargs_and_flags() -> None:
    assert CacheConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 << 20
    assert EngineConfig.from_kwargs(kv_cache_memory="4GiB").cache_config.kv_cache_memory == 4 << 30
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "4GiB"])
    assert engine_kwargs(args)["kv_cache_memory"] == 4 << 30
    args = build_parser().parse_args(["generate", "--kv-cache-memory", "1073741824", "--prompt", "hi"])
    assert engine_kwargs(args)["kv_cache_memory"] == 1 << 30
    args = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "2G"])  # vLLM's name
    assert engine_kwargs(args)["kv_cache_memory"] == 2 << 30
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive number of bytes, got 0"):
        CacheConfig(kv_cache_memory="0GiB")


@pytest.mark.parametrize(("text", "tokens"), [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1.5k", 1500),
                                              ("2m", 2_000_000), ("1M", 1 << 20), (" 8k ", 8000)])
def test_token_counts_take_vllms_suffixes_from_the_flags(text: str, tokens: int) -> None:
    """vLLM's human-readable counts for --max-model-len and --max-num-batched-tokens: lower case decimal, upper case
    binary."""
    args = build_parser().parse_args(["serve", "--max-model-len", text, "--max-num-batched-tokens", text])
    assert engine_kwargs(args)["max_model_len"] == engine_kwargs(args)["max_num_batched_tokens"] == tokens


@pytest.mark.parametrize(("text", "message"), [("1.5K", r"a binary suffix takes a whole number; did you mean 1.5k"),
                                               ("0.5", "is not a number of tokens: write 4096, 32k"),
                                               ("32 kb", "is not a number of tokens")])
def test_what_is_not_a_token_count_says_what_to_write(text: str, message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", text])
    assert re.search(message, capsys.readouterr().err)
