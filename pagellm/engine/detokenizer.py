"""Incremental detokenization and stop-string matching for one request (frontend side; no torch).

Contract:
- ``update(ids)`` appends generated token ids and decodes them with ``tokenizers``' ``DecodeStream``. The stream
  is primed with the last few prompt ids, so the first generated token decodes as it would after the prompt
  (its leading space under Metaspace/SentencePiece decoders, byte-fallback pieces): the text equals
  ``decode(prompt + output)[len(decode(prompt)):]``. Tokens that end inside a multi-byte UTF-8 character add no
  text until the character completes. One deliberate difference: when the prompt itself ends inside a character
  that the output completes, the whole character is output text (the formula above would drop it).
- Stop strings: after each update the newly appended text (plus enough lookback to catch a stop spanning the
  boundary) is searched. The earliest match wins (ties: the one listed first); the text is cut at the match
  start, or after the stop string with ``include_stop_str_in_output``; ``update`` returns the stop string and
  every later ``update`` is a no-op. A stop string completed by one of the first ``min_tokens`` tokens does not
  count (those tokens may not end the request).
- ``get_next_output_text(finished, delta)`` never returns text that may still turn out to be the start of a stop
  string (the longest suffix that is a proper prefix of some stop is held back) unless ``finished``; with
  ``delta=True`` each character is returned exactly once.
- ``detokenize=False``: only token ids are recorded; all text is ``""``.
- Token ids are never cut: ids after a stop string within the same update stay in ``output_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from pagellm.sampling_params import SamplingParams

# How many trailing prompt ids prime the decode stream. Decoders only look back a few tokens (a leading-space
# strip, an unfinished UTF-8 character), and priming with the whole prompt would re-decode it once per request.
_PRIME_TOKENS = 8
# A UTF-8 character is at most 4 bytes, so a window starting inside one is fixed by stepping back at most 3 ids.
_MAX_CONTINUATION_BYTES = 3


class IncrementalDetokenizer:
    """Turns one request's token-id deltas into text deltas and detects stop strings (see module docstring)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        # Accept a transformers fast tokenizer too: DecodeStream needs the Rust-backed `tokenizers.Tokenizer`.
        self.tokenizer: tokenizers.Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the text, once one has matched
        self._stops: list[str] = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._text = ""
        self._emitted = 0  # characters of _text already returned in delta mode
        self._stop_floor = 0  # a stop must end after this offset: the text of the first min_tokens tokens
        self._stream: DecodeStream | None = None
        if params.detokenize:
            prime, pending = split_prime(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            self._stream = DecodeStream(prime, skip_special_tokens=params.skip_special_tokens)
            if pending:
                # Buffered, not emitted: they end inside a character, so the stream returns nothing yet.
                self._stream.step(self.tokenizer, pending)

    @property
    def output_text(self) -> str:
        """All text decoded so far (cut at a matched stop), including any held-back partial stop."""
        return self._text

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append generated ids; return the stop string that matched (and cut the text there), else None.
        ``stop_terminated``: the last id is the stop token (EOS, or one of ``stop_token_ids``) that ended the request,
        whose text the output leaves out unless ``include_stop_str_in_output`` (as vLLM does; with
        ``skip_special_tokens`` off it would otherwise show)."""
        if self.stop_reason is not None:
            return None
        self.output_token_ids.extend(new_token_ids)
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        if self._stream is None or not new_token_ids:
            return None
        old_len = len(self._text)
        self._decode(new_token_ids)
        if not self._stops or len(self.output_token_ids) <= self._min_tokens:
            return None
        return self._check_stop(old_len)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: everything (``delta=False``) or only what was not returned before.

        Unless ``finished`` (or a stop has matched), a trailing partial stop string is held back.
        """
        end = len(self._text)
        if not finished and self.stop_reason is None:
            end -= longest_partial_stop(self._text, self._stops)
        if not delta:
            return self._text[:end]
        text = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return text

    def _decode(self, token_ids: Sequence[int]) -> None:
        """Step the stream once per id; note where the first ``min_tokens`` tokens' text ends."""
        assert self._stream is not None
        pieces: list[str] = []
        length = len(self._text)
        count = len(self.output_token_ids) - len(token_ids)
        for token_id in token_ids:
            piece = self._stream.step(self.tokenizer, int(token_id))
            if piece:
                pieces.append(piece)
                length += len(piece)
            count += 1
            if count == self._min_tokens:
                self._stop_floor = length
        self._text += "".join(pieces)

    def _check_stop(self, old_len: int) -> str | None:
        """Find the earliest stop ending in the new text (after old_len) and past the min_tokens floor."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = max(0, old_len - len(stop) + 1, self._stop_floor - len(stop) + 1)
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[:index + len(stop) if self._include_stop else index]
        self.stop_reason = stop
        return stop


def split_prime(tokenizer: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
                skip_special_tokens: bool) -> tuple[list[int], list[int]]:
    """Split the prompt's tail into (ids that prime the stream, ids of an unfinished trailing character).

    The window starts on a character boundary: one starting inside a multi-byte character decodes to U+FFFD, and
    byte-fallback decoders then turn the whole byte run (valid characters after it included) into U+FFFD, which
    the stream would re-emit as output. A prompt that ends inside a character (ids sent by a client, cut
    mid-emoji) primes with the complete part; the rest is fed to the stream as pending, so the character the
    output completes is emitted as output text instead of the stream re-emitting the prompt's tail.
    """
    ids = [int(t) for t in prompt_token_ids[-(_PRIME_TOKENS + _MAX_CONTINUATION_BYTES):]]
    start = max(0, len(ids) - _PRIME_TOKENS)
    for _ in range(_MAX_CONTINUATION_BYTES):
        if start == 0 or not _decode(tokenizer, ids[start:], skip_special_tokens).startswith("\ufffd"):
            break
        start -= 1
    window = ids[start:]
    for cut in range(len(window), max(0, len(window) - _MAX_CONTINUATION_BYTES) - 1, -1):
        if not _decode(tokenizer, window[:cut], skip_special_tokens).endswith("\ufffd"):
            return window[:cut], window[cut:]
    return window, []  # U+FFFD that no cut removes is literal prompt text, not an unfinished character


def _decode(tokenizer: tokenizers.Tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def longest_partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string (0 if none).

    Candidates are only the positions in the last len(stop) - 1 characters holding the stop's first character,
    scanned longest first, so the usual case costs one ``str.find`` per stop.
    """
    best = 0
    for stop in stops:
        position = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while position != -1 and len(text) - position > best:
            if stop.startswith(text[position:]):
                best = len(text) - position
                break
            position = text.find(stop[0], position + 1)
    return best
