"""Benchmark workloads from the user's own files (``--dataset sharegpt|custom --dataset-path FILE``).

- ``sharegpt``: a JSON list of conversations in the ShareGPT layout (``{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}``; ``role``/``content`` turns are read too). Each request is a
  conversation's first user turn, sent as a completion prompt as ``vllm bench serve --dataset-name sharegpt`` sends
  it. With a tokenizer (``count_tokens``) its output length is the token count of the reply that followed it, and
  conversations are kept or dropped by vLLM's rules (prompt and reply of at least 4 tokens, prompt at most 1,024,
  both at most 2,048), so figures compare with that command's; without one every request asks for ``output_len`` ±
  ``range_ratio`` tokens.
- ``custom``: JSON Lines, one request a line: ``{"prompt": "text" or [token ids]}`` or ``{"messages": [{"role":
  ..., "content": ...}, ...]}`` (sent to the chat endpoint), with an optional ``"max_tokens"`` (else
  ``output_len`` ± ``range_ratio``) and an optional ``"timestamp"`` (seconds; on every line or none).

Both take ``num_prompts`` requests in an order shuffled by ``seed`` (a file with fewer entries is gone through again
in the same order), except a timed trace (a custom file with timestamps): its first ``num_prompts`` requests in time
order, each with its ``arrival`` (seconds after the first), for ``bench serve`` to replay when they came. A file that
cannot be read, or holds no usable entry, raises ValueError saying where.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

from pagellm.bench.datasets import BenchRequest, DatasetOptions, length

USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing", "model")
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048  # vLLM's ShareGPT filter


def _read(opts: DatasetOptions, name: str) -> str:
    if not opts.path:
        raise ValueError(f"--dataset {name} reads a file: pass --dataset-path FILE")
    try:
        return Path(opts.path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the {name} dataset {opts.path}: {exc}") from None


def _take(entries: list[Any], opts: DatasetOptions, name: str) -> list[Any]:
    """``num_prompts`` entries in an order shuffled by ``seed``, cycling when the file has fewer."""
    if not entries:
        raise ValueError(f"{opts.path} holds no usable {name} entry")
    order = list(range(len(entries)))
    random.Random(opts.seed).shuffle(order)
    return [entries[order[i % len(order)]] for i in range(opts.num_prompts)]


def _turns(conversation: Any) -> list[tuple[str, str]]:
    """(role, text) of each turn of one ShareGPT entry; [] when it has no list of turns."""
    turns = conversation.get("conversations", conversation.get("messages")) if isinstance(conversation, dict) \
        else None
    if not isinstance(turns, list):
        return []
    out = []
    for turn in turns:
        if isinstance(turn, dict):
            role, text = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
            if isinstance(role, str) and isinstance(text, str):
                out.append((role.lower(), text))
    return out


def _first_exchange(conversation: Any) -> tuple[str, str] | None:
    """The first non-empty user turn and the assistant reply right after it, or None."""
    turns = _turns(conversation)
    for (role, text), (next_role, reply) in itertools.pairwise(turns):
        if role in USER_ROLES and next_role in ASSISTANT_ROLES and text.strip() and reply.strip():
            return text, reply
    return None


def sharegpt_requests(opts: DatasetOptions) -> list[BenchRequest]:
    try:
        data = json.loads(_read(opts, "sharegpt"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{opts.path} is not JSON ({exc}); the sharegpt dataset is one JSON list") from None
    if not isinstance(data, list):
        raise ValueError(f"{opts.path}: the sharegpt dataset is a JSON list of conversations")
    count, entries = opts.count_tokens, []
    for conversation in data:
        exchange = _first_exchange(conversation)
        if exchange is None:
            continue
        prompt, reply = exchange
        if count is None:
            entries.append((prompt, None, None))
            continue
        prompt_len, reply_len = count(prompt), count(reply)
        if min(prompt_len, reply_len) >= MIN_TOKENS and prompt_len <= MAX_PROMPT_TOKENS \
                and prompt_len + reply_len <= MAX_TOTAL_TOKENS:
            entries.append((prompt, prompt_len, reply_len))
    rng = random.Random(opts.seed + 1)
    return [BenchRequest(prompt, reply_len or length(rng, opts.output_len, opts.range_ratio), prompt_len)
            for prompt, prompt_len, reply_len in _take(entries, opts, "sharegpt")]


def _custom_entry(record: Any, where: str) -> BenchRequest:
    """One JSON Lines record as a request (``output_len`` 0: not given; ``arrival``: its timestamp, if any)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line is a JSON object with 'prompt' or 'messages'")
    request = _custom_request(record, where)
    stamp = record.get("timestamp")
    if stamp is not None:
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not 0 <= stamp < float("inf"):
            raise ValueError(f"{where}: 'timestamp' is a number of seconds, 0 or more")
        request.arrival = float(stamp)
    return request


def _custom_request(record: dict[str, Any], where: str) -> BenchRequest:
    max_tokens = record.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer")
    max_tokens = max_tokens or 0
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text or token ids) and 'messages'")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"{where}: 'messages' is a non-empty list of {{'role': ..., 'content': ...}}")
        return BenchRequest(None, max_tokens, messages=messages)
    if isinstance(prompt, str) and prompt:
        return BenchRequest(prompt, max_tokens)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return BenchRequest(prompt, max_tokens, len(prompt))
    raise ValueError(f"{where}: 'prompt' is a non-empty string or a list of token ids")


def custom_requests(opts: DatasetOptions) -> list[BenchRequest]:
    entries = []
    for number, line in enumerate(_read(opts, "custom").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{opts.path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc}") from None
        entries.append(_custom_entry(record, where))
        if (entries[-1].arrival is None) != (entries[0].arrival is None):
            raise ValueError(f"{where}: a 'timestamp' on some lines and not others; a timed trace has one on "
                             "every line")
    timed = bool(entries) and entries[0].arrival is not None
    rng = random.Random(opts.seed + 1)
    out = []
    for entry in _timed(entries, opts) if timed else _take(entries, opts, "custom"):
        out.append(BenchRequest(entry.prompt, entry.output_len or length(rng, opts.output_len, opts.range_ratio),
                                entry.prompt_len, entry.messages, arrival=entry.arrival))
    return out


def _timed(entries: list[BenchRequest], opts: DatasetOptions) -> list[BenchRequest]:
    """A timed trace's first ``num_prompts`` requests in time order, arrivals counted from the first."""
    if opts.num_prompts > len(entries):
        raise ValueError(f"{opts.path} is a timed trace of {len(entries)} requests: pass --num-prompts "
                         f"{len(entries)} or fewer (a trace is replayed once, not cycled)")
    ordered = sorted(entries, key=lambda e: e.arrival)[:opts.num_prompts]  # type: ignore[arg-type, return-value]
    first = ordered[0].arrival or 0.0
    for entry in ordered:
        entry.arrival = (entry.arrival or 0.0) - first
    return ordered
