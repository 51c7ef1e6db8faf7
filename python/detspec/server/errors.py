"""Errors as OpenAI's error body (``{"error": {message, type, param, code}}``) and the app's
exception handlers: ``ApiError`` raised by the routes, request-validation errors from the
pydantic models (the parameter named by its JSON path), HTTP errors and anything unexpected.
Engine errors carry their parameter as ``InvalidRequestError.param``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from detspec.errors import DetspecError, EngineStoppedError, InvalidRequestError
from detspec.server import protocol as P

logger = logging.getLogger("detspec.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    503: "service_unavailable",
    500: "internal_server_error",
}

# What the OpenAPI schema says an error looks like, per status.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": P.ErrorResponse} for status in (400, 401, 404, 413, 503)
}

RETRY_AFTER = {"Retry-After": "1"}


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    info = P.ErrorInfo(
        message=message,
        type=type_ or ERROR_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=status,
    )
    return P.ErrorResponse(error=info).model_dump()


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.type),
        status_code=err.status,
        headers=err.headers,
    )


def invalid(e: InvalidRequestError, default_param: str | None = None) -> ApiError:
    """A 400 for an engine error, naming the parameter the engine named."""
    return ApiError(400, str(e), e.param or default_param)


def engine_error(e: DetspecError) -> ApiError | None:
    """The answer to an engine error met while serving: 400 for a bad request, 503 once the
    engine has stopped; None for anything else (the caller re-raises it: 500)."""
    if isinstance(e, InvalidRequestError):
        return invalid(e)
    if isinstance(e, EngineStoppedError):
        return ApiError(503, str(e), None, headers=RETRY_AFTER)
    return None


def stream_error_body(e: DetspecError) -> dict[str, Any]:
    """The error event of a stream that failed after it started."""
    status = 400 if isinstance(e, InvalidRequestError) else 500
    return error_body(status, str(e), e.param)


def loc_to_param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``; skips union tags."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        s = str(item)
        if "[" in s or s[:1].isupper() or s in ("str", "int", "float", "bool", "list", "dict"):
            continue  # a union member's tag (list[int], ChatContentPart, ...)
        parts.append(s)
    return ".".join(parts) or None


def add_exception_handlers(app: FastAPI, count_error: Callable[[int], None]) -> None:
    """OpenAI's error body for every error the app answers; ``count_error(status)`` feeds
    the metrics."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        count_error(exc.status)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        e = errs[0] if errs else {"loc": ("body",), "msg": "invalid request", "type": ""}
        if e.get("type") == "json_invalid":
            err = ApiError(400, f"the request body is not valid JSON: {e.get('msg')}", "body")
        else:
            param = loc_to_param(e.get("loc", ())) or "body"
            what = e.get("msg", "invalid value")
            if e.get("type") == "extra_forbidden":
                what = "unrecognized request argument (not supported by this server)"
            elif e.get("type") == "missing":
                what = "required"
            err = ApiError(400, f"invalid parameter `{param}`: {what}", param)
        count_error(400)
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count_error(exc.status_code)
        msg = str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.url.path}"
        return JSONResponse(
            error_body(exc.status_code, msg), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        count_error(500)
        return JSONResponse(error_body(500, f"internal error: {exc}"), status_code=500)
