"""SamplingParams: defaults, normalisation, validation messages and the msgpack round trip."""

from __future__ import annotations

import msgspec
import pytest

from pagellm.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert p.output_kind == RequestOutputKind.CUMULATIVE


def test_from_optional_and_clone_as_vllms() -> None:
    p = SamplingParams.from_optional(max_tokens=None, temperature=0.5, stop=None, seed=4)
    assert (p.max_tokens, p.temperature, p.stop, p.seed) == (16, 0.5, [], 4)  # None: the field's default
    original = SamplingParams(stop=["x"], stop_token_ids=[3])
    copy = original.clone()
    copy.stop.append("y")
    copy.stop_token_ids.append(4)
    assert original == SamplingParams(stop=["x"], stop_token_ids=[3]) and copy.stop == ["x", "y"]


def test_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=0, stop_token_ids=(7, 8))  # type: ignore[arg-type]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert p.stop == ["###"] and p.stop_strings == ["###"]
    assert p.top_k == 0
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert p.stop_token_ids == [7, 8]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature, expected", [
    (0.0, SamplingType.GREEDY), (1e-6, SamplingType.GREEDY), (1e-5, SamplingType.RANDOM), (0.7, SamplingType.RANDOM),
])
def test_sampling_type(temperature: float, expected: SamplingType) -> None:
    p = SamplingParams(temperature=temperature)
    assert p.sampling_type is expected
    assert p.is_greedy == (expected is SamplingType.GREEDY)


def test_seed_makes_random_seeded_but_not_greedy() -> None:
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(seed=3, temperature=0.0).sampling_type is SamplingType.GREEDY


@pytest.mark.parametrize("kwargs, fragments", [
    ({"n": 0}, ["n must", "at least 1", "got 0"]),
    ({"temperature": -0.1}, ["temperature", ">= 0", "-0.1"]),
    ({"temperature": float("nan")}, ["temperature", "nan"]),
    ({"temperature": float("inf")}, ["temperature", "finite", "inf"]),
    ({"top_p": 0.0}, ["top_p", "(0, 1]", "0.0"]),
    ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
    ({"top_p": float("nan")}, ["top_p", "nan"]),
    ({"top_k": -2}, ["top_k", "-1, 0", "-2"]),
    ({"min_p": -0.1}, ["min_p", "[0, 1]", "-0.1"]),
    ({"min_p": 1.1}, ["min_p", "[0, 1]", "1.1"]),
    ({"max_tokens": 0}, ["max_tokens", "at least 1", "got 0"]),
    ({"min_tokens": -1}, ["min_tokens", ">= 0", "-1"]),
    ({"min_tokens": 5, "max_tokens": 4}, ["min_tokens", "<= max_tokens (4)", "5"]),
    ({"stop": ""}, ["stop", "non-empty", "''"]),
    ({"stop": ["ok", ""]}, ["stop", "non-empty", "''"]),
    ({"stop_token_ids": [-1]}, ["stop_token_ids", "non-negative", "-1"]),
    ({"temperature": "hot"}, ["temperature", "number", "'hot'"]),
    ({"n": 1.5}, ["n must be an integer", "1.5"]),
    ({"top_k": True}, ["top_k", "integer", "True"]),
    ({"stop": "x", "detokenize": False}, ["detokenize=True", "stop_token_ids"]),
])
def test_validation_names_field_value_and_fix(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_valid_edges_accepted() -> None:
    p = SamplingParams(top_p=1e-9, min_p=1.0, top_k=1, max_tokens=1, min_tokens=1)
    assert p.top_k == 1
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(stop_token_ids=[1], detokenize=False).stop_token_ids == [1]


def test_msgpack_round_trip() -> None:
    p = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=-7, max_tokens=None,
                       min_tokens=3, stop=["\n\n", "END"], stop_token_ids=[2], ignore_eos=True,
                       include_stop_str_in_output=True, skip_special_tokens=False,
                       spaces_between_special_tokens=False, detokenize=True)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert decoded == p
    default = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()), type=SamplingParams)
    assert default == SamplingParams()


def test_msgpack_decode_normalises_and_validates() -> None:
    raw = msgspec.msgpack.encode({"stop": "x", "top_k": -1})
    p = msgspec.msgpack.decode(raw, type=SamplingParams)
    assert p.stop == ["x"] and p.top_k == 0
    with pytest.raises(ValueError, match="top_p"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"top_p": 2.0}), type=SamplingParams)


def test_omit_defaults_keeps_wire_small() -> None:
    wire = msgspec.msgpack.encode(SamplingParams(temperature=0.0, stop=None, stop_token_ids=None))
    assert msgspec.msgpack.decode(wire) == {"temperature": 0.0}


def test_begin_after_must_be_token_ids_in_the_vocabulary() -> None:
    from pagellm.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="begin_after must be a non-empty list of token ids"):
        StructuredOutputsParams(regex="a", begin_after=[])
    with pytest.raises(ValueError, match="begin_after must be a non-empty list of token ids"):
        StructuredOutputsParams(regex="a", begin_after=["</think>"])
    params = SamplingParams(structured_outputs={"regex": "a", "begin_after": [5, 999]})
    with pytest.raises(ValueError, match=r"begin_after: token ids must be in \[0, 320\), got \[999\]"):
        params.check_token_ids(320)
    SamplingParams(structured_outputs={"regex": "a", "begin_after": [5, 9]}).check_token_ids(320)
