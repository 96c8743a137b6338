"""IncrementalDetokenizer against full decodes with real (tiny, locally built) tokenizers, and stop strings."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagellm.engine.detokenizer import IncrementalDetokenizer, longest_partial_stop
from pagellm.sampling_params import SamplingParams

_CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.",
           "Stop here please. The end is near, said the quick fox."] * 4
_SPECIALS = ["<s>", "</s>", "<unk>"]


def _byte_level_bpe() -> Tokenizer:
    """GPT-2 style: byte-level pre-tokenizer and decoder; characters outside the corpus become single bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _llama_style() -> Tokenizer:
    """SentencePiece/Llama style: Metaspace '▁', <0xNN> byte fallback, and a decoder that strips one leading space.

    The first generated token's leading space only survives when the stream is primed with the prompt.
    """
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=_SPECIALS,
                                                             show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(_SPECIALS)
    return tok


@pytest.fixture(scope="module", params=["byte_level", "llama"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return _byte_level_bpe() if request.param == "byte_level" else _llama_style()


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return _byte_level_bpe()


def _feed(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids ``chunk`` at a time, collecting streamed deltas; stop early like the engine would on a stop."""
    deltas: list[str] = []
    for start in range(0, len(ids), chunk):
        stop = detok.update(ids[start:start + chunk])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


def _expected(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    return full[len(tok.decode(prompt, skip_special_tokens=skip)):]


# ---- plain incremental decoding --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, output", [
    ("Hello", "world, the quick brown fox"),
    ("The end is", " near, café naïve"),
    ("Stop", " 😀👍 emoji and 你好 done"),
    ("😀", "é😀x"),
    ("", "the lazy dog"),
    ("Hello world, the quick brown fox jumps over the lazy dog.", " Stop here"),  # longer than the prime window
    ("Hi 😀😀😀!", "😀 ok"),  # the prime window starts inside a multi-byte character
])
@pytest.mark.parametrize("chunk", [1, 3])
def test_matches_full_decode(tokenizer: Tokenizer, prompt: str, output: str, chunk: int) -> None:
    prompt_ids = tokenizer.encode(prompt).ids
    output_ids = tokenizer.encode(output).ids
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    deltas, stop = _feed(detok, output_ids, chunk)
    expected = _expected(tokenizer, prompt_ids, output_ids)
    assert stop is None
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert "\ufffd" not in expected  # the cases really complete their multi-byte characters


def test_multibyte_character_waits_for_its_last_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x😀").ids
    assert len(ids) >= 4  # the emoji is split into byte tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello").ids, SamplingParams())
    texts = []
    for token_id in ids:
        detok.update([token_id])
        texts.append(detok.output_text)
    assert texts[-2].endswith("x") and texts[-1].endswith("x😀")  # no replacement char on the way
    assert all("\ufffd" not in text for text in texts)


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    """Ids cut mid-emoji (a client continuing a truncated generation): the completed character is output."""
    ids = tokenizer.encode("Hello world, the quick brown fox 😀").ids
    prompt_ids, output_ids = ids[:-2], ids[-2:] + tokenizer.encode(" ok").ids
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    deltas, _ = _feed(detok, output_ids)
    assert detok.output_text == "".join(deltas) == "😀 ok"


def test_accepts_a_transformers_fast_tokenizer() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_llama_style())
    prompt_ids = hf.encode("Hello")
    output_ids = hf.encode(" world café 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(hf, prompt_ids, SamplingParams())
    detok.update(output_ids)
    assert detok.output_text == hf.decode(prompt_ids + output_ids)[len(hf.decode(prompt_ids)):] == " world café 😀"


def test_first_token_keeps_its_leading_space_with_metaspace() -> None:
    tok = _llama_style()
    output_ids = tok.encode("world").ids  # '▁world': a lone decode would strip the space
    assert not tok.decode(output_ids).startswith(" ")
    detok = IncrementalDetokenizer(tok, tok.encode("Hello").ids, SamplingParams())
    detok.update(output_ids)
    assert detok.output_text == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    eos = tokenizer.token_to_id("</s>")
    prompt_ids = [tokenizer.token_to_id("<s>")] + tokenizer.encode("Hello").ids
    output_ids = tokenizer.encode(" the end").ids + [eos]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(skip_special_tokens=skip))
    deltas, _ = _feed(detok, output_ids)
    assert "".join(deltas) == detok.output_text == _expected(tokenizer, prompt_ids, output_ids, skip)
    assert detok.output_text.endswith("</s>") != skip


def test_detokenize_false_records_ids_only(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, [1, 2], SamplingParams(detokenize=False, stop_token_ids=[5]))
    assert detok.update([10, 11]) is None
    assert detok.output_token_ids == [10, 11]
    assert detok.output_text == "" and detok.get_next_output_text(finished=True, delta=False) == ""


def test_non_delta_returns_everything_so_far(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, [], SamplingParams())
    detok.update(bpe.encode("the quick").ids)
    assert detok.get_next_output_text(finished=False, delta=False) == "the quick"
    detok.update(bpe.encode(" fox").ids)
    assert detok.get_next_output_text(finished=False, delta=False) == "the quick fox"
    assert detok.get_next_output_text(finished=False, delta=True) == "the quick fox"
    assert detok.get_next_output_text(finished=True, delta=True) == ""


# ---- stop strings ------------------------------------------------------------------------------------------------

def _stop_run(tok: Tokenizer, output: str, chunk: int = 1, **kwargs: object) -> tuple[IncrementalDetokenizer,
                                                                                     list[str], str | None]:
    detok = IncrementalDetokenizer(tok, tok.encode("Hello").ids, SamplingParams(**kwargs))  # type: ignore[arg-type]
    deltas, stop = _feed(detok, tok.encode(output).ids, chunk)
    return detok, deltas, stop


def test_stop_within_one_token(bpe: Tokenizer) -> None:
    assert "Ġquick" in bpe.encode(" the quick brown").tokens
    detok, deltas, stop = _stop_run(bpe, " the quick brown", stop="uic")
    assert stop == "uic" and detok.stop_reason == "uic"
    assert detok.output_text == "".join(deltas) == " the q"


def test_stop_spanning_tokens(tokenizer: Tokenizer) -> None:
    detok, deltas, stop = _stop_run(tokenizer, " the quick brown fox jumps", stop="k brown f")
    assert stop == "k brown f"
    assert detok.output_text == "".join(deltas) == " the quic"


def test_stop_at_the_very_start(tokenizer: Tokenizer) -> None:
    detok, deltas, stop = _stop_run(tokenizer, " the quick brown", stop=" the")
    assert stop == " the" and detok.output_text == "" and deltas == [""] * len(deltas)


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    detok, deltas, stop = _stop_run(tokenizer, " the quick brown fox", stop="quick",
                                    include_stop_str_in_output=True)
    assert stop == "quick" and detok.output_text == "".join(deltas) == " the quick"


@pytest.mark.parametrize("stops", [["fox", "quick"], ["quick", "fox"], ["absent", "ck b", "quick"]])
@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_wins(tokenizer: Tokenizer, stops: list[str], chunk: int) -> None:
    detok, deltas, stop = _stop_run(tokenizer, " so quick brown fox", chunk, stop=stops)
    text = _expected(tokenizer, tokenizer.encode("Hello").ids, tokenizer.encode(" so quick brown fox").ids)
    first = min((s for s in stops if s in text), key=text.index)
    assert stop == first
    assert detok.output_text == "".join(deltas) == text[:text.index(first)]


def test_same_start_prefers_the_stop_listed_first(bpe: Tokenizer) -> None:
    _, _, stop = _stop_run(bpe, " the quick brown", chunk=100, stop=["quick b", "qu"])
    assert stop == "quick b"


def test_partial_stop_is_held_back_then_released(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, bpe.encode("Hello").ids, SamplingParams(stop="the lazy cat"))
    assert detok.update(bpe.encode(" over").ids) is None
    assert detok.get_next_output_text(finished=False, delta=True) == " over"
    assert detok.update(bpe.encode(" the lazy").ids) is None
    assert detok.get_next_output_text(finished=False, delta=True) == " "  # "the lazy" may begin the stop
    assert detok.update(bpe.encode(" dog").ids) is None
    assert detok.get_next_output_text(finished=False, delta=True) == "the lazy dog"
    assert detok.output_text == " over the lazy dog"


def test_partial_stop_is_emitted_at_finish(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop=["the lazy cat", "dog."]))
    detok.update(bpe.encode("over the la").ids)
    assert detok.get_next_output_text(finished=False, delta=True) == "over "
    assert detok.get_next_output_text(finished=False, delta=False) == "over "
    assert detok.get_next_output_text(finished=True, delta=True) == "the la"
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_text_after_stop_is_never_emitted(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop="fox"))
    assert detok.update(bpe.encode("the quick brown fox jumps over").ids) == "fox"
    assert detok.update(bpe.encode(" the lazy dog").ids) is None  # later updates are no-ops
    assert detok.get_next_output_text(finished=False, delta=True) == "the quick brown "
    assert detok.get_next_output_text(finished=True, delta=False) == "the quick brown "
    assert detok.output_text == "the quick brown "


def test_stop_completing_a_multibyte_character(tokenizer: Tokenizer) -> None:
    detok, deltas, stop = _stop_run(tokenizer, " café au lait", stop="é")
    assert stop == "é" and detok.output_text == "".join(deltas) == " caf"


def test_stop_within_min_tokens_is_ignored(bpe: Tokenizer) -> None:
    ids = bpe.encode("the fox said the fox").ids  # tokens: the, Ġfox, Ġsaid, Ġthe, Ġfox
    assert len(ids) == 5
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop="fox", min_tokens=2))
    deltas, stop = _feed(detok, ids, chunk=1)
    assert stop == "fox" and detok.output_text == "the fox said the "
    # the same in one update that crosses the min_tokens boundary
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop="fox", min_tokens=2))
    assert detok.update(ids) == "fox" and detok.output_text == "the fox said the "


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_delta_mode_never_repeats_text(tokenizer: Tokenizer, chunk: int) -> None:
    text = " the quick brown fox jumps over the lazy dog, said the café 😀 fox"
    detok, deltas, stop = _stop_run(tokenizer, text, chunk, stop=["the lazy cat", "dog, said the caf\u00e9 😀 fo!"])
    assert stop is None
    assert "".join(deltas) == detok.output_text == _expected(tokenizer, tokenizer.encode("Hello").ids,
                                                              tokenizer.encode(text).ids)


@pytest.mark.parametrize("text, stops, expected", [
    ("abc", ["cde"], 1),
    ("abcd", ["bcdx", "cdy"], 3),
    ("aaa", ["aab"], 2),
    ("x", ["abc"], 0),
    ("", ["abc"], 0),
    ("ab", ["abcdef"], 2),
    ("abc", ["abc"], 0),  # a complete stop is a match, not a partial one
    ("xab", ["a", "b"], 0),  # one-character stops can never be partial
])
def test_longest_partial_stop(text: str, stops: list[str], expected: int) -> None:
    assert longest_partial_stop(text, stops) == expected


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ended_a_request_shows_only_when_asked(tokenizer: Tokenizer, include: bool) -> None:
    """As vLLM: the EOS (or stop_token_ids) token that ended the request is no part of its text, special tokens
    kept or not (gpt-oss's <|return|> and <|call|>), unless include_stop_str_in_output."""
    eos = tokenizer.token_to_id("</s>")
    prompt_ids = tokenizer.encode("Hello").ids
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    body = tokenizer.encode(" the end").ids
    assert detok.update(body[:1]) is None and detok.update(body[1:] + [eos], stop_terminated=True) is None
    assert detok.output_token_ids == body + [eos]
    assert detok.output_text == _expected(tokenizer, prompt_ids, body + [eos] if include else body, False)
    assert detok.output_text.endswith("</s>") == include
