"""Every error in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), or in Anthropic's on its
routes (`{"type": "error", "error": {"type", "message"}}`), with the right status: the app's exception handlers,
as plain functions (`install`), and the shapes the guard and streams use too."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forerun.server.translate import APIError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 2
"""Seconds a client refused with 429 is told to wait (the Retry-After header)."""


def failed(error: Exception) -> APIError:
    """A request's own failure while it was generated (its drafters, its budget), as a 500 that names it; the
    requests beside it in the batch go on."""
    logger.error("forerun: a request failed: %r", error)
    message = f"the request failed while generating: {type(error).__name__}: {error}"[:500]
    return APIError(500, message, kind="server_error")


ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}  # fmt: skip
"""Anthropic's error types by HTTP status (any other: `api_error`)."""
ANTHROPIC_ROUTES = "/v1/messages"
"""Routes under this path answer errors in Anthropic's shape (its SDK and Claude Code read them so)."""


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def anthropic_error(status: int, message: str) -> dict:
    """An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERRORS.get(status, "api_error"), "message": message}}


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", path: str = ""
) -> JSONResponse:
    """An error answer in OpenAI's shape, or in Anthropic's on its routes (`path`)."""
    if path.startswith(ANTHROPIC_ROUTES):
        return JSONResponse(status_code=status, content=anthropic_error(status, message))
    return JSONResponse(status_code=status, content=error_body(status, message, param, kind))


async def api_error(request: Request, error: APIError) -> JSONResponse:
    request.app.state.metrics.count(request.url.path, error.status)
    response = error_response(error.status, error.message, error.param, error.kind, request.url.path)
    if error.status == 429:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def unexpected(request: Request, error: Exception) -> JSONResponse:
    """Anything else still answers in the route's shape (OpenAI's, Anthropic's), and is counted."""
    logger.error("forerun: %s %s failed: %r", request.method, request.url.path, error)
    request.app.state.metrics.count(request.url.path, 500)
    return error_response(500, f"internal error: {type(error).__name__}", kind="server_error", path=request.url.path)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body that does not fit the schema: 400 (not FastAPI's 422), naming the field."""
    request.app.state.metrics.count(request.url.path, 400)
    path = request.url.path
    errors = error.errors()
    first = errors[0] if errors else {}
    location = [str(x) for x in first.get("loc", ()) if x != "body"]
    kinds = {e.get("type") for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]}
    if {"int_type", "float_type"} <= kinds:  # a number field's union: "a valid integer" misleads for "0.5"
        field = location[0] if location else "body"
        message = f"invalid request: {field}: must be a number, not a string or a boolean"
        return error_response(400, message, field, path=path)
    where = ".".join(location[:1] + [x for x in location[1:] if x.isdigit()]) or "body"
    if first.get("type") == "extra_forbidden":
        return error_response(400, f"unrecognized request field {where!r}", where, path=path)
    if first.get("type") == "json_invalid":
        return error_response(400, f"invalid JSON body: {first.get('ctx', {}).get('error', 'malformed')}", path=path)
    return error_response(400, f"invalid request: {where}: {first.get('msg', 'malformed')}", where, path=path)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    request.app.state.metrics.count(request.url.path, error.status_code)
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    response = error_response(error.status_code, str(error.detail), kind=kind, path=request.url.path)
    if error.status_code == 405:  # RFC 9110: a 405 says which methods the resource takes
        response.headers["allow"] = ", ".join(allowed_methods(request.app, request.url.path))
    return response


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The HTTP methods the app's routes take at `path`."""
    methods = {m for route in app.routes if getattr(route, "path", None) == path for m in getattr(route, "methods", ())}
    return sorted(methods)


def install(app: FastAPI) -> None:
    """The app's exception handlers (they count each answer in `app.state.metrics`)."""
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
