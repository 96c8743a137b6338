"""``RuntimeInfo``: what a worker found at start-up (context length, KV blocks), reported to the engine and the
frontend. Values found at run time live here, never written back into the frozen configs. Plain data with no
imports, so the wire structs and executors can name it without importing the worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeInfo:
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    hidden_size: int = 0  # the width of the hidden states (embeddings)
    pooling_only: bool = False  # a base-model checkpoint (no LM head): embedding requests only
    kv_store_dir: str = ""  # with a KV connector: the folder of this model's stored blocks (disagg/connector.py)
    speculative_method: str = ""  # the proposer the workers draft with ("" without speculation)
    # Every layer slides over this many positions: the scheduler releases the blocks behind it (0: keeps them all)
    kv_window: int = 0
    labels: tuple[str, ...] = ()  # a sequence classifier's class names: its pooled outputs are their logits
    num_spec_tokens: int = 0  # with speculation: the drafts a step verifies at most (num_speculative_tokens)
    image_token_id: int | None = None  # a vision-language model's image token (its images' rows go there)
    bidirectional_images: bool = False  # ... whose image tokens attend both ways (Gemma 3's)
    encoder_only: bool = False  # an encoder-only embedding model (BERT): each prompt in one step, no prefix cache
    image_row_width: int = 0  # an image token's precomputed row (Qwen3-VL's: with its DeepStack rows); 0: hidden_size
