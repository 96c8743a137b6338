"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``, with the status the same error
has on the OpenAI routes (``server/openai/errors.py`` maps exceptions onto it) and Anthropic's name for its kind:
``invalid_request_error`` (400), ``authentication_error`` (401), ``permission_error`` (403), ``not_found_error``
(404), ``request_too_large`` (413), ``rate_limit_error`` (429), ``overloaded_error`` (503: the engine is overloaded,
asleep or dead) and ``api_error`` (any other 5xx)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from pagellm.server.openai.errors import to_api_error

KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    error = to_api_error(exc)
    kind = KINDS.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return error.status, {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status)


def error_event(exc: BaseException) -> str:
    """An error as Anthropic's ``error`` event, for failures after a stream has started (status already 200)."""
    _, body = error_body(exc)
    return f"event: error\ndata: {json.dumps(body)}\n\n"
