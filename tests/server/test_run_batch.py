"""``pagellm run-batch``: a file of OpenAI Batch API lines through the real CLI; each answer equals what the live
server sends for the same body (chat, completions, embeddings, responses), refusals carry the server's status and
error, lines that are no request get an error naming the problem, and the output keeps the input's order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_utils import ENGINE_FLAGS, ServerProcess

GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **GREEDY}
COMPLETION = {"model": "tiny", "prompt": "The sky is", "max_tokens": 6, **GREEDY}
EMBEDDING = {"model": "tiny", "input": ["a cat", "a dog"]}
RESPONSE = {"model": "tiny", "input": "Hi", "max_output_tokens": 5, **GREEDY}
GOOD = [("chat", "/v1/chat/completions", CHAT), ("completion", "/v1/completions", COMPLETION),
        ("embedding", "/v1/embeddings", EMBEDDING), ("response", "/v1/responses", RESPONSE)]


def _line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


@pytest.fixture(scope="module")
def answers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("batch")
    lines = [_line(name, url, body) for name, url, body in GOOD] + [
        _line("too-hot", "/v1/chat/completions", {**CHAT, "temperature": 5}),
        _line("no-model", "/v1/completions", {**COMPLETION, "model": "gpt-9"}),
        "{not json",
        "",
        _line("streamed", "/v1/chat/completions", {**CHAT, "stream": True}),
        _line("files", "/v1/files", {}),
        _line("get", "/v1/completions", COMPLETION, method="GET"),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    ]
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = folder / "out.jsonl"
    run = subprocess.run([sys.executable, "-m", "pagellm.cli", "run-batch", "-i", str(folder / "in.jsonl"), "-o",
                          str(out), str(tiny_llama), "--served-model-name", "tiny", *ENGINE_FLAGS],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == len(lines) - 1  # the blank line is skipped
    assert not list(folder.glob(".*partial"))
    return {str(a["custom_id"]) if a["custom_id"] is not None else f"line-{i}": a for i, a in enumerate(written)}


def test_answers_equal_the_servers_in_input_order(answers: dict[str, dict], server: ServerProcess) -> None:
    assert list(answers)[:4] == [name for name, _, _ in GOOD]
    for name, url, body in GOOD:
        answer = answers[name]
        assert answer["error"] is None and answer["id"].startswith("batch_req_")
        assert answer["response"]["status_code"] == 200 and answer["response"]["request_id"]
        got = answer["response"]["body"]
        live = httpx.post(f"{server.base_url}{url}", json=body, timeout=60).json()
        if name == "chat":
            assert got["choices"][0]["message"]["content"] == live["choices"][0]["message"]["content"]
            assert (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (
                live["usage"]["prompt_tokens"], 8)
        elif name == "completion":
            assert got["choices"][0]["text"] == live["choices"][0]["text"] and got["usage"]["completion_tokens"] == 6
        elif name == "embedding":
            for mine, theirs in zip(got["data"], live["data"]):
                assert mine["embedding"] == pytest.approx(theirs["embedding"], abs=1e-5)
        else:
            assert got["object"] == "response" and got["output"][0]["content"][0]["text"] == \
                live["output"][0]["content"][0]["text"]


def test_refusals_carry_the_servers_status_and_error(answers: dict[str, dict]) -> None:
    hot = answers["too-hot"]["response"]
    assert hot["status_code"] == 400 and "temperature" in hot["body"]["error"]["message"]
    missing = answers["no-model"]["response"]
    assert missing["status_code"] == 404 and "The model `gpt-9` does not exist" in missing["body"]["error"]["message"]


@pytest.mark.parametrize(("custom_id", "code", "message"), [
    ("line-6", "invalid_json", "the line is not JSON"),
    ("streamed", "invalid_request", "stream: true is not supported in a batch"),
    ("files", "invalid_url", "url '/v1/files' is not served in a batch"),
    ("get", "invalid_request", "method must be POST, got 'GET'"),
    ("no-body", "invalid_request", "the line lacks body"),
])
def test_lines_that_are_no_request_get_an_error(answers: dict[str, dict], custom_id: str, code: str,
                                                message: str) -> None:
    answer = answers[custom_id]
    assert answer["response"] is None and answer["error"]["code"] == code and message in answer["error"]["message"]


def test_a_missing_input_file_is_a_clear_error(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "pagellm.cli", "run-batch", "-i", str(tmp_path / "nope.jsonl"),
                          "-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "cannot read the batch input" in run.stderr and "no such file" in run.stderr
