"""The synthetic scheduler trace shared by benchmarks/scheduler_overhead.py (pagellm) and
benchmarks/peers/vllm_scheduler_bench.py (vLLM's v1 scheduler): both replay exactly these requests.

Request ``i`` = one of ``NUM_PREFIXES`` shared prefixes (``PREFIX_LEN`` tokens, whole blocks, so prefix caching
hits) + a unique suffix of ``SUFFIX_LEN`` tokens, and generates ``output_len(i)`` tokens (EOS ignored). Output
lengths are staggered so requests finish a few at a time and newcomers keep arriving: every step mixes decodes
with prefill chunks, as a loaded server does. The driver keeps ``num_running`` requests in the system.
Plain Python only (no pagellm, no vLLM imports): each side's script imports it.
"""

from __future__ import annotations

import random

NUM_PREFIXES = 8
PREFIX_LEN = 256
SUFFIX_LEN = 64
MIN_OUTPUT, MAX_OUTPUT = 64, 192
BLOCK_SIZE = 16
TOKEN_BUDGET = 2048  # max_num_batched_tokens: at 1024 running, decodes use half, prefill chunks the rest
SAMPLED_TOKEN = 1234

_rng = random.Random(0)
_PREFIXES = [[_rng.randrange(100, 49152) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]


def prompt(i: int) -> list[int]:
    rng = random.Random(1_000_003 + i)
    return _PREFIXES[i % NUM_PREFIXES] + [rng.randrange(100, 49152) for _ in range(SUFFIX_LEN)]


def output_len(i: int) -> int:
    return MIN_OUTPUT + (i * 37) % (MAX_OUTPUT - MIN_OUTPUT + 1)


def num_blocks(num_running: int) -> int:
    """A KV pool that never preempts: every running request at its longest, plus the shared prefixes."""
    per_request = (PREFIX_LEN + SUFFIX_LEN + MAX_OUTPUT) // BLOCK_SIZE + 2
    return num_running * per_request + NUM_PREFIXES * PREFIX_LEN // BLOCK_SIZE + 64
