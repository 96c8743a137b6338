"""vLLM 0.32's request fields beside vLLM itself: the same requests to both servers, the replies compared.

pagellm takes these fields as vLLM 0.32 does; this starts vLLM (``make peers``) and then pagellm on the built-in
model in float32 (so that greedy tokens are the model's, not a kernel's rounding), both with the same flags (hermes
tool calls; a ``--reasoning-config`` whose block is opened by "Thinking" and ended by "Answer", one token each in
SmolLM2's vocabulary, as ``<think>`` and ``</think>`` are in Qwen3's and DeepSeek-R1's), sends each the same requests
and compares:

- ``thinking_token_budget``: prompts that open a block, budgets 0, 5 and 12 (one prompt with thinking tokens of its
  own), and one whose block is closed; the generated token ids must be identical (where the forced end lands, and
  what follows). ``--tags think`` uses ``<think>`` / ``</think>`` instead, three tokens each here: there vLLM 0.32
  lets a block that the prompt opened run ``len(tag) - 1`` tokens past its budget (it takes the tag's last token
  for its first), so those checks differ by design;
- ``logprob_token_ids``: completions and chat at each generated position, the tokens listed (in chat's
  ``top_logprobs``, in order) and their logprobs (within 1e-3);
- ``truncation_side``: ``truncate_prompt_tokens`` with "right" and "left", the prompt token ids kept and the tokens
  generated;
- ``--enable-per-request-metrics``: the names of the figures a response's ``metrics`` carries, whole and in a
  stream's usage chunk (their values are each server's own);
- the tokens-in, tokens-out API (``/inference/v1/generate``): the token ids, text, finish reasons and logprobs of the
  same request, in the tokens and the text output modes; and the render endpoints: the prompt ids and the sampling
  parameters a chat and a completion request render to;
- Anthropic's Messages API (``/v1/messages``): the content blocks (text, a named tool's call and its input), stop
  reason, stop sequence and token counts of the same requests (system blocks, a stop sequence, a tool result, a
  stream's events in order with their text), and ``/v1/messages/count_tokens``. Two differences are by design and
  shown apart (``BY_DESIGN``): a named ``tool_choice``, which vLLM 0.32's Messages API leaves unconstrained (its reply
  is free text, here a malformed call cut by ``max_tokens``) and pagellm constrains to a call of that tool as its
  chat does; and (not sent) a reply prefilled by a last assistant turn, which pagellm continues, as Anthropic does,
  where vLLM 0.32 answers after it;
- ``/v1/chat/completions/batch``: each conversation's reply, its finish reason and the summed token counts;
- ``/generative_scoring``: the label tokens' scores (within 1e-3) and token counts, text items after the query, and
  token-id items before it over the whole vocabulary.

Prints each check and what differs; exits 1 if anything does.

    .venv/bin/python benchmarks/fields_vs_vllm.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from compare import free_port, stop, wait_ready  # noqa: E402
from peers import systems  # noqa: E402

TAGS = {"word": ("Thinking", "Answer"), "think": ("<think>", "</think>")}
ASK = "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"model": "smollm2", "temperature": 0, "ignore_eos": True}
BY_DESIGN = {"messages, named tool": "vLLM 0.32 leaves a named tool choice unconstrained on /v1/messages"}
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}


def _budget(budget: int | None, prompt: str) -> tuple[str, dict[str, Any]]:
    body = {**GREEDY, "prompt": prompt, "max_tokens": 24, "return_token_ids": True}
    return "completions", body if budget is None else {**body, "thinking_token_budget": budget}


def requests(label_ids: list[int], start: str, end: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The requests both servers get, by name: (route, body)."""
    long = "The quick brown fox jumps over the lazy dog. " * 4
    return {
        "budget 0": _budget(0, ASK + start),
        "budget 5": _budget(5, ASK + start),
        "budget 12, the prompt thought 3 tokens": _budget(12, ASK + start + "\nLet me"),
        "budget 5, closed block": _budget(5, ASK + start + "\nEasy.\n" + end),
        "no budget": _budget(None, ASK + start),
        "logprob_token_ids, completions": ("completions", {
            **GREEDY, "prompt": "The capital of France is", "max_tokens": 4, "logprobs": 1,
            "logprob_token_ids": label_ids, "return_tokens_as_token_ids": True}),
        "logprob_token_ids, chat": ("chat/completions", {
            **GREEDY, "messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 4, "logprobs": True,
            "logprob_token_ids": label_ids, "return_tokens_as_token_ids": True}),
        "truncation_side right": ("completions", {**GREEDY, "prompt": long, "max_tokens": 6, "return_token_ids": True,
                                                  "truncate_prompt_tokens": 9, "truncation_side": "right"}),
        "truncation_side left": ("completions", {**GREEDY, "prompt": long, "max_tokens": 6, "return_token_ids": True,
                                                 "truncate_prompt_tokens": 9, "truncation_side": "left"}),
        "metrics, completions": ("completions", {**GREEDY, "prompt": long, "max_tokens": 6}),
        "tokens in, tokens out": ("/inference/v1/generate", {
            "token_ids": label_ids * 3, "return_token_ids": True,
            "sampling_params": {"temperature": 0, "max_tokens": 6, "logprobs": 2, "ignore_eos": True}}),
        "render, chat": ("chat/completions/render", {
            **GREEDY, "messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 5, "seed": 7,
            "logit_bias": {str(label_ids[0]): 3}}),
        "render, completions": ("completions/render", {**GREEDY, "prompt": ["a b", "c"], "max_tokens": 5}),
        "tokens in, text out": ("/inference/v1/generate", {
            "token_ids": label_ids * 3, "output_mode": "text",
            "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}),
        "metrics, chat stream": ("chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 6, "stream": True,
                                                      "stream_options": {"include_usage": True}}),
        **messages_requests(),
        "chat batch": ("chat/completions/batch", {  # (vLLM's batch request has no ignore_eos)
            "model": "smollm2", "temperature": 0, "max_tokens": 8, "messages": [
                [{"role": "user", "content": "Name a city."}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]}),
        "generative scoring": ("/generative_scoring", {
            "model": "smollm2", "query": "Question: what is the capital of ", "label_token_ids": label_ids,
            "items": ["France? Answer:", "England? Answer:", "Germany? Answer:"]}),
        "generative scoring, whole vocabulary, item first": ("/generative_scoring", {
            "model": "smollm2", "query": " is the capital of France.", "label_token_ids": label_ids[::-1],
            "items": [[label_ids[0]], [label_ids[2]]], "item_first": True, "apply_softmax": False}),
    }


def messages_requests() -> dict[str, tuple[str, dict[str, Any]]]:
    """Anthropic's Messages API (no ``ignore_eos``: vLLM 0.32's Messages request drops fields it does not know)."""
    base = {"model": "smollm2", "temperature": 0, "max_tokens": 24}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = [*ask, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C, sunny"},
                                     {"type": "text", "text": "Thanks! Anything else?"}]}]
    system = [{"type": "text", "text": "You answer briefly."}, {"type": "text", "text": " In English."}]
    return {
        "messages": ("/v1/messages", {**base, "system": system, "messages": ask}),
        "messages, stop sequence": ("/v1/messages", {**base, "messages": ask, "stop_sequences": [".", "!"]}),
        "messages, tool result": ("/v1/messages", {**base, "messages": called, "tools": [WEATHER]}),
        "messages, named tool": ("/v1/messages", {**base, "max_tokens": 40, "messages": ask, "tools": [WEATHER],
                                                  "tool_choice": {"type": "tool", "name": "get_weather"}}),
        "messages, stream": ("/v1/messages", {**base, "system": system, "messages": ask, "stream": True}),
        "messages, count_tokens": ("/v1/messages/count_tokens", {"model": "smollm2", "system": system,
                                                                 "messages": called, "tools": [WEATHER]}),
    }


def replies(system: systems.System, asks: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    base_url = f"http://127.0.0.1:{system.argv[system.argv.index('--port') + 1]}"
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{system.name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(system.argv, env={**os.environ, **system.env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        try:
            print(f"{system.name}: ready in {wait_ready(base_url, proc, 600):.1f} s", flush=True)
        except (RuntimeError, TimeoutError) as exc:
            sys.exit(f"{system.name} {exc}; its log ({log.name}) ends:\n" + "".join(open(log.name).readlines()[-15:]))
        out = {}
        for name, (route, body) in asks.items():
            url = f"{base_url}{route}" if route.startswith("/") else f"{base_url}/v1/{route}"
            reply = httpx.post(url, json=body, timeout=120)
            if reply.status_code != 200:
                out[name] = {"status": reply.status_code, "error": reply.text[:300]}
            elif body.get("stream") and route == "/v1/messages":  # Anthropic's events, every one
                out[name] = {"events": [json.loads(line[6:]) for line in reply.text.splitlines()
                                        if line.startswith("data: ")]}
            elif body.get("stream"):  # the last chunk before [DONE]: the usage chunk
                out[name] = json.loads([line for line in reply.text.splitlines() if line.startswith("data: {")][-1][6:])
            else:
                out[name] = reply.json()
        return out
    finally:
        stop(proc)


def _tokens(reply: dict[str, Any]) -> Any:
    choice = reply.get("choices", [{}])[0]
    return choice.get("prompt_token_ids") or reply.get("prompt_token_ids"), choice.get("token_ids")


def _completion_lists(reply: dict[str, Any]) -> list[dict[str, float]]:
    return reply["choices"][0]["logprobs"]["top_logprobs"]


def _chat_lists(reply: dict[str, Any]) -> list[list[tuple[str, float]]]:
    return [[(t["token"], t["logprob"]) for t in item["top_logprobs"]]
            for item in reply["choices"][0]["logprobs"]["content"]]


def _generated(reply: dict[str, Any]) -> Any:
    """A tokens-API reply's choices (ids, text, finish reason, logprobs) and prompt ids."""
    choices = [(c["token_ids"], c.get("text"), c["finish_reason"], c.get("logprobs")) for c in reply["choices"]]
    return choices, reply.get("prompt_token_ids"), reply["request_id"].startswith("generate-tokens-")


def _rendered(reply: Any) -> Any:
    """A render reply's prompt ids and the sampling parameters both servers set (vLLM also writes every default)."""
    bodies = reply if isinstance(reply, list) else [reply]
    keys = ("temperature", "max_tokens", "seed", "logit_bias", "ignore_eos")
    return [(b["token_ids"], {k: b["sampling_params"].get(k) for k in keys}, b["request_id"].split("-")[0],
             b.get("reasoning_ended")) for b in bodies]


def _metric_names(reply: dict[str, Any]) -> list[str]:
    """The figures ``metrics`` holds (vLLM writes an absent ``speculative_decoding`` as null in a whole response and
    leaves it out of a stream's chunk; pagellm leaves it out of both)."""
    return sorted(name for name, value in (reply.get("metrics") or {}).items() if value is not None)


def _message(reply: dict[str, Any]) -> Any:
    """A Messages reply's blocks (text; a call's name and input: its id is each server's own), stop reason and
    sequence, and token counts (the prompt's, cached or not, and the output's); or a count_tokens reply."""
    if "content" not in reply:
        return reply
    blocks = [(b["type"], b.get("text"), b.get("name"), b.get("input")) for b in reply["content"]]
    usage = reply["usage"]
    prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
    return blocks, reply["stop_reason"], reply.get("stop_sequence"), prompt, usage["output_tokens"]


def _message_events(reply: dict[str, Any]) -> Any:
    """A Messages stream's events in order (each run of deltas as one), the text they carry, and the last delta."""
    kinds: list[str] = []
    for event in reply["events"]:
        kind = event["type"] + (f":{event['delta'].get('type')}" if event["type"] == "content_block_delta" else "")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    text = "".join(e["delta"].get("text", "") for e in reply["events"] if e["type"] == "content_block_delta")
    last = next(e for e in reply["events"] if e["type"] == "message_delta")
    return kinds, text, last["delta"], last["usage"]["output_tokens"]


def _batch(reply: dict[str, Any]) -> Any:
    """A batch chat reply's choices (index, text, finish reason) and token counts."""
    choices = [(c["index"], c["message"]["content"], c["finish_reason"]) for c in reply["choices"]]
    return choices, reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]


def _scores(reply: dict[str, Any]) -> Any:
    """A generative-scoring reply's scores by item, and its token counts."""
    return [(d["index"], d["score"]) for d in reply["data"]], reply["usage"]["prompt_tokens"], \
        reply["usage"]["completion_tokens"]


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-3, through lists, tuples and dicts (dict keys in any order, list order kept)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) < 1e-3
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def compare(theirs: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]) -> list[str]:
    found = []
    for name in theirs:
        a, b = theirs[name], ours[name]
        view: Callable[[dict[str, Any]], Any] = _tokens
        if "logprob_token_ids" in name:
            view = _chat_lists if "chat" in name else _completion_lists
        elif name.startswith("metrics"):
            view = _metric_names
        elif name.startswith("tokens in"):
            view = _generated
        elif name.startswith("render"):
            view = _rendered
        elif name == "chat batch":
            view = _batch
        elif name.startswith("generative scoring"):
            view = _scores
        elif name.startswith("messages"):
            view = _message_events if name.endswith("stream") else _message
        if "status" in a or "status" in b:
            same, shown = a == b, (a, b)
        else:
            shown = (view(a), view(b))
            same = _close(*shown)
        verdict = "same" if same else f"differs by design ({BY_DESIGN[name]})" if name in BY_DESIGN else "DIFFERS"
        print(f"{verdict}: {name}" + ("" if same else f"\n  vLLM    {shown[0]}\n  pagellm {shown[1]}"), flush=True)
        if not same and name not in BY_DESIGN:
            found.append(name)
    return found


def main() -> None:
    import argparse

    from pagellm.model.loader import default_model_path, hf_model_dir
    from pagellm.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tags", choices=sorted(TAGS), default="word", help="the thinking tags (see above)")
    start, end = TAGS[parser.parse_args().tags]
    gguf = Path(default_model_path())
    model_dir = hf_model_dir(gguf)
    tokenizer = Tokenizer.from_dir(model_dir)
    label_ids = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" Paris", " London", " Berlin")]
    asks = requests(label_ids, start, end)
    flags = ("--reasoning-config", json.dumps({"reasoning_start_str": start, "reasoning_end_str": end}),
             "--enable-per-request-metrics", "--enable-scale-out", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes")
    got = {}
    for name in ("vllm", "pagellm"):
        ctx = systems.Context(model_dir, gguf, dtype="float32", **{f"{name}_flags": flags})
        system = systems.BUILDERS[name](ctx, free_port())
        if system.missing_reason:
            sys.exit(f"{system.name}: {system.missing_reason}")
        got[name] = replies(system, asks)
    found = compare(got["vllm"], got["pagellm"])
    print("identical" if not found else f"{len(found)} of {len(asks)} differ")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
