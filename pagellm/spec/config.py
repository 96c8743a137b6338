"""Speculative decoding's configuration (``EngineConfig.speculative_config``): which proposer drafts tokens and how
many. No torch here: the frontend reads it before anything starts."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)  # the CLI's flag help (``engine_args.py``)


SPEC_METHODS = ("ngram", "draft_model", "medusa", "eagle")
# Measured with benchmarks/spec_decode.py (docs/speculative.md): n-gram drafts on code stop paying above this batch.
DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: which proposer drafts tokens, and how many (see docs/speculative.md)."""

    method: str | None = _help("Proposer: none, ngram (prompt lookup), draft_model (a smaller model, or the "
                               "target's first draft_layers layers), medusa (trained heads) or eagle (a trained "
                               "one-layer head on the target's hidden states).", default=None)
    num_speculative_tokens: int = _help("Draft tokens proposed per step.", default=0)
    prompt_lookup_min: int = _help("Smallest n-gram the ngram proposer matches.", default=2)
    prompt_lookup_max: int = _help("Largest n-gram the ngram proposer matches.", default=4)
    model: str | None = _help("draft_model: Hugging Face directory of the draft model (same tokenizer; unset "
                              "for self-speculation with draft_layers); medusa/eagle: the heads' .safetensors "
                              "file (pagellm train-draft); eagle on the built-in model: unset uses the shipped "
                              "artifacts/smollm2-135m-eagle.safetensors.", default=None)
    draft_layers: int | None = _help("draft_model without a model: how many leading target layers draft "
                                     "(plus the final norm and LM head, weights shared).", default=None)

    tree: list[int] | None = _help("medusa/eagle: draft a tree with tree[d] candidates per node at depth d (e.g. "
                                   "[3, 2, 1]); its depth must equal num_speculative_tokens. Unset: a chain.",
                                   default=None)
    eagle_topk: int | None = _help("eagle: draft an EAGLE-2 dynamic tree num_speculative_tokens deep, expanding "
                                   "the eagle_topk most probable paths per depth with eagle_topk children each "
                                   "(SGLang's speculative_eagle_topk); needs num_draft_tokens.", default=None)
    num_draft_tokens: int | None = _help("eagle dynamic tree: how many of the drafted nodes (the most probable "
                                         "paths; the root not counted) are verified per step.", default=None)
    prompt_lookup_tokens: int = _help("eagle trees: also merge the prompt-lookup (n-gram, prompt_lookup_min/max) "
                                      "continuation of up to this many tokens into the tree as one more branch; "
                                      "0: off.", default=0)
    draft_vocab_size: int | None = _help("eagle: score only the first N tokens of the head's draft vocabulary "
                                         "(most frequent first); 0: the full vocabulary; unset: the head's own.",
                                         default=None)
    disable_by_batch_size: int | None = _help(
        "Draft nothing (and reserve no draft KV slots) while more than this many requests run in a step: once the "
        "step is compute-bound, verifying drafts costs more than they save. null: draft at any batch size. The "
        "default is where n-gram drafts stopped paying on a 2-core CPU (docs/speculative.md).",
        default=DISABLE_BY_BATCH_SIZE)

    def __post_init__(self) -> None:
        if self.method not in (None, *SPEC_METHODS):
            raise ValueError(f"speculative method {self.method!r} is not supported; use one of "
                             f"{', '.join(SPEC_METHODS)} or leave it unset")
        if self.method is not None and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1 when a speculative method is set")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and (self.model is None) == (self.draft_layers is None):
            raise ValueError("draft_model needs exactly one of 'model' (a draft model directory) or "
                             "'draft_layers' (self-speculation with the target's first layers)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if self.method == "medusa" and self.model is None:
            raise ValueError("medusa needs 'model': the heads' .safetensors file from `pagellm train-draft`")
        if self.disable_by_batch_size is not None and (isinstance(self.disable_by_batch_size, bool)
                                                       or not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size must be a positive number of requests (or null to draft at "
                             f"any batch size), got {self.disable_by_batch_size!r}")
        if self.tree is not None:
            if self.method not in ("medusa", "eagle"):
                raise ValueError("'tree' is only supported with methods 'medusa' and 'eagle'")
            if len(self.tree) != self.num_speculative_tokens or any(int(b) < 1 for b in self.tree):
                raise ValueError(f"tree {self.tree} must list num_speculative_tokens={self.num_speculative_tokens}"
                                 " positive branching factors, one per depth")
        self._check_eagle()

    def _check_eagle(self) -> None:
        if self.method != "eagle":
            for key in ("eagle_topk", "num_draft_tokens", "draft_vocab_size"):
                if getattr(self, key) is not None:
                    raise ValueError(f"'{key}' is only supported with method 'eagle'")
            if self.prompt_lookup_tokens:
                raise ValueError("'prompt_lookup_tokens' is only supported with method 'eagle' (with a tree)")
            return
        if self.prompt_lookup_tokens < 0 or (self.prompt_lookup_tokens and self.tree is None
                                             and self.eagle_topk is None):
            raise ValueError(f"prompt_lookup_tokens={self.prompt_lookup_tokens}: use 0 (off), or a positive count "
                             "with a tree ('tree' or 'eagle_topk'), whose branch it joins")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0: the full vocabulary), got {self.draft_vocab_size}")
        if self.eagle_topk is None:
            if self.num_draft_tokens is not None:
                raise ValueError("num_draft_tokens is the dynamic tree's node budget: set eagle_topk too "
                                 "(e.g. 'eagle_topk': 4), or drop num_draft_tokens")
            return
        if self.tree is not None:
            raise ValueError("set either 'tree' (a static tree) or 'eagle_topk' (a dynamic tree), not both")
        if self.eagle_topk < 2:
            raise ValueError(f"eagle_topk must be >= 2 (got {self.eagle_topk}); for a chain leave it unset")
        most = self.eagle_topk + (self.num_speculative_tokens - 1) * self.eagle_topk ** 2
        if self.num_draft_tokens is None or not 1 <= self.num_draft_tokens <= most:
            raise ValueError(f"eagle_topk needs num_draft_tokens, the nodes verified per step: between 1 and "
                             f"{most} (all that eagle_topk={self.eagle_topk} drafts over "
                             f"{self.num_speculative_tokens} depths), got {self.num_draft_tokens}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots to reserve per request for drafts: the tree's node count (plus a prompt-lookup branch's), or
        the chain's length."""
        if not self.method:
            return 0
        if self.eagle_topk is not None:
            return int(self.num_draft_tokens) + self.prompt_lookup_tokens  # type: ignore[arg-type]
        if self.tree is None:
            return self.num_speculative_tokens
        nodes, width = 0, 1
        for branching in self.tree:
            width *= branching
            nodes += width
        return nodes + self.prompt_lookup_tokens

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None, **shorthands: Any) -> SpeculativeConfig:
        """From a dict or a JSON string as vLLM spells it: ``{"method": "ngram", "num_speculative_tokens": 3}``.
        ``shorthands``: vLLM's ``spec_method``, ``spec_model`` and ``spec_tokens`` (``--spec-method`` ...), each
        setting its key of the config; a key given both ways is refused."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc}); e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from exc
        unknown = set(shorthands) - {name for name, _ in SHORTHANDS}
        if unknown:
            raise TypeError(f"unknown speculative shorthands {sorted(unknown)}")
        keys = {key: shorthands[name] for name, key in SHORTHANDS if shorthands.get(name) is not None}
        if keys:
            if isinstance(value, SpeculativeConfig):
                raise ValueError("--spec-method, --spec-model and --spec-tokens go with a speculative_config given as "
                                 "JSON or a dict, not as a SpeculativeConfig")
            for name, key in SHORTHANDS:
                if key in keys and key in (value or {}):
                    raise ValueError(f"--{name.replace('_', '-')} and speculative_config[{key!r}] are mutually "
                                     "exclusive: give one of them")
            value = {**(value or {}), **keys}
        if value is None or isinstance(value, SpeculativeConfig):
            return value or cls()
        known = {f.name for f in dataclasses.fields(cls)}
        if set(value) - known:
            raise ValueError(f"unknown speculative_config keys {sorted(set(value) - known)}; valid: {sorted(known)}")
        return cls(**value)


# vLLM's flags that set one key of the speculative config each: (engine argument, key)
SHORTHANDS = (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens"))
