"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Contract (``install_error_handlers``):
- ``APIError`` carries its own status, type, param and code (unknown model → 404, bad API key → 401).
- Request validation (bad JSON, wrong types, out-of-range values, unknown fields) → 400, the message naming the
  field (a value that fits none of a union's types, such as ``prompt: [1, -2]``, by the type it came closest to:
  ``prompt.1: Input should be greater than or equal to 0``); ``ValueError`` from anywhere below (sampling params,
  prompt too long, chat template) → 400 verbatim.
- ``EngineDeadError``, ``EngineSleepingError`` and ``EngineOverloadedError`` → 503; any other exception → 500
  (logged with its traceback), never a dropped connection.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.engine.exceptions import EngineDeadError, EngineOverloadedError, EngineSleepingError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error to return to the client as is."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request onto the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(f"the engine is not running ({exc}); restart the server", 503, "server_error",
                        code="engine_dead")
    if isinstance(exc, EngineSleepingError):
        return APIError(str(exc), 503, "server_error", code="engine_sleeping")
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), 503, "server_error", code="engine_overloaded")
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400)
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(f"internal server error: {type(exc).__name__}: {exc}", 500, "server_error")


def error_response(exc: BaseException) -> JSONResponse:
    error = to_api_error(exc)
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_body(error.message, error.type, error.param, error.code), error.status, headers)


def sse_error(exc: BaseException) -> str:
    """An error as one server-sent event, for failures after a stream has started (status already 200)."""
    error = to_api_error(exc)
    return f"data: {json.dumps(error_body(error.message, error.type, error.param, error.code))}\n\n"


_TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "dict", "list", "none"}


def _is_union_tag(part: Any) -> bool:
    """Whether a location part names one of a union's types (``list[constrained-int]``), not a field or index."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def _location(error: dict[str, Any]) -> list[Any]:
    return [part for part in error.get("loc", ()) if part != "body"]


def _union_failure(errors: list[dict[str, Any]]) -> Optional[tuple[str, str]]:
    """(field, message) where the first error is one type of a union the value matched none of: the type the value
    came closest to (its errors deepest, then fewest), named by the field alone (``prompt.1``, not
    ``prompt.list[constrained-int].1``); where the value's own type fits none, every type it should have been."""
    loc = _location(errors[0])
    at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if at is None:
        return None
    branches: dict[str, list[dict[str, Any]]] = {}
    for error in errors:
        other = _location(error)
        if other[:at] == loc[:at] and len(other) > at and _is_union_tag(other[at]):
            branches.setdefault(other[at], []).append(error)
    depth = {tag: max(len(_location(e)) for e in found) for tag, found in branches.items()}
    if max(depth.values()) == at + 1:  # no type got past the value's own type
        wanted = [found[0]["msg"].removeprefix("Input should be ") for found in branches.values()]
        return ".".join(map(str, loc[:at])), "Input should be " + " or ".join(dict.fromkeys(wanted))
    best = min(branches, key=lambda tag: (-depth[tag], len(branches[tag])))
    chosen = max(branches[best], key=lambda e: len(_location(e)))
    field = [str(part) for part in _location(chosen) if not _is_union_tag(part)]
    return ".".join(field), chosen["msg"]


def describe_validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 whose message and param name the offending field (for a union, the type
    the value came closest to: ``_union_failure``)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ("body",), "type": ""}
    union = _union_failure(errors) if errors and first.get("type") != "json_invalid" else None
    if union is not None:
        return APIError(f"{union[0]}: {union[1]}", 400, param=union[0])
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first.get('msg')}", 400)
    if field is None:
        return APIError(f"the request body must be a JSON object: {first.get('msg')}", 400)
    if first.get("type") == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {field}", 400, param=field)
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    message = str(first.get("msg")).removeprefix("Value error, ")  # a validator's own ValueError, as it wrote it
    return APIError(f"{field}: {message}{more}", 400, param=field)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(describe_validation_error(list(exc.errors())))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(str(exc.detail), exc.status_code, kind))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ValueError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_api_error)
