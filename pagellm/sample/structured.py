"""Structured outputs with xgrammar: compile each distinct constraint once, one matcher per request.

Contract:
- ``validate(so)`` checks a constraint without a tokenizer (xgrammar's grammar front ends: JSON schema, regex,
  EBNF) and raises ``ValueError`` naming the problem; the frontend calls it so a bad schema is an HTTP 400.
- ``GrammarCache`` (one per worker) compiles constraints against the model's tokenizer, keyed by
  ``StructuredOutputsParams.key``, so requests with the same schema share one compiled grammar.
- ``RequestGrammar`` is one request's matcher. ``fill(bitmask, row)`` writes the allowed-token bitmask for its
  next token (once the grammar has ended, only the stop tokens: a request with ``ignore_eos`` keeps emitting
  EOS); ``accept(tokens)`` advances it. A request rebuilt after preemption replays its output tokens, so
  its state does not depend on where or how often it ran. With ``begin_after`` (a reasoning model's
  ``</think>``) it starts ``constraining`` only after the output first contains those tokens; until then
  every token is allowed and the runner leaves its row unmasked.
- JSON is generated compactly (no free whitespace): a random or small model otherwise spends its tokens on
  whitespace that the grammar allows. JSON string characters exclude control characters and UTF-16 surrogates:
  xgrammar 0.2's length-bounded string rule lets raw U+0000-U+001F through (JSON forbids them unescaped), and
  its character classes accept surrogate code points, whose UTF-8 form is invalid (a byte-level model can emit
  them byte by byte; they would decode to U+FFFD and break ``maxLength``).
- Masks are applied with xgrammar's CPU ``apply_token_bitmask_inplace`` on float32 logits, only on the rows
  that are constrained (``indices``); other rows pay nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import xgrammar as xgr

from pagellm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# An object with any keys and values: what response_format {"type": "json_object"} asks for.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# The character classes of xgrammar's JSON strings (length-bounded, then free), and what they become.
_STRING_CHARS = {r'[^\"\\\r\n]': r'[^\0-\x1f\"\\\r\n\ud800-\udfff]',
                 r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'}


def validate(so: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem when ``so`` cannot be compiled."""
    kind, text = so.key
    try:
        if kind == "json":
            json.loads(text)
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            structural_tag_grammar(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.{kind} is not valid JSON: {exc}") from None
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        raise ValueError(f"invalid structured_outputs.{kind}: {_clean(str(exc))}") from None


def structural_tag_grammar(text: str) -> xgr.Grammar:
    """The grammar of a structural tag's JSON: vLLM's form (``structures`` of ``begin``/``schema``/``end`` and the
    ``triggers`` that start them) or xgrammar's own (``{"type": "structural_tag", "format": ...}``)."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("a structural tag is a JSON object")
    if "structures" not in spec:
        return xgr.Grammar.from_structural_tag(spec)
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers \
            or not all(isinstance(s, dict) and {"begin", "schema", "end"} <= set(s) for s in structures):
        raise ValueError("give structures: [{begin, schema, end}, ...] and triggers: [...], both non-empty")
    tags = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"], schema=json.dumps(s["schema"]))
            for s in structures]
    return xgr.Grammar.from_structural_tag(tags, triggers)


def _clean(message: str) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    first = lines[0] if lines else message
    if first.startswith("[") and ": " in first:
        first = first.split(": ", 1)[1]
        if ".cc:" in first and ": " in first:
            first = first.split(": ", 1)[1]
    return first


class GrammarCache:
    """Compiles constraints for one tokenizer, once per distinct constraint."""

    def __init__(self, hf_tokenizer: object, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        # What a finished grammar allows (EOS again, e.g. under ignore_eos): only the stop tokens.
        self._stop_only = torch.zeros(xgr.get_bitmask_shape(1, vocab_size)[1], dtype=torch.int32)
        self._stop_ids = tuple(sorted(stop_token_ids))
        for token in stop_token_ids:
            self._stop_only[token // 32] |= _bit(token % 32)
        self._compiled: dict[tuple[str, str], xgr.CompiledGrammar] = {}

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, tokenizer_dir: Path | None = None) -> GrammarCache:
        """The grammars of the model in ``model_dir``, over its tokenizer or the one in ``tokenizer_dir``."""
        from pagellm.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(tokenizer_dir or model_dir, config_dir=model_dir)
        return cls(tokenizer._hf, vocab_size, tokenizer.eos_token_ids)  # noqa: SLF001 (the HF object is needed)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile(self, so: StructuredOutputsParams) -> xgr.CompiledGrammar:
        key = so.key
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile(*key)
        return compiled

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else _ANY_OBJECT_SCHEMA
            ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
            for old, new in _STRING_CHARS.items():
                ebnf = ebnf.replace(old, new)
            return self._compiler.compile_grammar(ebnf)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(text))
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "structural_tag":
            return self._compiler.compile_grammar(structural_tag_grammar(text))
        return self._compiler.compile_grammar(text)

    def matcher(self, so: StructuredOutputsParams, output_token_ids: Sequence[int]) -> RequestGrammar:
        return RequestGrammar(xgr.GrammarMatcher(self.compile(so)), output_token_ids, self._stop_only,
                              so.begin_after or (), self._stop_ids)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)


class RequestGrammar:
    """One request's position in its grammar; with ``begin_after``, free output until those tokens appear."""

    def __init__(self, matcher: xgr.GrammarMatcher, output_token_ids: Sequence[int],
                 stop_only: torch.Tensor, begin_after: Sequence[int] = (),
                 stop_ids: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self._stop_only = stop_only
        self.stop_ids = stop_ids  # the tokenizer's EOS ids, shared by every request
        self._marker = list(begin_after)
        self._tail: list[int] = []  # while waiting: the output's last tokens that may begin the marker
        self.constraining = not self._marker
        self.accept(output_token_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.constraining:
            bitmask[row] = -1  # every token allowed
        elif self._matcher.is_terminated():  # the grammar is done and the request goes on (ignore_eos)
            bitmask[row] = self._stop_only
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_ids: Sequence[int]) -> None:
        if not self.constraining:
            token_ids = self._wait(token_ids)
        for token in token_ids:
            if self._matcher.is_terminated():
                return  # past the grammar's end (a stop token): nothing more to follow
            if not self._matcher.accept_token(token) and token not in self.stop_ids:  # a stop: a dead end ended
                logger.warning("token %d does not follow the request's grammar", token)

    def _wait(self, token_ids: Sequence[int]) -> Sequence[int]:
        """The tokens after the marker's first appearance (none while it has not appeared)."""
        seen, size = self._tail + list(token_ids), len(self._marker)
        for end in range(size, len(seen) + 1):
            if seen[end - size:end] == self._marker:
                self.constraining, self._tail = True, []
                return seen[end:]
        self._tail = seen[-(size - 1):] if size > 1 else []
        return ()

    @property
    def is_terminated(self) -> bool:
        return self.constraining and self._matcher.is_terminated()


def _bit(position: int) -> int:
    """Bit ``position`` of an int32 bitmask word, as the signed value torch stores."""
    return (1 << position) - (1 << 32) if position == 31 else 1 << position


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of tokens the grammar forbids to -inf, on ``rows`` only (in place, float32 logits)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
