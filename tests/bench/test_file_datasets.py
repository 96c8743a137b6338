"""Datasets from the user's files: ShareGPT conversations (vLLM's rules with a tokenizer) and JSON Lines requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm.bench import datasets
from pagellm.bench.datasets import DatasetOptions
from pagellm.bench.serve import to_endpoint


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word (the loaders take any counting function)."""
    return len(text.split())


def _sharegpt(tmp_path: Path, conversations: list) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    return str(path)


def _turns(*pairs: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in pairs]}


def test_sharegpt_sends_first_user_turns_with_their_replies_lengths(tmp_path: Path) -> None:
    path = _sharegpt(tmp_path, [
        _turns(("system", "be brief"), ("human", "one two three four"), ("gpt", "a b c d e f"),
               ("human", "later turn is not used"), ("gpt", "x y z w")),
        {"messages": [{"role": "user", "content": "five six seven eight nine"},
                      {"role": "assistant", "content": "g h i j k l m"}]},
        _turns(("gpt", "an opener by the model"), ("human", "ten eleven twelve thirteen"), ("gpt", "n o p q")),
    ])
    reqs = datasets.load("sharegpt", DatasetOptions(num_prompts=3, path=path, count_tokens=words, seed=5))
    got = sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs)
    assert got == [("five six seven eight nine", 5, 7), ("one two three four", 4, 6),
                   ("ten eleven twelve thirteen", 4, 4)]
    assert all(not r.is_chat and r.ignore_eos for r in reqs)
    again = datasets.load("sharegpt", DatasetOptions(num_prompts=3, path=path, count_tokens=words, seed=5))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # seeded order
    cycled = datasets.load("sharegpt", DatasetOptions(num_prompts=7, path=path, count_tokens=words, seed=5))
    assert [r.prompt for r in cycled] == [r.prompt for r in reqs] * 2 + [reqs[0].prompt]


def test_sharegpt_filters_like_vllm_with_a_tokenizer_and_keeps_all_without(tmp_path: Path) -> None:
    ok = _turns(("human", "w " * 10), ("gpt", "r " * 10))
    path = _sharegpt(tmp_path, [
        ok,
        _turns(("human", "too short"), ("gpt", "r " * 10)),           # prompt under 4 tokens
        _turns(("human", "v " * 10), ("gpt", "tiny")),                # reply under 4 tokens
        _turns(("human", "w " * 1025), ("gpt", "r " * 10)),           # prompt over 1,024
        _turns(("human", "w " * 1000), ("gpt", "r " * 1049)),         # both over 2,048
        _turns(("human", "only a question")),                         # no reply
        {"conversations": "not a list"}, "not an object",
    ])
    reqs = datasets.load("sharegpt", DatasetOptions(num_prompts=4, path=path, count_tokens=words))
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(10, 10)}
    plain = datasets.load("sharegpt", DatasetOptions(num_prompts=40, path=path, output_len=9))
    assert len({r.prompt for r in plain}) == 5  # every conversation with a reply, lengths unknown
    assert all(r.prompt_len is None and r.output_len == 9 for r in plain)


def test_custom_jsonl_prompts_ids_messages_and_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    lines = [{"prompt": "hello there", "max_tokens": 3}, {"prompt": [101, 102, 103]},
             {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "max_tokens": 5}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    reqs = datasets.load("custom", DatasetOptions(num_prompts=3, path=str(path), output_len=7))
    by_kind = {("chat" if r.is_chat else type(r.prompt).__name__): r for r in reqs}
    assert (by_kind["str"].prompt, by_kind["str"].output_len, by_kind["str"].prompt_len) == ("hello there", 3, None)
    assert (by_kind["list"].prompt, by_kind["list"].output_len, by_kind["list"].prompt_len) == ([101, 102, 103], 7, 3)
    assert by_kind["chat"].messages == lines[2]["messages"] and by_kind["chat"].output_len == 5


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a"}\n{"prompt": ', "line 2 is not JSON"),
    ('["a"]', "line 1: each line is a JSON object"),
    ('{"prompt": "a", "messages": []}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string or a list of token ids"),
    ('{"prompt": [1, "2"]}', "non-empty string or a list of token ids"),
    ('{"messages": [{"role": "user"}]}', "'messages' is a non-empty list"),
    ('{"prompt": "a", "max_tokens": 0}', "'max_tokens' must be a positive integer"),
    ("\n\n", "holds no usable custom entry"),
    ('{"prompt": "a", "timestamp": -1}', "'timestamp' is a number of seconds, 0 or more"),
    ('{"prompt": "a", "timestamp": "soon"}', "'timestamp' is a number of seconds"),
    ('{"prompt": "a", "timestamp": 1}\n{"prompt": "b"}', "line 2: a 'timestamp' on some lines and not others"),
])
def test_custom_file_errors_say_where_and_what(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        datasets.load("custom", DatasetOptions(path=str(path)))


def test_file_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--dataset-path FILE"):
        datasets.load("sharegpt", DatasetOptions())
    with pytest.raises(ValueError, match="--dataset-path is read by --dataset sharegpt or custom, not random"):
        datasets.load("random", DatasetOptions(path=str(tmp_path / "data.json")))  # not silently unused
    with pytest.raises(ValueError, match="cannot read the custom dataset"):
        datasets.load("custom", DatasetOptions(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "lines.json").write_text('{"a": 1}\n{"b": 2}\n')
    with pytest.raises(ValueError, match="is not JSON .*one JSON list"):
        datasets.load("sharegpt", DatasetOptions(path=str(tmp_path / "lines.json")))
    with pytest.raises(ValueError, match="no usable sharegpt entry"):
        datasets.load("sharegpt", DatasetOptions(path=_sharegpt(tmp_path, [_turns(("gpt", "hi"))])))


def test_endpoint_choice_converts_text_and_refuses_what_cannot_go() -> None:
    text = datasets.BenchRequest("write a poem", 4)
    ids = datasets.BenchRequest([101, 102], 4, 2)
    chat = datasets.BenchRequest(None, 4, messages=[{"role": "user", "content": "hi"}])
    assert to_endpoint([text, ids, chat], "auto") == [text, ids, chat]
    (sent,) = to_endpoint([text], "chat")
    assert sent.is_chat and sent.messages == [{"role": "user", "content": "write a poem"}] and sent.output_len == 4
    assert to_endpoint([text, ids], "completions") == [text, ids]
    with pytest.raises(ValueError, match="token-id prompts .* completions endpoint only"):
        to_endpoint([ids], "chat")
    with pytest.raises(ValueError, match="go to the chat endpoint"):
        to_endpoint([chat], "completions")


def test_a_timed_trace_keeps_its_time_order_and_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt": "c", "timestamp": 12.5, "max_tokens": 3}\n{"prompt": "a", "timestamp": 10}\n'
                    '{"prompt": [5, 6], "timestamp": 11.0}\n{"prompt": "d", "timestamp": 30}\n')
    requests = datasets.load("custom", DatasetOptions(path=str(path), num_prompts=3, output_len=7, seed=4))
    assert [(r.prompt, r.arrival, r.output_len) for r in requests] == [("a", 0.0, 7), ([5, 6], 1.0, 7), ("c", 2.5, 3)]
    assert datasets.load("custom", DatasetOptions(path=str(path), num_prompts=3, seed=9))[0].prompt == "a"  # no shuffle
    with pytest.raises(ValueError, match="timed trace of 4 requests: pass --num-prompts 4 or fewer"):
        datasets.load("custom", DatasetOptions(path=str(path), num_prompts=5))
