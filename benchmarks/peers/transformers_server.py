"""The naive baseline for benchmarks/compare.py: Hugging Face transformers ``generate()`` behind a minimal
OpenAI-compatible server with static batching.

A batch forms from the requests waiting when the model is free (waiting at most ``--batch-wait-ms`` for more, up to
``--max-batch-size``), runs to its longest request's ``max_tokens`` while new arrivals queue, and only then does
the next batch start: no continuous batching, no paged KV cache, no prefix caching. That is the point of the
baseline. A batch samples with its first request's temperature and top-p. Tokens stream per request through a
``BaseStreamer`` that ``generate()`` calls after each step.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (text or token-id prompt) and
``POST /v1/chat/completions``, streamed (SSE, with ``usage`` when ``stream_options.include_usage``) or not.

    python benchmarks/peers/transformers_server.py --model DIR --dtype bfloat16 --threads 2 --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch
import transformers
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from transformers.generation.streamers import BaseStreamer


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None at the end
    count: int = 0
    done: bool = False


class BatchStreamer(BaseStreamer):
    """Routes each generated row to its job; a row stops at its own max_tokens or EOS."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]) -> None:
        self.jobs, self.eos_ids, self.prompt_seen = jobs, eos_ids, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt ids
            self.prompt_seen = True
            return
        for job, token in zip(self.jobs, value.reshape(-1).tolist()):
            if job.done:
                continue
            stop = not job.ignore_eos and token in self.eos_ids
            if not stop:
                job.count += 1
                job.loop.call_soon_threadsafe(job.out.put_nowait, token)
            if stop or job.count >= job.max_tokens:
                self._finish(job)

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                self._finish(job)

    @staticmethod
    def _finish(job: Job) -> None:
        job.done = True
        job.loop.call_soon_threadsafe(job.out.put_nowait, None)


class StaticBatcher:
    def __init__(self, model: Any, eos_ids: set[int], pad_id: int, max_batch: int, wait_s: float) -> None:
        self.model, self.eos_ids, self.pad_id = model, eos_ids, pad_id
        self.max_batch, self.wait_s = max_batch, wait_s
        self.pending: queue.Queue[Job] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="static-batcher").start()

    def _next_batch(self) -> list[Job]:
        batch = [self.pending.get()]
        deadline = time.monotonic() + self.wait_s
        while len(batch) < self.max_batch:
            try:
                batch.append(self.pending.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            width = max(len(j.prompt_ids) for j in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch])
            mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch])
            new = max(j.max_tokens for j in batch)
            first = batch[0]
            sampling = {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p, "top_k": 0} \
                if first.temperature > 0 else {"do_sample": False}
            streamer = BatchStreamer(batch, self.eos_ids)
            try:
                with torch.inference_mode():
                    self.model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=self.pad_id,
                                        min_new_tokens=new if all(j.ignore_eos for j in batch) else 0,
                                        streamer=streamer, **sampling)
            finally:
                streamer.end()


def build_app(model_dir: str, name: str, batcher: StaticBatcher, tokenizer: Any) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    async def handle(body: dict[str, Any], chat: bool) -> Any:
        if chat:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        elif isinstance(body.get("prompt"), list):
            ids = body["prompt"]
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"])
        else:
            raise HTTPException(400, "prompt must be a string or a list of token ids")
        job = Job(list(ids), int(body.get("max_tokens") or 16), float(body.get("temperature", 1.0)),
                  float(body.get("top_p", 1.0)), bool(body.get("ignore_eos", False)), asyncio.get_running_loop())
        batcher.pending.put(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(job, rid, chat, usage, tokenizer, name), media_type="text/event-stream")
        tokens = []
        while (token := await job.out.get()) is not None:
            tokens.append(token)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        choice = {"index": 0, "finish_reason": "length" if len(tokens) >= job.max_tokens else "stop",
                  **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "model": name, "choices": [choice], "usage": _usage(job)})

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        return await handle(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: dict[str, Any]) -> Any:
        return await handle(body, chat=True)

    return app


def _usage(job: Job) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": job.count,
            "total_tokens": len(job.prompt_ids) + job.count}


async def _sse(job: Job, rid: str, chat: bool, usage: bool, tokenizer: Any, name: str) -> AsyncIterator[str]:
    tokens: list[int] = []
    sent = ""
    kind = "chat.completion.chunk" if chat else "text_completion"
    while (token := await job.out.get()) is not None:
        tokens.append(token)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for the next token
            continue
        delta, sent = text[len(sent):], text
        choice = {"index": 0, "finish_reason": None,
                  **({"delta": {"content": delta}} if chat else {"text": delta})}
        yield f"data: {json.dumps({'id': rid, 'object': kind, 'model': name, 'choices': [choice]})}\n\n"
    end = {"index": 0, "finish_reason": "length" if job.count >= job.max_tokens else "stop",
           **({"delta": {}} if chat else {"text": ""})}
    yield f"data: {json.dumps({'id': rid, 'object': kind, 'model': name, 'choices': [end]})}\n\n"
    if usage:
        yield f"data: {json.dumps({'id': rid, 'object': kind, 'model': name, 'choices': [], 'usage': _usage(job)})}\n\n"
    yield "data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=20.0, help="wait this long for a batch to fill")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0)
    batcher = StaticBatcher(model, eos_ids, pad, args.max_batch_size, args.batch_wait_ms / 1e3)
    app = build_app(args.model, args.served_model_name or args.model, batcher, tokenizer)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
