"""An OpenAI-compatible HTTP server around one model (Anthropic's Messages API too): completions and chat,
streaming, metrics, a shared cache.

The layers: `schemas` (request bodies), `translate` (request -> a `GenerationRequest`, every 400 decided there),
`pool` (the Decoders and the worker thread), `service` (the request path: admission, backpressure, deadline),
`shaping` (OpenAI's JSON and stream chunks), `stream` (text deltas), `errors` (errors in OpenAI's or Anthropic's
shape), `metrics`, `tokens` (vLLM's /tokenize and /detokenize), `responses` (OpenAI's Responses API, stateless),
`anthropic` (Anthropic's Messages API), and the routes below, which only hand over. In front of them the pure
ASGI `guard` checks the Host header (no DNS rebinding against a local server), the API key (constant-time), and
the body size while the body is read. Every request has one deadline, from arrival to the last token; a client
that goes away, the deadline or shutdown cancel its generation after the current step.

Example:
    forerun serve --method auto --cache trie.safetensors --port 8000
    >>> from openai import OpenAI                                                      # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")         # doctest: +SKIP
    >>> messages = [{"role": "user", "content": "Hi"}]                                  # doctest: +SKIP
    >>> client.chat.completions.create(model="smollm2-135m", messages=messages)       # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from forerun.server import anthropic
from forerun.server.config import CacheError, ServerConfig  # noqa: F401 - re-exported
from forerun.server.errors import install as install_error_handlers
from forerun.server.guard import Guard
from forerun.server.responses import respond
from forerun.server.schemas import (
    AnthropicRequest,
    ChatRequest,
    CompletionRequest,
    CountTokensRequest,
    DetokenizeRequest,
    ErrorResponse,
    ResponsesRequest,
    TokenizeRequest,
)
from forerun.server.service import Service
from forerun.server.tokens import detokenized, tokenized

RESPONSES = {400: {"model": ErrorResponse, "description": "Invalid request (OpenAI-style error)"}}


def create_app(model, tokenizer, config: ServerConfig, draft_model=None) -> FastAPI:
    """The FastAPI app for one loaded model (and the draft model of method draft_model, if one was loaded).

    A bad method, knob or cache file raises here (ValueError), before anything is served.
    """
    service = Service(model, tokenizer, config, draft_model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown)

    app = FastAPI(title="forerun", lifespan=lifespan)
    app.state.service = service
    app.state.pool = service.pool
    app.state.decoders = service.pool.shared
    app.state.metrics = service.metrics
    app.state.worker = service.worker
    install_error_handlers(app)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse)
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"], responses=RESPONSES)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], responses=RESPONSES)
    app.add_api_route("/v1/responses", responses, methods=["POST"], responses=RESPONSES)
    app.add_api_route("/v1/messages", messages, methods=["POST"], responses=RESPONSES)
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], responses=RESPONSES)
    app.add_api_route("/tokenize", tokenize, methods=["POST"], responses=RESPONSES)
    app.add_api_route("/detokenize", detokenize, methods=["POST"], responses=RESPONSES)
    app.openapi = lambda: openapi(app)
    app.add_middleware(Guard, config=config, metrics=service.metrics)
    return app


async def health(request: Request) -> dict:
    return request.app.state.service.health()


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict:
    config = request.app.state.service.config
    names = (config.model_name, *config.aliases)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "forerun"}
                                       for name in names]}  # fmt: skip


async def completions(body: CompletionRequest, request: Request):
    return await request.app.state.service.answer(body, request, chat=False)


async def chat_completions(body: ChatRequest, request: Request):
    return await request.app.state.service.answer(body, request, chat=True)


async def responses(body: ResponsesRequest, request: Request):
    return await respond(request.app.state.service, body, request)


async def messages(body: AnthropicRequest, request: Request):
    return await anthropic.respond(request.app.state.service, body, request)


async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    return await anthropic.count_tokens(request.app.state.service, body)


async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return await tokenized(request.app.state.service, body)


async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return detokenized(request.app.state.service, body)


def openapi(app: FastAPI) -> dict:
    """The schema says what the server sends: 400 with OpenAI's error shape, never FastAPI's 422."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="0.1.0", routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
