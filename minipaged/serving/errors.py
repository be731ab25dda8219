"""The server's error answers, all in OpenAI's shape: ``error_response`` and the exception handlers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minipaged.serving.protocol import OpenAIError, error_body

logger = logging.getLogger("minipaged.serving")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body (vLLM's type names) with its HTTP status."""
    return JSONResponse(error_body(message, status, param), status_code=status)


async def openai_error(request: Request, err: OpenAIError) -> JSONResponse:
    return error_response(err.status, err.message, err.param)


async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
    """A body pydantic refused: 400, ``param`` the first field it names (none for broken JSON)."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", None)
    return error_response(400, f"{'.'.join(loc)}: {first.get('msg', 'invalid')}", loc[0] if loc else None)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a method not allowed) in OpenAI's shape."""
    return error_response(err.status_code, str(err.detail))


async def internal_error(request: Request, err: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered with a 500 that names only its type."""
    logger.exception("internal error")
    return error_response(500, f"internal server error: {type(err).__name__}")


def add_exception_handlers(app: FastAPI) -> None:
    # Starlette's stubs type every handler as taking any Exception; each one here is registered for its own class
    app.add_exception_handler(OpenAIError, openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
