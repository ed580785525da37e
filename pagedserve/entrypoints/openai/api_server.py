"""The OpenAI-compatible HTTP server: FastAPI app factory and the single-engine `pagedserve serve`
(serving/launch.py is the command's entry: it picks this, the mp front end or Ray).

`pagedserve serve` runs two processes: this one (HTTP, validation, tokenization, SSE) and the
engine core (pagedserve.engine.core), started and awaited before the port opens. If the core
dies, requests answer 503 naming the cause and the server exits non-zero shortly after.

Every error a client can cause answers 4xx with OpenAI's error JSON
{"error": {"message", "type", "param", "code"}}; nothing a client sends can take the
engine down for the others.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.pauses import (freeze_startup_heap, install_gc_pause_log, set_serving_gc_thresholds,
                                      watch_event_loop)
from pagedserve.entrypoints.openai.admission import Admission
from pagedserve.entrypoints.openai.dashboard import dashboard_router
from pagedserve.entrypoints.openai.http_errors import error_response, install_error_handlers
from pagedserve.entrypoints.openai.middleware import (APIKeyMiddleware, BodyLimitMiddleware,  # noqa: F401
                                                      HostCheckMiddleware)
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                    CompletionRequest, CompletionResponse,
                                                    ErrorResponse, ModelCard, ModelList)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import ClientDisconnected
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_tokenize import (DetokenizeRequest, DetokenizeResponse,
                                                            OpenAIServingTokenization, TokenizeRequest,
                                                            TokenizeResponse)
from pagedserve.entrypoints.openai.stats_log import log_stats_forever

logger = logging.getLogger("pagedserve.server")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 500, 503)}
# After the engine core died: how long the server keeps answering 503 (so clients learn the
# cause) before it exits non-zero.
CORE_DEATH_EXIT_DELAY_S = 3.0


# Re-exported under their old names (the dashboard's tests and benchmarks import them here).
_error = error_response
_install_error_handlers = install_error_handlers


class _AdmittedStream(StreamingResponse):
    """A stream that ends its admission when the response ends, however it ends (a client that
    leaves before the first chunk included: then the body iterator never starts)."""

    def __init__(self, content: Any, release: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, allowed_hosts: list[str] | None = None,
              max_waiting_requests: int | None = None, config: Any = None, log_requests: bool = False,
              log_stats: bool = False, return_tokens_as_token_ids: bool = False,
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The OpenAI-compatible app around one AsyncLLMEngine. allowed_hosts: the Host headers
    answered (middleware.HostCheckMiddleware; None: any, for in-process callers such as the
    Ray replicas). max_waiting_requests: admission.Admission's queue (None: its default).
    config (an EngineConfig) gives the tool-call and reasoning parsers and the generation
    config's default sampling (engine/generation_defaults.py). log_requests, log_stats,
    return_tokens_as_token_ids, enable_prompt_tokens_details: the `serve` flags of those names (a
    line per request, the periodic stats line of stats_log.py, logprob tokens as "token_id:N"
    unless a request says, usage's cached prompt tokens)."""
    defaults = {}
    if config is not None:
        from pagedserve.engine.generation_defaults import config_generation_defaults
        defaults = config_generation_defaults(config)
    completion = OpenAIServingCompletion(engine, served_model_name, defaults)
    chat = OpenAIServingChat(engine, served_model_name, defaults, **chat_options(config))
    tokenization = OpenAIServingTokenization(engine, served_model_name, chat)
    for handler in (completion, chat):
        handler.log_requests, handler.tokens_as_ids_default = log_requests, return_tokens_as_token_ids
        handler.prompt_tokens_details = enable_prompt_tokens_details
    admission = Admission(engine, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(watch_event_loop("api server"))]
        if log_stats:
            tasks.append(loop.create_task(log_stats_forever(engine.metrics)))
        yield
        for task in tasks:
            task.cancel()
        await engine.shutdown()

    app = FastAPI(title="pagedserve", description="OpenAI-compatible server of pagedserve",
                  lifespan=lifespan)
    app.state.engine = engine
    engine.metrics.model_name = served_model_name  # vLLM's model_name label on every vllm:* series
    _install_error_handlers(app)

    @app.get("/health")
    @app.get("/ping", include_in_schema=False)  # vLLM's alias (SageMaker's health check)
    @app.post("/ping", include_in_schema=False)
    async def health() -> Response:
        if not engine.is_running:
            return _error(503, str(engine.errored), type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        root = getattr(config, "model", None) or served_model_name  # vLLM's: the model as given to serve
        return ModelList(data=[ModelCard(id=served_model_name, root=root, max_model_len=engine.max_model_len,
                                         vocab_size=engine.vocab_size)])

    async def respond(create: Any, body: Any, request: Request) -> Response:
        """Admit the request (or 503), await the handler; the admission ends with the response."""
        release = admission.admit()
        try:
            result = await create(body, request)
        except ClientDisconnected:
            release()
            return Response(status_code=499)
        except BaseException:
            release()
            raise
        if hasattr(result, "model_dump_json"):
            release()
            return Response(result.model_dump_json(), media_type="application/json")
        return _AdmittedStream(result, release, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(completion.create, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(chat.create, body, request)

    # vLLM's extras: no engine work, so no admission either.
    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    @app.get("/version")
    async def version() -> dict:
        from pagedserve import __version__
        return {"version": __version__}

    app.include_router(dashboard_router(engine, api_key))
    # The last one added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)
    return app


def chat_options(config: Any) -> dict:
    """OpenAIServingChat's parser classes from --enable-auto-tool-choice, --tool-call-parser and
    --reasoning-parser, and its --chat-template-content-format."""
    from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    if config is None:
        return {}
    tool = config.tool_call_parser if config.enable_auto_tool_choice else None
    return {"tool_parser": TOOL_PARSERS[tool] if tool else None,
            "reasoning_parser": REASONING_PARSERS[config.reasoning_parser]
            if config.reasoning_parser else None,
            "content_format": config.chat_template_content_format}


def _usage_hint(name: str, host: str, port: int, keyed: bool, scheme: str = "http") -> str:
    """Commands that work as printed; with a key they read it from $PAGEDSERVE_API_KEY, so the
    key itself never lands in the log."""
    base = f"{scheme}://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}/v1"
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


def run_single_server(args: Any, config: Any, name: str, api_key: str | None) -> int:
    """`pagedserve serve` with one engine (serving/launch.py picks this, mp or Ray)."""
    from pagedserve.entrypoints.http_options import add_cors, scheme, uvicorn_options
    from pagedserve.entrypoints.http_server import make_server
    from pagedserve.entrypoints.http_stack import describe
    from pagedserve.entrypoints.openai.middleware import default_allowed_hosts

    logger.debug("%s", describe())
    # Starts the core process, waits for READY. specs_checked: this app parses every spec (check_compiles).
    engine = AsyncLLMEngine.from_engine_config(config, specs_checked=True)
    allowed = args.allowed_hosts or default_allowed_hosts(args.host)
    app = build_app(engine, name, api_key=api_key, max_request_bytes=args.max_request_bytes,
                    allowed_hosts=allowed, max_waiting_requests=args.max_waiting_requests, config=config,
                    log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    add_cors(app, args)
    # Past --shutdown-timeout, what still runs ends as a clean 503 (streams: error event, [DONE]).
    server = make_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout,
                         on_drain_timeout=lambda: engine.stop_requests(
                             "the server is shutting down", code="server_shutting_down"),
                         access_log=not args.disable_uvicorn_access_log, log_level=args.uvicorn_log_level,
                         **uvicorn_options(args))

    def exit_soon(error: Exception) -> None:
        logger.error("%s: exiting in %.0f s", error, CORE_DEATH_EXIT_DELAY_S)
        asyncio.get_running_loop().call_later(CORE_DEATH_EXIT_DELAY_S,
                                              lambda: setattr(server, "should_exit", True))

    engine.on_core_death = exit_soon
    freeze_startup_heap()  # see engine/pauses.py: no full collection walks the start-up heap mid-serving
    set_serving_gc_thresholds()  # and young collections come rarely enough not to promote every stream
    install_gc_pause_log("api server")
    logger.info("serving %s on %s://%s:%d/v1%s (hosts allowed: %s)", name, scheme(args), args.host, args.port,
                " (API key required)" if api_key else "", ", ".join(allowed))
    print(_usage_hint(name, args.host, args.port, api_key is not None, scheme(args)), flush=True)
    try:
        server.run()
    finally:
        engine.client.shutdown()  # idempotent; covers a server that never ran its lifespan
    if engine.errored is not None:
        print(f"pagedserve: error: {engine.errored}", file=sys.stderr)
        return 1
    return 0
