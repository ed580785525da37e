"""The OpenAI-compatible HTTP server: FastAPI app factory and `pagedserve serve`.

`pagedserve serve` runs two processes: this one (HTTP, validation, tokenization, SSE) and the
engine core (pagedserve.engine.core), started and awaited before the port opens. If the core
dies, requests answer 503 naming the cause and the server exits non-zero shortly after.

Every error a client can cause answers 4xx with OpenAI's error JSON
{"error": {"message", "type", "param", "code"}}; nothing a client sends can take the
engine down for the others.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.http_stack import SERVER_KEEP_ALIVE_S
from pagedserve.engine.pauses import (freeze_startup_heap, install_gc_pause_log, set_serving_gc_thresholds,
                                      watch_event_loop)
from pagedserve.entrypoints.openai.dashboard import dashboard_router
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                    CompletionRequest, CompletionResponse,
                                                    ErrorResponse, ModelCard, ModelList)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import APIError, ClientDisconnected
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("pagedserve.server")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}
# After the engine core died: how long the server keeps answering 503 (so clients learn the
# cause) before it exits non-zero.
CORE_DEATH_EXIT_DELAY_S = 3.0
_V1 = "/v1/"


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type: str | None = None) -> JSONResponse:
    err = APIError(message, status, param=param, code=code, type=type)
    return JSONResponse(err.response().model_dump(), status_code=status)


class BodyLimitMiddleware:
    """Reads at most max_bytes of a request body; more answers 413 before any parsing."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = _error(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                         code="request_too_large")
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                if not v.isdigit() or int(v) > self.max_bytes:
                    return await too_big(scope, receive, send)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")  # JSON over HTTP is UTF-8 (RFC 8259); say where it is not
        except UnicodeDecodeError as e:
            return await _error(400, f"request body is not valid UTF-8: byte 0x{body[e.start]:02x} "
                                     f"at offset {e.start}", code="invalid_json")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        # Bodies are JSON whatever the client says (curl -d sends a form content type).
        headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
        scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, replay, send)


class APIKeyMiddleware:
    """With an API key set, /v1/* needs `Authorization: Bearer <key>`; health and metrics stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_V1):
            got = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                return await _error(401, "Incorrect or missing API key: send it as "
                                         "'Authorization: Bearer <key>'",
                                    code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


def _param_of(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; union branch tags dropped."""
    parts = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, str) and (any(ch in x for ch in "[-(")
                                   or x in ("str", "int", "float", "bool", "none")):
            break
        parts.append(str(x))
    return ".".join(parts) or None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.response().model_dump(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return _error(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                          code="invalid_json")
        param = _param_of(tuple(first.get("loc", ())))
        # A union reports one error per branch: say what each branch wanted.
        msgs = list(dict.fromkeys(err.get("msg", "invalid value") for err in errors
                                  if _param_of(tuple(err.get("loc", ()))) == param))
        msg = " | ".join(msgs[:4])
        if param is None:
            return _error(400, f"request body is invalid: {msg}")
        return _error(400, f"{param}: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(e).__name__}")


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20) -> FastAPI:
    """The OpenAI-compatible app around one AsyncLLMEngine."""
    completion = OpenAIServingCompletion(engine, served_model_name)
    chat = OpenAIServingChat(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = asyncio.get_running_loop().create_task(watch_event_loop("api server"))
        yield
        watcher.cancel()
        await engine.shutdown()

    app = FastAPI(title="pagedserve", description="OpenAI-compatible server of pagedserve",
                  lifespan=lifespan)
    app.state.engine = engine
    engine.metrics.model_name = served_model_name  # vLLM's model_name label on every vllm:* series
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error(503, str(engine.errored), type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len,
                                         vocab_size=engine.vocab_size)])

    async def respond(result: Any) -> Response:
        if hasattr(result, "model_dump_json"):
            return Response(result.model_dump_json(), media_type="application/json")
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            return await respond(await completion.create(body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            return await respond(await chat.create(body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    app.include_router(dashboard_router(engine, api_key))
    # The last one added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


DEMO_MODEL_NAME = "pagedserve-demo"


def _usage_hint(name: str, host: str, port: int, keyed: bool) -> str:
    """Commands that work as printed; with a key they read it from $PAGEDSERVE_API_KEY, so the
    key itself never lands in the log."""
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}/v1"
    auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"' if keyed else ""
    key = "os.environ['PAGEDSERVE_API_KEY']" if keyed else "'x'"
    first = "  # with PAGEDSERVE_API_KEY set to the server's key:\n" if keyed else ""
    return (f"\nServing {name!r} at {base}. Try:\n{first}"
            f"  curl {base}/completions{auth} -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{name}\", \"prompt\": \"In the beginning\", \"max_tokens\": 32}}'\n"
            f"  python -c \"import os; from openai import OpenAI; "
            f"c = OpenAI(base_url='{base}', api_key={key}); "
            f"print(c.chat.completions.create(model='{name}', messages=[{{'role': 'user', "
            f"'content': 'Continue: The LORD is my shepherd'}}]).choices[0].message.content)\"\n")


def _check_can_listen(host: str, port: int) -> None:
    """A taken port is a one-line error before the model loads, not a bind failure after."""
    import socket
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror or e})") from None


def run_server_cli(args: Any) -> int:
    """`pagedserve serve`: build the engine from the CLI flags and serve it with uvicorn."""
    import uvicorn

    from pagedserve.engine_args import engine_config_from_args

    if args.model_pos and args.model and args.model_pos != args.model:
        raise ValueError(f"MODEL ({args.model_pos!r}) and --model ({args.model!r}) disagree")
    model = args.model_pos or args.model
    default_name = model
    if model is None:
        try:
            from pagedserve.demo_model import DEMO_MODEL_DIR
        except ImportError:
            raise ValueError("no MODEL given and the bundled demo model is not installed") from None
        model, default_name = str(DEMO_MODEL_DIR), DEMO_MODEL_NAME
    if args.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {args.max_request_bytes}")
    config = engine_config_from_args(args, model)
    from pagedserve.engine.preflight import check_engine_config
    check_engine_config(config)  # before any process starts: one line, in seconds
    from pagedserve.log_setup import configure_logging
    configure_logging("api-server")
    _check_can_listen(args.host, args.port)
    # Each connection is a file descriptor: at the soft limit uvloop resets new connections
    # (clients see httpx ReadError). Raised before the engine core and DP replicas start, so
    # they inherit it; the relay workers raise their own.
    from pagedserve.entrypoints.fd_limit import fd_limit_note, raise_fd_limit
    logger.debug("%s", fd_limit_note(raise_fd_limit()))
    api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    name = args.served_model_name or default_name
    # Hook (issue #15): --data-parallel-size N / --data-parallel-backend ray serve replicas.
    from pagedserve.serving.launch import run_dp_server_cli, wants_dp
    if wants_dp(args):
        return run_dp_server_cli(args, config, name, api_key)
    if getattr(args, "api_server_count", 1) != 1:
        raise ValueError("api_server_count > 1 needs --data-parallel-size > 1 (the front end's relay processes)")
    from pagedserve.entrypoints.http_stack import describe
    logger.debug("%s", describe())
    engine = AsyncLLMEngine.from_engine_config(config)  # starts the core process, waits for READY
    app = build_app(engine, name, api_key=api_key, max_request_bytes=args.max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_keep_alive=SERVER_KEEP_ALIVE_S, timeout_graceful_shutdown=5,
                                           access_log=not args.disable_uvicorn_access_log,
                                           log_config=None))  # uvicorn's lines propagate to our format

    def exit_soon(error: Exception) -> None:
        logger.error("%s: exiting in %.0f s", error, CORE_DEATH_EXIT_DELAY_S)
        asyncio.get_running_loop().call_later(CORE_DEATH_EXIT_DELAY_S,
                                              lambda: setattr(server, "should_exit", True))

    engine.on_core_death = exit_soon
    freeze_startup_heap()  # see engine/pauses.py: no full collection walks the start-up heap mid-serving
    set_serving_gc_thresholds()  # and young collections come rarely enough not to promote every stream
    install_gc_pause_log("api server")
    logger.info("serving %s on http://%s:%d/v1%s", name, args.host, args.port,
                " (API key required)" if api_key else "")
    print(_usage_hint(name, args.host, args.port, api_key is not None), flush=True)
    try:
        server.run()
    finally:
        engine.client.shutdown()  # idempotent; covers a server that never ran its lifespan
    if engine.errored is not None:
        print(f"pagedserve: error: {engine.errored}", file=sys.stderr)
        return 1
    return 0
