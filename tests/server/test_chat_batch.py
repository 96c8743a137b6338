"""vLLM's ``POST /v1/chat/completions/batch`` on a live server: each conversation's reply equals the chat endpoint's
reply to it alone, in order; usage adds up; a client that goes away aborts every conversation; what a batch cannot
do is a 400 that says so, and a conversation that fails its checks is named."""

from __future__ import annotations

import httpx
import pytest
from server_utils import ServerProcess, engine_idle, wait_until

CONVERSATIONS = [[{"role": "user", "content": "Hello there"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}],
                 [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "Again"}]]
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True, "max_tokens": 7}


def _post(server: ServerProcess, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=60)


def test_each_conversations_reply_is_the_chat_reply_to_it(server: ServerProcess) -> None:
    reply = _post(server, "chat/completions/batch", messages=CONVERSATIONS, logprobs=True, top_logprobs=2,
                  request_id="mine", **GREEDY)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-mine" and body["model"] == "tiny"
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    singles = [_post(server, "chat/completions", messages=conversation, logprobs=True, top_logprobs=2,
                     **GREEDY).json() for conversation in CONVERSATIONS]
    for choice, single in zip(body["choices"], singles):
        (alone,) = single["choices"]
        assert choice["message"] == alone["message"] and choice["finish_reason"] == alone["finish_reason"] == "length"
        ours, theirs = choice["logprobs"]["content"], alone["logprobs"]["content"]
        assert [t["token"] for t in ours] == [t["token"] for t in theirs]  # batched together: the last bits differ
        assert [t["logprob"] for t in ours] == pytest.approx([t["logprob"] for t in theirs], abs=1e-4)
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 21 and usage["total_tokens"] == usage["prompt_tokens"] + 21
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the singles had left them in the prefix cache


def test_a_client_that_goes_away_aborts_every_conversation(server: ServerProcess) -> None:
    before = httpx.get(f"{server.base_url}/stats").json()["num_generation_tokens"]
    body = {**GREEDY, "max_tokens": 480, "messages": [[{"role": "user", "content": f"Story {i}"}] for i in range(16)]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/chat/completions/batch", json=body, timeout=0.3)
    wait_until(lambda: engine_idle(server.base_url), 20, "the abandoned conversations' blocks to be freed")
    generated = httpx.get(f"{server.base_url}/stats").json()["num_generation_tokens"] - before
    assert generated < 16 * 480  # aborted, not run to the end


@pytest.mark.parametrize("extra,says", [
    ({"stream": True}, "batch chat completions do not support streaming"),
    ({"n": 2}, "do not support n other than 1"),
    ({"use_beam_search": True}, "beam search"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [[{"role": "user", "content": "Hi"}], []]}, "messages.1"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages.0"),
    ({"messages": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "x" * 3000}]]},
     "messages[1]: "),
    ({"model": "nope"}, "The model `nope` does not exist"),
])
def test_what_a_batch_cannot_do_is_a_400_that_says_so(server: ServerProcess, extra: dict, says: str) -> None:
    body = {**GREEDY, "messages": CONVERSATIONS, **extra}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions/batch", json=body, timeout=60)
    assert reply.status_code in (400, 404) and says in reply.json()["error"]["message"], reply.text
    assert engine_idle(server.base_url)
