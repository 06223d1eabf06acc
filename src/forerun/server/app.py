"""An OpenAI-compatible HTTP server around one model: completions and chat, streaming, metrics, a shared cache.

Generation is serialised (one at a time on a CPU) behind a FIFO lock, in a worker thread, so the event loop keeps
answering /health, /metrics and queued clients. Decoders are per method and shared by all requests: the trie and
the n-gram pool learn across requests. Errors are OpenAI-style JSON with 4xx codes; the server keeps serving.

Example:
    forerun serve --method trie --cache trie.safetensors --port 8000
    >>> from openai import OpenAI                                          # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")          # doctest: +SKIP
    >>> client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}])  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from forerun.decoder import Decoder, GenerationResult
from forerun.methods import plan_method


@dataclass(frozen=True)
class ServerConfig:
    """Limits and defaults of one server."""

    model_name: str
    method: str = "prompt_lookup"
    knobs: dict = field(default_factory=dict)
    api_key: str | None = None
    """Bearer token required on every endpoint but /health (None = open)."""
    cache_path: str | None = None
    """Trie file loaded at start (if present) and saved at shutdown (method 'trie')."""
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_body_bytes: int = 1_000_000
    request_timeout_s: float = 300.0


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    forerun: dict[str, Any] | None = None


class CompletionRequest(CommonRequest):
    prompt: str


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)


class Metrics:
    """Prometheus metrics in a registry of this app's own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("forerun_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry)
        self.tokens = Counter("forerun_generated_tokens", "New tokens generated", ["method"], registry=self.registry)
        self.latency = Histogram(
            "forerun_request_seconds",
            "Generation latency",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, 300),
        )
        self.tokens_per_forward = Histogram(
            "forerun_tokens_per_forward",
            "Tokens per forward per request",
            ["method"],
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8),
            registry=self.registry,
        )
        self.acceptance = Histogram(
            "forerun_acceptance",
            "Accepted / proposed draft tokens per request",
            ["method"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0),
            registry=self.registry,
        )
        self.queue = Gauge("forerun_queue_length", "Requests waiting for or in generation", registry=self.registry)


class TokenStream:
    """A streamer (put/end, like transformers') that turns token ids into text deltas on an asyncio queue.

    Text is decoded cumulatively (multi-byte characters split over tokens are held back until complete) and the
    last characters are held back while they could still become a stop string, which is never sent.
    """

    def __init__(self, tokenizer, loop: asyncio.AbstractEventLoop, stops: list[str]) -> None:
        self.tokenizer, self.loop, self.stops = tokenizer, loop, stops
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[int] = []
        self.sent = 0
        self.prompt_seen = False
        self.stopped = False
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def put(self, value) -> None:
        if not self.prompt_seen:  # transformers' convention: the prompt comes first
            self.prompt_seen = True
            return
        self.ids.extend(value.flatten().tolist())
        self.emit(final=False)

    def end(self) -> None:
        self.emit(final=True)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def emit(self, final: bool) -> None:
        if self.stopped:
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = first_stop(text, self.stops)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            if text.endswith("\ufffd"):
                return
            text = text[: max(self.sent, len(text) - self.holdback)]
        if len(text) > self.sent:
            delta, self.sent = text[self.sent :], len(text)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)


def first_stop(text: str, stops: list[str]) -> int | None:
    positions = [text.find(s) for s in stops if s and s in text]
    return min(positions) if positions else None


def create_app(model, tokenizer, config: ServerConfig, draft_model=None, spec=None) -> FastAPI:
    """The FastAPI app for one loaded model (and the draft model of method draft_model, if one was loaded)."""
    plan_method(config.method, config.knobs)
    decoders: dict[str, Decoder] = {}
    metrics = Metrics()
    generation_lock = asyncio.Lock()  # FIFO: waiters are served in arrival order
    context = getattr(model.config, "max_position_embeddings", None)
    pending = [0]  # requests waiting for or in generation

    def decoder_for(method: str, knobs: dict) -> Decoder:
        draft = {"draft_model": draft_model} if plan_method(method, knobs).needs_draft() else {}
        if draft and draft_model is None:
            raise ValueError("method draft_model needs a draft model: start the server with --draft-model NAME")
        if not knobs or (method == config.method and knobs == config.knobs):
            key = method
            if key not in decoders:
                own = config.knobs if method == config.method else {}
                decoders[key] = Decoder(model, tokenizer, method, **draft, **own)
            return decoders[key]
        return Decoder(model, tokenizer, method, **draft, **knobs)  # per-request knobs: a private decoder

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.cache_path and config.method == "trie":
            decoder = decoder_for("trie", {})
            if Path(config.cache_path).is_file():
                decoder.load_cache(config.cache_path)
        yield
        if config.cache_path and "trie" in decoders:
            decoders["trie"].save_cache(config.cache_path)

    app = FastAPI(title="forerun", lifespan=lifespan)
    app.state.decoders = decoders
    app.state.metrics = metrics

    def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        return JSONResponse(
            status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": None}}
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        metrics.requests.labels(request.url.path, str(error.status)).inc()
        return error_response(error.status, error.message, error.param, error.kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        metrics.requests.labels(request.url.path, "400").inc()
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(
            400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}", where or None
        )

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if config.api_key and request.url.path != "/health":
            if request.headers.get("authorization") != f"Bearer {config.api_key}":
                metrics.requests.labels(request.url.path, "401").inc()
                return error_response(401, "invalid or missing API key", kind="authentication_error")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            metrics.requests.labels(request.url.path, "413").inc()
            return error_response(413, f"request body over {config.max_body_bytes} bytes")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, "queue": pending[0]}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "forerun"}],
        }

    def prepare(body: CommonRequest) -> tuple[Decoder, dict]:
        if body.model not in (None, config.model_name):
            raise APIError(
                404,
                f"model {body.model!r} is not served here; this server runs {config.model_name!r}",
                "model",
                "not_found_error",
            )
        if body.n != 1:
            raise APIError(400, f"n={body.n} is not supported: forerun returns one choice (n=1)", "n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name):
                raise APIError(400, f"{name} has no exact transformers processor; use repetition_penalty", name)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, config.max_tokens_limit)
        if max_tokens <= 0 or max_tokens > config.max_tokens_limit:
            raise APIError(
                400, f"max_tokens must be between 1 and {config.max_tokens_limit}, got {max_tokens}", "max_tokens"
            )
        options = dict(body.forerun or {})
        method = options.pop("method", config.method)
        try:
            decoder = decoder_for(method, options)
        except ValueError as error:
            raise APIError(400, str(error), "forerun") from None
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        kwargs: dict[str, Any] = {"stop": stops or None}
        sampling = {
            k: v for k, v in (("top_p", body.top_p), ("top_k", body.top_k), ("min_p", body.min_p)) if v is not None
        }
        if body.temperature not in (None, 0.0) or (body.temperature is None and sampling):
            kwargs.update(do_sample=True, temperature=body.temperature or 1.0, seed=body.seed, **sampling)
        if body.repetition_penalty is not None:
            kwargs["repetition_penalty"] = body.repetition_penalty
        kwargs["max_new_tokens"] = max_tokens
        return decoder, kwargs

    async def run(
        decoder: Decoder,
        prompt,
        chat: bool,
        kwargs: dict,
        request: Request,
        stream: TokenStream | None,
        endpoint: str,
        cancel: threading.Event,
    ) -> GenerationResult:
        metrics.queue.inc()
        pending[0] += 1
        started = time.perf_counter()
        try:
            async with generation_lock:
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected before generation started")
                loop = asyncio.get_running_loop()
                job = loop.run_in_executor(
                    None, lambda: decoder.generate(prompt, chat=chat, streamer=stream, cancel=cancel, **kwargs)
                )
                watcher = asyncio.create_task(watch(request, cancel, config.request_timeout_s))
                try:
                    result = await job
                except ValueError as error:
                    raise APIError(400, str(error)) from None
                finally:
                    watcher.cancel()
        finally:
            metrics.queue.dec()
            pending[0] -= 1
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        metrics.tokens.labels(decoder.method).inc(result.stats.new_tokens)
        metrics.tokens_per_forward.labels(decoder.method).observe(result.stats.tokens_per_forward)
        if result.stats.candidates:
            metrics.acceptance.labels(decoder.method).observe(result.stats.acceptance_rate)
        return result

    def finish(result: GenerationResult, stops: list[str], max_tokens: int) -> tuple[str, str]:
        text = result.text or ""
        cut = first_stop(text, stops)
        if cut is not None:
            return text[:cut], "stop"
        return text, "length" if len(result.new_tokens) >= max_tokens else "stop"

    def usage(result: GenerationResult, decoder: Decoder) -> dict:
        s = result.stats
        return {
            "usage": {
                "prompt_tokens": result.prompt_len,
                "completion_tokens": s.new_tokens,
                "total_tokens": result.prompt_len + s.new_tokens,
            },
            "forerun": {
                "method": decoder.method,
                "forwards": s.forwards,
                "tokens_per_forward": s.tokens_per_forward,
                "acceptance": s.acceptance_rate,
                "seconds": s.total_seconds,
            },
        }

    async def handle(body: CommonRequest, request: Request, chat: bool):
        endpoint = request.url.path
        decoder, kwargs = prepare(body)
        prompt = [m.model_dump() for m in body.messages] if chat else body.prompt
        if not chat and not body.prompt.strip():
            raise APIError(400, "prompt is empty", "prompt")
        if context is not None:
            ids = decoder.encode(prompt, chat=False)
            if ids.shape[1] + kwargs["max_new_tokens"] > context:
                raise APIError(
                    400,
                    f"prompt ({ids.shape[1]} tokens) + max_tokens ({kwargs['max_new_tokens']}) "
                    f"exceeds the model context ({context} tokens)",
                    "max_tokens",
                )
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        stops = kwargs["stop"] or []
        cancel = threading.Event()
        if not body.stream:
            result = await run(decoder, prompt, chat, kwargs, request, None, endpoint, cancel)
            text, reason = finish(result, stops, kwargs["max_new_tokens"])
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                if chat
                else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            )
            metrics.requests.labels(endpoint, "200").inc()
            return {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": config.model_name,
                "choices": [choice],
                **usage(result, decoder),
            }
        stream = TokenStream(tokenizer, asyncio.get_running_loop(), stops)
        task = asyncio.create_task(run(decoder, prompt, chat, kwargs, request, stream, endpoint, cancel))
        metrics.requests.labels(endpoint, "200").inc()
        return StreamingResponse(
            sse(stream, task, cancel, decoder, chat, ident, created, kwargs), media_type="text/event-stream"
        )

    async def sse(
        stream: TokenStream,
        task: asyncio.Task,
        cancel: threading.Event,
        decoder: Decoder,
        chat: bool,
        ident: str,
        created: int,
        kwargs: dict,
    ) -> AsyncIterator[str]:
        """Server-sent events; if the client goes away mid-stream, the generation is cancelled."""
        try:
            async for event in events(stream, task, decoder, chat, ident, created, kwargs):
                yield event
        finally:
            if not task.done():
                cancel.set()

    async def events(
        stream: TokenStream, task: asyncio.Task, decoder: Decoder, chat: bool, ident: str, created: int, kwargs: dict
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None = None, extra: dict | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            payload = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": config.model_name,
                "choices": [choice],
                **(extra or {}),
            }
            return f"data: {json.dumps(payload)}\n\n"

        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield (
                "data: "
                + json.dumps(
                    {"id": ident, "object": kind, "created": created, "model": config.model_name, "choices": [first]}
                )
                + "\n\n"
            )
        while True:
            getter = asyncio.ensure_future(stream.queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                delta = getter.result()
                if delta is None:
                    break
                yield chunk(delta)
                continue
            getter.cancel()
            if task.exception() is not None:
                break
        error = task.exception() if task.done() else None
        if error is None:
            result = await task
            _, reason = finish(result, kwargs["stop"] or [], kwargs["max_new_tokens"])
            yield chunk(None, reason, usage(result, decoder))
        else:
            message = error.message if isinstance(error, APIError) else str(error)
            yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handle(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await handle(body, request, chat=True)

    return app


async def watch(request: Request, cancel: threading.Event, timeout_s: float) -> None:
    """Set `cancel` when the client disconnects or the request runs past its timeout."""
    deadline = time.monotonic() + timeout_s
    while not cancel.is_set():
        if await request.is_disconnected() or time.monotonic() > deadline:
            cancel.set()
            return
        await asyncio.sleep(0.1)
