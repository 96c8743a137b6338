"""``pagellm run-batch``: a file of OpenAI Batch API requests (JSON Lines) run through the engine in-process, each
answer written as one line of the output file, in input order (vLLM's ``vllm run-batch``, OpenAI's Batch format).

Contract:
- An input line is ``{"custom_id", "method": "POST", "url", "body"}``, ``url`` one of ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/embeddings`` and ``/v1/responses``; ``body`` is what that route takes, checked and
  answered by the server's own handlers (same validation, template, parsers, adapters). Blank lines are skipped.
- An output line is ``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
  "error": null}``: 200 with the route's answer, or the 4xx/5xx and OpenAI's error body the server would send. A line
  that is no request (not JSON, no ``custom_id``, another method or url, ``stream: true``, a background response)
  gets ``"response": null`` and ``"error": {"code", "message"}`` naming the problem. No line stops the others.
- Every request is submitted at once (at most ``MAX_IN_FLIGHT`` at a time) and the engine's scheduler batches them;
  a progress bar on stderr counts finished lines. The output is written to a temporary file beside it and moved
  into place when complete, so a reader never sees half a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel, ValidationError

from pagellm.config import EngineConfig
from pagellm.server.options import ServeOptions
from pagellm.server.openai.errors import describe_validation_error, error_body, to_api_error
from pagellm.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.server.openai.responses_protocol import ResponsesRequest
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.openai.serving_completion import OpenAIServingCompletion
from pagellm.server.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from pagellm.server.openai.serving_engine import EngineClient
from pagellm.server.openai.serving_responses import OpenAIServingResponses

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 1024  # requests handed to the engine at once; the rest wait their turn in this process


class _LineError(Exception):
    """A line that is no request: its error goes in the output line's ``error``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class BatchRunner:
    """Answers Batch API lines with the server's handlers over one engine."""

    def __init__(self, engine: EngineClient, names: list[str], options: ServeOptions,
                 loras: Optional[dict] = None) -> None:
        chat = OpenAIServingChat(engine, names, options.tool_call_parser, options.reasoning_parser, loras)
        completion = OpenAIServingCompletion(engine, names, loras)
        embedding = OpenAIServingEmbedding(engine, names, loras)
        responses = OpenAIServingResponses(chat)
        # url → (body model, prepare, create)
        self.routes: dict[str, tuple[type[BaseModel], Callable, Callable]] = {
            "/v1/chat/completions": (ChatCompletionRequest, chat.prepare, chat.create),
            "/v1/completions": (CompletionRequest, completion.prepare, completion.create),
            "/v1/embeddings": (EmbeddingRequest, embedding.prepare, embedding.create),
            "/v1/responses": (ResponsesRequest, responses.prepare, responses.create),
        }

    async def answer(self, line: str) -> dict[str, Any]:
        """One output line for one input line (never raises)."""
        custom_id = None
        try:
            item = _load(line)
            custom_id = item.get("custom_id")
            _check(item)
            body = await self._respond(item["url"], item["body"])
            error = None
        except _LineError as exc:
            body, error = None, {"code": exc.code, "message": exc.message}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": body, "error": error}

    async def _respond(self, url: str, raw: dict[str, Any]) -> dict[str, Any]:
        model, prepare, create = self.routes[url]
        if raw.get("stream") or raw.get("background"):
            which = "stream" if raw.get("stream") else "background"
            raise _LineError("invalid_request", f"{which}: true is not supported in a batch; leave it out")
        request_id = f"batch-{uuid.uuid4().hex}"
        try:
            try:
                request = model.model_validate(raw)
            except ValidationError as exc:
                raise describe_validation_error(list(exc.errors())) from None
            answer = await create(prepare(request))
            return {"status_code": 200, "request_id": request_id, "body": answer.model_dump(mode="json")}
        except Exception as exc:  # the route's refusal, as the server would send it
            api = to_api_error(exc)
            return {"status_code": api.status, "request_id": request_id,
                    "body": error_body(api.message, api.type, api.param, api.code)}


def _load(line: str) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _LineError("invalid_json", f"the line is not JSON: {exc}") from None
    if not isinstance(item, dict):
        raise _LineError("invalid_request", "a line must be a JSON object with custom_id, method, url and body")
    return item


def _check(item: dict[str, Any]) -> None:
    """Raise ``_LineError`` unless ``item`` is a request this runner answers."""
    missing = [name for name in ("custom_id", "method", "url", "body") if name not in item]
    if missing:
        raise _LineError("invalid_request", f"the line lacks {', '.join(missing)}")
    if item["method"] != "POST":
        raise _LineError("invalid_request", f"method must be POST, got {item['method']!r}")
    if item["url"] not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        raise _LineError("invalid_url", f"url {item['url']!r} is not served in a batch (use /v1/chat/completions, "
                                        "/v1/completions, /v1/embeddings or /v1/responses)")
    if not isinstance(item["body"], dict):
        raise _LineError("invalid_request", "body must be a JSON object")


async def run_lines(runner: BatchRunner, lines: list[str], progress: bool = True) -> list[dict[str, Any]]:
    """Every line's answer, in input order."""
    from tqdm import tqdm

    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    bar = tqdm(total=len(lines), desc="requests", unit="req", disable=not progress)

    async def one(line: str) -> dict[str, Any]:
        async with gate:
            result = await runner.answer(line)
        bar.update(1)
        return result

    try:
        return list(await asyncio.gather(*(one(line) for line in lines)))
    finally:
        bar.close()


def run_batch(config: EngineConfig, options: ServeOptions, input_path: str, output_path: str) -> int:
    """Read ``input_path``, answer every line, write ``output_path`` (see the module doc); 0 once written."""
    source, target = Path(input_path), Path(output_path)
    if not source.is_file():
        raise ValueError(f"cannot read the batch input {source}: no such file")
    if not target.parent.is_dir():
        raise ValueError(f"cannot write the batch output {target}: {target.parent} is not a directory")
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    answers = asyncio.run(_run(config, options, lines))
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text("".join(json.dumps(answer) + "\n" for answer in answers))
    os.replace(partial, target)
    failed = sum(1 for a in answers if a["error"] is not None or a["response"]["status_code"] != 200)
    logger.info("wrote %d answers to %s (%d failed)", len(answers), target, failed)
    return 0


async def _run(config: EngineConfig, options: ServeOptions, lines: list[str]) -> list[dict[str, Any]]:
    from pagellm.engine.async_engine import AsyncLLM
    from pagellm.server.launch import DEFAULT_MODEL_NAME, lora_requests

    engine = AsyncLLM.from_config(config)
    try:
        if options.chat_template is not None:
            engine.tokenizer.chat_template = options.chat_template
        names = list(options.served_model_names or [config.model_config.model or DEFAULT_MODEL_NAME])
        runner = BatchRunner(engine, names, options, lora_requests(engine, names, options))
        return await run_lines(runner, lines)
    finally:
        engine.shutdown()
