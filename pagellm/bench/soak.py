"""Soak a live OpenAI-compatible server with a random mix of requests and check that nothing is lost.

``pagellm bench soak --base-url URL --num-requests 300 --seed 1`` sends, ``--max-concurrency`` at a time, requests
drawn (reproducibly, per ``--seed``) from a mix of what clients send: completions (text, token ids, several
prompts, echo, logprobs, n, beam search), chat (a system turn, tools and every ``tool_choice``, logprobs, n, JSON
schemas), embeddings, the Responses API, Anthropic's Messages API (tools, a tool result) and ``/tokenize``; streamed
or not; with random sampling options (top-k/p,
min-p, the penalties, min_tokens, stop strings and ids, bad words, logit bias, allowed ids, seeds, prompt logprobs,
truncation, structured outputs). ``--drop-fraction`` of the clients hang up early (a stream after a few events, a
plain request at a random moment). Some requests are invalid on purpose (a negative temperature, an unknown field).

Then it waits for the server to be idle again and reports:
- the outcomes (HTTP statuses, streams dropped on purpose, transport errors) and the distinct 4xx messages;
- every 5xx, every error event inside a 200 stream and every 4xx without a message, each with its request;
- whether the server came back to empty: no request running or waiting and no KV block taken (its Prometheus
  ``/metrics``, pagellm's or vLLM's names), and ``/health``.
It exits 1 when any of those checks fails, else 0. A bug that kills an engine or leaks a block under some mix of
features shows here; a benchmark of speed it is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagellm.bench.client import Server, connect, first_model

WORDS = ("the quick brown fox jumps over a lazy dog while seven cats sing loudly about json yaml and the weather "
         "in paris tomorrow").split()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
# chat fields clients send beside the usual ones (OpenAI's and vLLM's)
CHAT_EXTRAS: dict[str, Any] = {
    "max_completion_tokens": 12, "user": "soak", "parallel_tool_calls": False, "metadata": {"run": "soak"},
    "echo": True, "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False},
    "return_tokens_as_token_ids": True, "include_stop_str_in_output": True, "service_tier": "auto",
    "skip_special_tokens": False, "frequency_penalty": 0.5, "stop": ["\n\n"], "top_logprobs": 30,
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--model", default=None, help="the model to ask for (default: the first one listed)")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--num-requests", type=int, default=300, help="requests to send (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=48, help="at most this many at once (default: "
                                                                        "%(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the mix's seed (default: %(default)s)")
    parser.add_argument("--drop-fraction", type=float, default=0.2,
                        help="the share of clients that hang up early (default: %(default)s)")
    parser.add_argument("--max-token-id", type=int, default=256,
                        help="token-id prompts use ids below this (default: %(default)s, a byte vocabulary's size)")
    parser.add_argument("--result-json", default=None, metavar="FILE",
                        help="write the report there, with each request's body and outcome (to compare servers on "
                             "one mix: the same --seed and --drop-fraction 0)")
    parser.add_argument("--idle-timeout", type=float, default=60.0,
                        help="seconds to wait for the server to be idle after the last request (default: "
                             "%(default)s)")


@dataclass
class Mix:
    """The request mix: one ``random.Random`` per run, so a seed gives the same requests."""

    rng: random.Random
    model: str
    max_token_id: int = 256

    def text(self, low: int, high: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def request(self) -> tuple[str, dict[str, Any]]:
        """One request: its path and JSON body."""
        kind = self.rng.choice(("chat", "chat", "completion", "completion", "beam", "embedding", "responses",
                                "anthropic", "tokenize"))
        path, body = getattr(self, kind)()
        if kind in ("chat", "completion") and self.rng.random() < 0.04:
            body.update(self.rng.choice(({"temperature": -1}, {"max_tokens": "many"}, {"not_a_field": 1})))
        return path, body

    def chat(self) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.rng.choice((1, 8, 40, 150)),
                                "messages": self.messages()}
        if self.rng.random() < 0.3:
            body["tools"] = TOOLS
            body["tool_choice"] = self.rng.choice(("auto", "required", "none", {
                "type": "function", "function": {"name": "get_weather"}}))
        if self.rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=self.rng.randint(0, 5))
        if self.rng.random() < 0.2:
            body["n"] = self.rng.randint(1, 3)
        if self.rng.random() < 0.1:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}
        for name in self.rng.sample(sorted(CHAT_EXTRAS), self.rng.randint(0, 2)):
            body[name] = CHAT_EXTRAS[name]
        self.sampling(body)
        return "/v1/chat/completions", self.maybe_streamed(body)

    def messages(self) -> list[dict[str, Any]]:
        """A system turn and a user turn; sometimes an earlier exchange with a tool call and its result, or the user's
        text as a list of parts."""
        user: Any = self.text(1, 200)
        if self.rng.random() < 0.2:
            user = [{"type": "text", "text": user}, {"type": "text", "text": self.text(1, 5)}]
        history: list[dict[str, Any]] = []
        if self.rng.random() < 0.2:
            history = [{"role": "user", "content": self.text(2, 10)}, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "call_1", "type": "function", "function": {
                           "name": "get_weather", "arguments": '{"city": "paris"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                       {"role": "assistant", "content": self.text(2, 10)}]
        return [{"role": "system", "content": self.text(1, 8)}, *history, {"role": "user", "content": user}]

    def completion(self) -> tuple[str, dict[str, Any]]:
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": self.rng.choice((1, 8, 40, 150))}
        if self.rng.random() < 0.3:
            body["logprobs"] = self.rng.randint(0, 5)
        if self.rng.random() < 0.2:
            body["echo"] = True
        if self.rng.random() < 0.2:
            body["n"] = self.rng.randint(1, 3)
        self.sampling(body)
        return "/v1/completions", self.maybe_streamed(body)

    def beam(self) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {"model": self.model, "prompt": self.prompt(), "use_beam_search": True,
                                   "n": self.rng.randint(1, 3), "max_tokens": self.rng.randint(1, 8)}

    def embedding(self) -> tuple[str, dict[str, Any]]:
        return "/v1/embeddings", {"model": self.model, "input": self.rng.choice(
            (self.text(1, 100), [self.text(1, 5), self.text(20, 60)], [self.token_ids()]))}

    def responses(self) -> tuple[str, dict[str, Any]]:
        body = {"model": self.model, "input": self.text(1, 50), "max_output_tokens": self.rng.choice((8, 40, 150))}
        if self.rng.random() < 0.3:
            body["instructions"] = self.text(2, 6)
        return "/v1/responses", self.maybe_streamed(body)

    def anthropic(self) -> tuple[str, dict[str, Any]]:
        """Anthropic's Messages API: a system prompt and a user turn, sometimes after a tool call and its result,
        sometimes with tools, sampling options and stop sequences."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": self.text(1, 200)}]
        if self.rng.random() < 0.2:
            messages = [{"role": "user", "content": self.text(2, 10)}, {"role": "assistant", "content": [
                {"type": "text", "text": self.text(1, 5)},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                             {"type": "text", "text": self.text(1, 20)}]}]
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.rng.choice((1, 8, 40, 150)),
                                "system": self.text(1, 8), "messages": messages}
        if self.rng.random() < 0.3:
            function = TOOLS[0]["function"]
            body["tools"] = [{"name": function["name"], "input_schema": function["parameters"]}]
            body["tool_choice"] = self.rng.choice(({"type": "auto"}, {"type": "any"}, {"type": "none"},
                                                   {"type": "tool", "name": "get_weather"}))
        options = {"temperature": self.rng.choice((0.0, 0.7)), "top_k": self.rng.choice((1, 50)),
                   "top_p": 0.9, "stop_sequences": [self.rng.choice(WORDS)], "metadata": {"user_id": "soak"}}
        for name in self.rng.sample(sorted(options), self.rng.randint(0, 3)):
            body[name] = options[name]
        if self.rng.random() < 0.5:
            body["stream"] = True
        return "/v1/messages", body

    def tokenize(self) -> tuple[str, dict[str, Any]]:
        return "/tokenize", {"model": self.model, "prompt": self.text(1, 40)}

    def prompt(self) -> Any:
        return self.rng.choice((self.text(1, 300), [self.text(1, 4), self.text(1, 4)], self.token_ids()))

    def token_ids(self) -> list[int]:
        return [self.rng.randrange(self.max_token_id) for _ in range(self.rng.randint(1, 40))]

    def maybe_streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.rng.random() < 0.5:
            body["stream"] = True
            if "messages" in body or "prompt" in body:
                body["stream_options"] = {"include_usage": True, "continuous_usage_stats": self.rng.random() < 0.5}
        return body

    def sampling(self, body: dict[str, Any]) -> None:
        """Up to five random sampling options."""
        rng = self.rng
        options = {
            "top_k": lambda: rng.choice((-1, 0, 1, 5, 50)), "top_p": lambda: rng.choice((0.1, 0.9, 1.0)),
            "min_p": lambda: rng.choice((0.0, 0.1, 0.5)), "repetition_penalty": lambda: rng.choice((0.8, 1.3)),
            "frequency_penalty": lambda: rng.uniform(-2, 2), "presence_penalty": lambda: rng.uniform(-2, 2),
            "min_tokens": lambda: rng.randint(0, 10), "ignore_eos": lambda: True,
            "stop_token_ids": lambda: [rng.randrange(self.max_token_id) for _ in range(2)],
            "bad_words": lambda: [rng.choice(WORDS)], "stop": lambda: [rng.choice(WORDS)],
            "logit_bias": lambda: {str(rng.randrange(self.max_token_id)): rng.uniform(-100, 100)},
            "allowed_token_ids": lambda: [rng.randrange(self.max_token_id) for _ in range(5)],
            "skip_special_tokens": lambda: False, "include_stop_str_in_output": lambda: True,
            "truncate_prompt_tokens": lambda: rng.randint(1, 50), "seed": lambda: rng.randint(0, 10),
            "prompt_logprobs": lambda: rng.randint(0, 3), "temperature": lambda: rng.choice((0.0, 0.7, 1.3)),
            "structured_outputs": lambda: rng.choice(({"regex": "[a-z]{2,8}"}, {"choice": ["yes", "no"]}, {
                "json": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                {"grammar": 'root ::= "a" | "b"'})),
        }
        for name in rng.sample(sorted(options), rng.randint(0, 5)):
            body[name] = options[name]()


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)  # each request's path, body, outcome (in order)
    messages: dict[str, int] = field(default_factory=dict)   # "status path: message" → count, for 4xx
    problems: list[str] = field(default_factory=list)        # 5xx, errors in a 200 stream, 4xx without a message

    def count(self, outcome: str, record: dict[str, Any]) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        record["outcome"] = outcome

    def refused(self, status: int, path: str, raw: bytes, body: dict[str, Any]) -> str:
        """Count a 4xx by its message, or note a problem (a 5xx, a 4xx without a message); returns the message."""
        message = _error_message(raw)
        if status >= 500 or not message:
            self.problems.append(f"HTTP {status} from {path}: {raw[:300]!r}; request: {json.dumps(body)[:500]}")
        else:
            key = f"{status} {path}: {message[:120]}"
            self.messages[key] = self.messages.get(key, 0) + 1
        return message


def _error_message(raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return ""
    return (error.get("message") or "") if isinstance(error, dict) else ""


def _stream_error(line: bytes) -> bool:
    """An SSE event that reports an error (OpenAI's ``{"error": {...}}``, the Responses API's ``"type": "error"``)."""
    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
        return False
    try:
        event = json.loads(line[5:])
    except ValueError:
        return True
    if not isinstance(event, dict):
        return True  # a stream event is a JSON object
    return isinstance(event.get("error"), dict) or event.get("type") == "error"


async def _send(server: Server, path: str, body: dict[str, Any], drop_after: float | None, tally: Tally,
                record: dict[str, Any]) -> None:
    """One request; hangs up after ``drop_after`` seconds (plain) or a few events (streamed) when given."""
    url = server.base_url + path
    timeout = aiohttp.ClientTimeout(total=drop_after) if drop_after is not None and not body.get("stream") else None
    try:
        async with server.session.post(url, json=body, timeout=timeout) as response:
            if response.status >= 400:
                record["message"] = tally.refused(response.status, path, await response.read(), body)
                tally.count(str(response.status), record)
                return
            if not body.get("stream"):
                await response.read()
                tally.count(str(response.status), record)
                return
            events = 0
            async for line in response.content:
                if _stream_error(line):
                    tally.problems.append(f"error event in a 200 stream from {path}: {line[:300]!r}; "
                                          f"request: {json.dumps(body)[:500]}")
                events += line.startswith(b"data:")
                if drop_after is not None and events > drop_after * 10:  # after 1 to 10 events
                    tally.count("stream dropped on purpose", record)
                    return
            tally.count(str(response.status), record)
    except asyncio.TimeoutError:
        tally.count("request dropped on purpose", record)
    except aiohttp.ClientError as exc:
        tally.count(f"transport error: {type(exc).__name__}", record)
        tally.problems.append(f"transport error on {path}: {exc}")


async def _gauges(server: Server) -> dict[str, float]:
    """The engine's running, waiting and KV-usage gauges from ``/metrics`` (pagellm's or vLLM's names), summed
    over their label sets."""
    async with server.session.get(server.base_url + "/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        prefix, _, gauge = family.name.partition(":")
        if prefix in ("pagellm", "vllm") and gauge in GAUGES:
            values[gauge] = values.get(gauge, 0.0) + sum(sample.value for sample in family.samples)
    return values


async def _wait_idle(server: Server, timeout_s: float) -> dict[str, float]:
    """The gauges once all are zero, or the last ones read when ``timeout_s`` ran out."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = await _gauges(server)
        if gauges and not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.2)


async def _after(server: Server, idle_timeout: float, tally: Tally) -> tuple[dict[str, float], int | None]:
    """The gauges once idle and ``/health``'s status; ({}, None) and a problem when the server no longer answers."""
    try:
        gauges = await _wait_idle(server, idle_timeout)
        async with server.session.get(server.base_url + "/health") as response:
            return gauges, response.status
    except aiohttp.ClientError as exc:
        tally.problems.append(f"the server no longer answers: {type(exc).__name__}: {exc}")
        return {}, None


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the mix and the checks; the JSON-able report (see the module docstring)."""
    if args.num_requests < 1 or args.max_concurrency < 1 or not 0 <= args.drop_fraction <= 1:
        raise ValueError("--num-requests and --max-concurrency must be at least 1, --drop-fraction within [0, 1]")
    tally = Tally()
    async with connect(args.base_url, args.max_concurrency, api_key=args.api_key) as server:
        mix = Mix(random.Random(args.seed), args.model or await first_model(server), args.max_token_id)
        plan = [(*mix.request(), mix.rng.uniform(0.05, 1.0) if mix.rng.random() < args.drop_fraction else None)
                for _ in range(args.num_requests)]
        gate = asyncio.Semaphore(args.max_concurrency)

        async def one(path: str, body: dict[str, Any], drop_after: float | None) -> None:
            tally.requests.append(record := {"path": path, "body": body})
            async with gate:
                await _send(server, path, body, drop_after, tally, record)

        start = time.perf_counter()
        await asyncio.gather(*(one(*item) for item in plan))
        elapsed = time.perf_counter() - start
        gauges, health = await _after(server, args.idle_timeout, tally)
    leaked = not gauges or any(gauges.values())
    return {"seconds": round(elapsed, 1), "outcomes": tally.outcomes, "refusals": tally.messages,
            "problems": tally.problems, "gauges_after": gauges, "health_after": health, "requests": tally.requests,
            "passed": not tally.problems and not leaked and health == 200}


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args))
    print(f"{args.num_requests} requests in {report['seconds']} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())))
    for message, count in sorted(report["refusals"].items(), key=lambda item: -item[1]):
        print(f"  {count:>4} × {message}")
    for problem in report["problems"]:
        print(f"PROBLEM {problem}")
    print(f"after: {report['gauges_after'] or 'no engine gauges on /metrics'}; /health {report['health_after']}")
    print("PASSED" if report["passed"] else "FAILED")
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if report["passed"] else 1
