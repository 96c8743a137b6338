"""``RuntimeInfo``: what a worker found at start-up (context length, KV blocks), reported to the engine and the
frontend. Values found at run time live here, never written back into the frozen configs. This module imports
nothing heavy, so the API server process can use it without loading the model stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeInfo:
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
