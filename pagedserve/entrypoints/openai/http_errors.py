"""Every error an HTTP client sees, in OpenAI's schema: {"error": {message, type, param, code}}.

Shared by the single server (api_server.py) and the DP front end (serving/frontend.py), so a
client reads the same body from both: validation errors name the field (`param`), FastAPI's
own 404/405 and anything unexpected come back as this JSON too, never {"detail": ...}.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.entrypoints.openai.serving_common import APIError

logger = logging.getLogger("pagedserve.server")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict | None = None) -> JSONResponse:
    err = APIError(message, status, param=param, code=code, type=type)
    return JSONResponse(err.response().model_dump(), status_code=status, headers=headers)


def param_of(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; union branch tags dropped."""
    parts = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, str) and (any(ch in x for ch in "[-(")
                                   or x in ("str", "int", "float", "bool", "none")):
            break
        parts.append(str(x))
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.response().model_dump(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                  code="invalid_json")
        param = param_of(tuple(first.get("loc", ())))
        # A union reports one error per branch: say what each branch wanted.
        msgs = list(dict.fromkeys(err.get("msg", "invalid value") for err in errors
                                  if param_of(tuple(err.get("loc", ()))) == param))
        msg = " | ".join(msgs[:4])
        if param is None:
            return error_response(400, f"request body is invalid: {msg}")
        return error_response(400, f"{param}: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}")
