"""vLLM 0.32's request fields beside vLLM itself: the same requests to both servers, the replies compared.

pagellm takes these fields as vLLM 0.32 does; this starts vLLM (``make peers``) and then pagellm on the built-in
model in float32 (so that greedy tokens are the model's, not a kernel's rounding), both with the same
``--reasoning-config`` (a block opened by "Thinking" and ended by "Answer", one token each in SmolLM2's vocabulary,
as ``<think>`` and ``</think>`` are in Qwen3's and DeepSeek-R1's), sends each the same requests and compares:

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
  parameters a chat and a completion request render to.

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
        if "status" in a or "status" in b:
            same, shown = a == b, (a, b)
        else:
            shown = (view(a), view(b))
            same = _close(*shown)
        print(f"{'same' if same else 'DIFFERS'}: {name}" + ("" if same else f"\n  vLLM    {shown[0]}\n"
                                                                       f"  pagellm {shown[1]}"), flush=True)
        if not same:
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
             "--enable-per-request-metrics", "--enable-scale-out")
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
