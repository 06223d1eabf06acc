"""An OpenAI-compatible HTTP server around one model: completions and chat, streaming, metrics, a shared cache.

The layers: `schemas` (request bodies), `translate` (request -> generation arguments, every 400 decided there),
`pool` (the Decoders and the worker thread), `stream` (text deltas), and the thin routes below. In front of them
a pure ASGI guard checks the Host header (no DNS rebinding against a local server), the API key (constant-time),
and the body size while the body is read (chunked bodies included). Errors are OpenAI-style JSON; the server keeps
serving. Every request has one deadline, from arrival to the last token; a client that goes away, the deadline or
shutdown cancel its generation after the current step.

Example:
    forerun serve --method auto --cache trie.safetensors --port 8000
    >>> from openai import OpenAI                                                      # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")         # doctest: +SKIP
    >>> messages = [{"role": "user", "content": "Hi"}]                                  # doctest: +SKIP
    >>> client.chat.completions.create(model="smollm2-135m", messages=messages)       # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from forerun.batch import batchable
from forerun.decoder import DEFAULT_PREFIX_TOKENS, Decoder, GenerationResult
from forerun.methods import DEFAULT_METHOD
from forerun.prefixcache import PrefixCache
from forerun.server.pool import DEFAULT_PREFILL_CHUNK, Abandoned, BatchWorker, DecoderPool, ShuttingDown, Worker
from forerun.server.schemas import ChatRequest, CompletionRequest, ErrorResponse
from forerun.server.stream import TokenStream
from forerun.server.translate import APIError, GenerationArgs, Limits, translate
from forerun.stopping import first_stop

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
"""Metric labels are these (or 'other'), never a raw path a client chose."""
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
RETRY_AFTER_S = 2
"""Seconds a client refused with 429 is told to wait (the Retry-After header)."""


@dataclass(frozen=True)
class ServerConfig:
    """Limits and defaults of one server."""

    model_name: str
    method: str = DEFAULT_METHOD
    knobs: dict = field(default_factory=dict)
    api_key: str | None = None
    """Bearer token required on every endpoint but /health (None = open)."""
    cache_path: str | None = None
    """Trie file loaded at start (if present) and saved at shutdown (methods with a trie)."""
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_body_bytes: int = 1_000_000
    body_timeout_s: float = 30.0
    """From a request's head to the end of its body; a slower body gets 408 and its connection closed (a client
    that sends a body a byte a minute must not hold a connection for ever; heads: `forerun.server.protocol`)."""
    request_timeout_s: float = 300.0
    """From the request's arrival to its last token (queueing included)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header values accepted ('*': any). None: any with an API key, else local names only."""
    max_queue: int = 64
    """Most requests waiting for or in generation; one more gets 429 with Retry-After (backpressure)."""
    max_batch: int = 8
    """Most requests decoded together (continuous batching); 1 = one at a time, in arrival order."""
    prefix_cache_tokens: int = DEFAULT_PREFIX_TOKENS
    """Tokens of KV kept for prompts that begin alike (system prompts, next turns), shared by every method; 0: off."""
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    """Prompt tokens a request joining the running batch feeds between two of its steps; 0: whole prompts at once
    (a long prompt then stops every other stream for its whole prefill)."""
    max_tree_nodes: int | None = None
    """Most tokens any request's forward may carry (`serve --max-tree-nodes`); None: what the curve affords."""
    request_methods: tuple[str, ...] | None = None
    """Methods a request may name in `forerun.method` besides the server's own (None: any). State learned from
    requests (the trie, the n-gram pool) is kept per `cache_salt` whatever is allowed; `()` keeps every request on
    the operator's method and knobs' method."""


class CacheError(ValueError):
    """The cache file cannot be used: the message says why and what to do."""


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
        self.rejected = Counter("forerun_rejected", "Requests refused with 429 (queue full)", registry=self.registry)

    def count(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()


logger = logging.getLogger(__name__)


def failed(error: Exception) -> APIError:
    """A request's own failure while it was generated (its drafters, its budget), as a 500 that names it; the
    requests beside it in the batch go on."""
    logger.error("forerun: a request failed: %r", error)
    message = f"the request failed while generating: {type(error).__name__}: {error}"[:500]
    return APIError(500, message, kind="server_error")


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content=error_body(status, message, param, kind))


def host_name(host: str) -> str | None:
    """The host of a Host header value, lower-cased, or None if the value is not `name[:port]` or `[v6][:port]`.

    Example:
        >>> host_name("LocalHost:8000"), host_name("[::1]:80"), host_name("[::1].evil.example")
        ('localhost', '::1', None)
        >>> host_name("127.0.0.1:80@evil.example"), host_name("[::1]evil"), host_name("")
        (None, None, None)
    """
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        name, rest = (host[1:end], host[end + 1 :]) if end > 0 else ("", "")
        if not name or any(c not in "0123456789abcdef:." for c in name):
            return None
    else:
        name, _, port = host.partition(":")
        rest = f":{port}" if _ else ""
        if not name or any(not (c.isalnum() or c in "-.") for c in name):
            return None
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name


class Guard:
    """Pure ASGI middleware: Host check, API key, body size limit while reading; then the app, body replayed.

    Pure ASGI (not Starlette's BaseHTTPMiddleware) so the app still sees the client's disconnect.
    """

    def __init__(self, app, config: ServerConfig, metrics: Metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        hosts = config.allowed_hosts
        if hosts is None:
            hosts = ("*",) if config.api_key else LOCAL_HOSTS
        self.any_host = "*" in hosts
        self.hosts = {h.lower().strip("[]") for h in hosts}

    async def reject(self, scope, send, status: int, message: str, kind: str = "invalid_request_error") -> None:
        """Answer before the body was read, and close the connection after the answer: a client that keeps
        sending (or trickling) a body it was refused must not hold the connection, nor reset its deadlines."""
        self.metrics.count(scope["path"], status)
        response = error_response(status, message, kind=kind)
        response.headers["connection"] = "close"
        await response(scope, self.idle_receive, send)

    @staticmethod
    async def idle_receive():
        return {"type": "http.disconnect"}

    def host_allowed(self, headers: dict[bytes, bytes]) -> bool:
        """The Host header names an allowed host: `name[:port]` or `[v6][:port]`, nothing else around it (HTTP/1.1
        requires the header; without one, only a server open to any host answers)."""
        if self.any_host:
            return True
        host = headers.get(b"host")
        name = host_name(host.decode("latin-1")) if host is not None else None
        return name is not None and name in self.hosts

    def authorised(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        expected = self.config.api_key.encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        listed = scope.get("headers", [])
        headers = dict(listed)
        for name in (b"host", b"authorization"):
            if sum(1 for key, _ in listed if key == name) > 1:  # which one counts is ambiguous: neither does
                await self.reject(scope, send, 400, f"more than one {name.decode()} header")
                return
        if not self.host_allowed(headers):
            await self.reject(scope, send, 403, "Host not allowed (start the server with --allow-host NAME)")
            return
        if self.config.api_key and scope["path"] != "/health" and not self.authorised(headers):
            await self.reject(scope, send, 401, "invalid or missing API key", "authentication_error")
            return
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self.reject(scope, send, 413, f"request body over {limit} bytes")
            return
        chunks, size, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.body_timeout_s
        while more:  # read the whole body, counting as it comes (a chunked body declares no length)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                seconds = self.config.body_timeout_s
                await self.reject(scope, send, 408, f"request body not received within {seconds:g} s", "timeout")
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self.reject(scope, send, 413, f"request body over {limit} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the real channel: the app can see the client disconnect

        await self.app(scope, replay, send)


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The HTTP methods the app's routes take at `path`."""
    methods = {m for route in app.routes if getattr(route, "path", None) == path for m in getattr(route, "methods", ())}
    return sorted(methods)


def load_trie_cache(pool: DecoderPool, path: str | None) -> Decoder | None:
    """The Decoder whose trie the cache holds, with the file loaded if present; checked before serving."""
    if not path:
        return None
    decoder = pool.trie_decoder()
    if decoder is None:
        raise CacheError(f"--cache {path}: method {pool.method!r} keeps no trie (use a method with 'trie' in it)")
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise CacheError(f"--cache {path}: folder {folder} does not exist or is not writable")
    probe = folder / f".{Path(path).name}.probe-{os.getpid()}"
    try:  # a write, not a permission bit, tells whether the trie can be saved there at shutdown (/proc lies)
        probe.write_bytes(b"forerun")
        probe.unlink()
    except OSError as error:
        raise CacheError(f"--cache {path}: cannot write in {folder} ({error.strerror or error})") from None
    if Path(path).exists():
        try:
            decoder.load_cache(path)
        except (ValueError, OSError) as error:
            raise CacheError(f"--cache {path} cannot be read ({error}); delete it or give another path") from None
    return decoder


def sampling_defaults(model) -> dict:
    """The model's generation_config sampling settings, for the fields a request leaves out."""
    config = model.generation_config
    if not getattr(config, "do_sample", False):
        return {}
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {"do_sample": True, **{n: getattr(config, n) for n in names if getattr(config, n, None) is not None}}


def create_app(model, tokenizer, config: ServerConfig, draft_model=None) -> FastAPI:
    """The FastAPI app for one loaded model (and the draft model of method draft_model, if one was loaded).

    A bad method, knob or cache file raises here (ValueError), before anything is served.
    """
    limits = Limits(
        model_name=config.model_name,
        method=config.method,
        knobs=dict(config.knobs),
        max_tokens_limit=config.max_tokens_limit,
        default_max_tokens=config.default_max_tokens,
        sampling_defaults=sampling_defaults(model),
        device_type=next(model.parameters()).device.type,
        request_methods=config.request_methods,
    )
    pool = DecoderPool(
        model, tokenizer, config.method, config.knobs, draft_model, PrefixCache(config.prefix_cache_tokens),
        config.max_tree_nodes,
    )  # fmt: skip
    pool.get(config.method, {})  # a bad method or knob fails now
    cache_decoder = load_trie_cache(pool, config.cache_path)
    metrics = Metrics()
    if config.max_batch > 1 and batchable(model):
        # batch_budget: the curve's batched rows are measured now (once per model and device, then read from
        # disk), not while the first clients wait
        budget = pool.get(config.method, {}).batch_budget()
        worker: Worker | BatchWorker = BatchWorker(model, budget, config.max_batch, config.prefill_chunk)
    else:  # one at a time (also for models whose cache cannot hold ragged rows)
        worker = Worker()
    pending = [0]  # requests waiting for or in generation
    rejected = [0]  # requests refused because the queue was full

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)
        if cache_decoder is not None:
            cache_decoder.save_cache(config.cache_path)

    app = FastAPI(title="forerun", lifespan=lifespan)
    app.state.pool = pool
    app.state.decoders = pool.shared
    app.state.metrics = metrics
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        metrics.count(request.url.path, error.status)
        response = error_response(error.status, error.message, error.param, error.kind)
        if error.status == 429:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        """Anything else still answers in OpenAI's shape, and is counted."""
        logger.error("forerun: %s %s failed: %r", request.method, request.url.path, error)
        metrics.count(request.url.path, 500)
        return error_response(500, f"internal error: {type(error).__name__}", kind="server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        metrics.count(request.url.path, 400)
        errors = error.errors()
        first = errors[0] if errors else {}
        location = [str(x) for x in first.get("loc", ()) if x != "body"]
        kinds = {e.get("type") for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]}
        if {"int_type", "float_type"} <= kinds:  # a number field's union: "a valid integer" misleads for "0.5"
            field = location[0] if location else "body"
            return error_response(400, f"invalid request: {field}: must be a number, not a string or a boolean", field)
        where = ".".join(location[:1] + [x for x in location[1:] if x.isdigit()]) or "body"
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unrecognized request field {where!r}", where)
        if first.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {first.get('ctx', {}).get('error', 'malformed')}")
        return error_response(400, f"invalid request: {where}: {first.get('msg', 'malformed')}", where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        metrics.count(request.url.path, error.status_code)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        response = error_response(error.status_code, str(error.detail), kind=kind)
        if error.status_code == 405:  # RFC 9110: a 405 says which methods the resource takes
            response.headers["allow"] = ", ".join(allowed_methods(app, request.url.path))
        return response

    @app.get("/health")
    async def health():
        running, queued = worker.counts(pending[0])
        return {
            "status": "ok",
            "model": config.model_name,
            "queue": pending[0],
            "running": running,
            "queued": queued,
            "rejected": rejected[0],
            "max_queue": config.max_queue,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_endpoint():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "forerun"}],
        }

    async def generate(args: GenerationArgs, request: Request, stream: TokenStream | None, cancel: threading.Event):
        """Run one generation on the worker; its deadline started when the request arrived."""
        try:
            decoder = pool.get(args.method, args.knobs)
        except ValueError as error:
            raise APIError(400, str(error), "forerun") from None
        why: dict = {}

        arguments = dict(
            chat=args.chat,
            stop=args.stop or None,
            streamer=stream,
            seed=args.seed,
            cancel=cancel,
            logprobs=args.logprobs,
            prediction=args.prediction,
            cache_salt=args.cache_salt,
            **args.sampling,
        )

        def job() -> GenerationResult:
            if cancel.is_set():  # timed out or gone while queued
                raise Abandoned
            return decoder.generate(args.prompt, args.max_new_tokens, **arguments)

        def row():  # continuous batching: the row this request adds to the running batch
            return (*decoder.prepare(args.prompt, args.max_new_tokens, **arguments), decoder)

        if pending[0] >= config.max_queue:  # backpressure: a clear "come back later", not minutes of waiting
            rejected[0] += 1
            metrics.rejected.inc()
            busy = f"the server is busy ({pending[0]} requests queued); retry later"
            raise APIError(429, busy, kind="rate_limit_exceeded")
        metrics.queue.inc()
        pending[0] += 1
        started = time.perf_counter()
        watcher = asyncio.create_task(watch(request, cancel, request.state.deadline, why))
        try:
            result = await worker.run(row if isinstance(worker, BatchWorker) else job, cancel)
        except ValueError as error:  # the decoder refused the prompt (over the context, empty, ...)
            raise APIError(400, str(error), "messages" if args.chat else "prompt") from None
        except (Abandoned, ShuttingDown):
            if why.get("reason") == "timeout":
                raise APIError(504, request_timed_out(config), kind="timeout") from None
            message = "the request was cancelled (client gone or server shutting down)"
            raise APIError(503, message, kind="server_error") from None
        except Exception as error:  # noqa: BLE001 - this request's own failure, answered in OpenAI's shape
            raise failed(error) from None
        finally:
            watcher.cancel()
            metrics.queue.dec()
            pending[0] -= 1
        if why.get("reason") == "timeout":
            raise APIError(504, request_timed_out(config), kind="timeout")
        if worker.closing and cancel.is_set() and "reason" not in why:  # stopped by the shutdown's drain
            raise APIError(503, "the server is shutting down; this request was stopped", kind="server_error")
        metrics.latency.labels(request.url.path).observe(time.perf_counter() - started)
        metrics.tokens.labels(decoder.method).inc(result.stats.new_tokens)
        metrics.tokens_per_forward.labels(decoder.method).observe(result.stats.tokens_per_forward)
        if result.stats.candidates:
            metrics.acceptance.labels(decoder.method).observe(result.stats.acceptance_rate)
        return decoder, result

    def finish(result: GenerationResult, args: GenerationArgs, decoder: Decoder) -> tuple[str, str, int | None]:
        """(text, finish_reason, where the stop cut the text or None)."""
        text = result.text or ""
        cut = first_stop(text, args.stop)
        if cut is not None:
            return text[:cut], "stop", cut
        new = result.new_tokens
        eos = decoder.model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if len(new) >= args.max_new_tokens and not (new and new[-1] in eos_ids):
            return text, "length", None
        return text, "stop", None

    def usage(result: GenerationResult, decoder: Decoder) -> dict:
        s = result.stats
        return {
            "usage": {
                "prompt_tokens": result.prompt_len,
                "completion_tokens": s.new_tokens,
                "total_tokens": result.prompt_len + s.new_tokens,
                "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
                "completion_tokens_details": {
                    "accepted_prediction_tokens": result.accepted_prediction_tokens,
                    "rejected_prediction_tokens": result.rejected_prediction_tokens,
                },
            },
            "forerun": {
                "method": decoder.method,
                "forwards": s.forwards,
                "tokens_per_forward": s.tokens_per_forward,
                "acceptance": s.acceptance_rate,
                "seconds": s.total_seconds,
                "prefill_seconds": s.prefill_seconds,
                "prefill_chunks": s.prefill_chunks,
            },
        }

    def logprobs_payload(result: GenerationResult, cut: int | None, chat: bool) -> dict | None:
        """OpenAI's logprobs object for the tokens whose text is shown (those before a stop string)."""
        if result.logprobs is None:
            return None
        entries, offsets, shown = [], [], 0
        for entry in result.logprobs:
            if cut is not None and shown >= cut:
                break
            piece = tokenizer.decode([entry.token])
            entries.append((entry, piece))
            offsets.append(shown)
            shown += len(piece)

        def described(token: int, value: float) -> dict:
            piece = tokenizer.decode([token])
            return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

        if chat:
            content = [
                {**described(e.token, e.logprob), "top_logprobs": [described(t, v) for t, v in e.top]}
                for e, _ in entries
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [piece for _, piece in entries],
            "token_logprobs": [e.logprob for e, _ in entries],
            "top_logprobs": [{tokenizer.decode([t]): v for t, v in e.top} for e, _ in entries],
            "text_offset": offsets,
        }

    async def handle(body: ChatRequest | CompletionRequest, request: Request, chat: bool):
        request.state.deadline = time.monotonic() + config.request_timeout_s
        endpoint = request.url.path
        args = translate(body, limits)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        cancel = threading.Event()
        if not args.stream:
            decoder, result = await generate(args, request, None, cancel)
            text, reason, cut = finish(result, args, decoder)
            logprobs = logprobs_payload(result, cut, chat)
            if chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            metrics.count(endpoint, 200)
            return {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": config.model_name,
                "choices": [choice],
                **usage(result, decoder),
            }
        stream = TokenStream(tokenizer, asyncio.get_running_loop(), args.stop)
        task = asyncio.create_task(generate(args, request, stream, cancel))
        await started(stream, task, cancel)
        metrics.count(endpoint, 200)
        return StreamingResponse(sse(stream, task, cancel, args, chat, ident, created), media_type="text/event-stream")

    async def started(stream: TokenStream, task: asyncio.Task, cancel: threading.Event) -> None:
        """Wait until a streamed generation has begun (its prompt checked, its place in the batch taken) or failed
        before: a full queue, a bad knob, a prompt over the context, a timeout while queued then answer with their
        HTTP status (429 with Retry-After, 400, 504), not as an error event inside a 200 stream, so clients'
        status handling and retries work for streams too."""
        waiter = asyncio.ensure_future(stream.started.wait())
        try:
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:
            waiter.cancel()
        if not stream.started.is_set() and task.done():
            await task  # it failed before its first step: APIError -> its status

    async def sse(
        stream: TokenStream, task: asyncio.Task, cancel: threading.Event, args, chat, ident, created
    ) -> AsyncIterator[str]:
        """Server-sent events; if the client goes away mid-stream, the generation is cancelled."""
        try:
            async for event in events(stream, task, args, chat, ident, created):
                yield event
        finally:
            if not task.done():
                cancel.set()

    async def events(stream: TokenStream, task: asyncio.Task, args, chat, ident, created) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None = None, extra: dict | None = None, choices=True) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            payload = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": config.model_name,
                "choices": [choice] if choices else [],
                **(extra or {}),
            }
            return f"data: {json.dumps(payload)}\n\n"

        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            opening = {"id": ident, "object": kind, "created": created, "model": config.model_name, "choices": [first]}
            yield f"data: {json.dumps(opening)}\n\n"
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
            if task.cancelled() or task.exception() is not None:
                break
        try:
            decoder, result = await task
        except APIError as error:
            yield f"data: {json.dumps(error_body(error.status, error.message, error.param, error.kind))}\n\n"
        except Exception as error:  # noqa: BLE001 - a stream ends with an error event and [DONE], never cut
            failure = failed(error)
            yield f"data: {json.dumps(error_body(failure.status, failure.message, kind=failure.kind))}\n\n"
        else:
            _, reason, _ = finish(result, args, decoder)
            extra = usage(result, decoder)
            yield chunk(None, reason, {"forerun": extra["forerun"]})
            if args.include_usage:  # as OpenAI: a last chunk with no choices carries the usage
                yield chunk(None, None, {"usage": extra["usage"]}, choices=False)
        yield "data: [DONE]\n\n"

    responses = {400: {"model": ErrorResponse, "description": "Invalid request (OpenAI-style error)"}}

    @app.post("/v1/completions", responses=responses)
    async def completions(body: CompletionRequest, request: Request):
        return await handle(body, request, chat=False)

    @app.post("/v1/chat/completions", responses=responses)
    async def chat_completions(body: ChatRequest, request: Request):
        return await handle(body, request, chat=True)

    def openapi() -> dict:
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

    app.openapi = openapi
    app.add_middleware(Guard, config=config, metrics=metrics)
    return app


def request_timed_out(config: ServerConfig) -> str:
    return f"the request took longer than the server's timeout of {config.request_timeout_s:g} s"


async def watch(request: Request, cancel: threading.Event, deadline: float, why: dict) -> None:
    """Set `cancel` when the client disconnects or the request's deadline passes (and say which)."""
    while not cancel.is_set():
        if time.monotonic() > deadline:
            why["reason"] = "timeout"
            cancel.set()
            return
        if await request.is_disconnected():
            why["reason"] = "disconnect"
            cancel.set()
            return
        await asyncio.sleep(0.1)
