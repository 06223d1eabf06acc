"""The request path of the server, one method per stage: `answer` (a completion or chat request, JSON or a stream)
-> `translate` (every 400 decided there) -> `generate_groups` (admission and backpressure, one group of choices
per prompt, the deadline) -> `echo` (a completion's prompt scored, `forerun.server.echo`) and `generate` (the
worker) -> `forerun.server.shaping` (OpenAI's JSON) or `forerun.server.chat_stream` (its chunks).

Example (what the routes of `forerun.server.app` do):
    >>> service = Service(model, tokenizer, config)                       # doctest: +SKIP
    >>> await service.answer(ChatRequest(messages=[...]), request, chat=True)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from forerun.assembly import make_prefixes
from forerun.decoder import Decoder, GenerationResult
from forerun.fim import fim_marks
from forerun.preparation import eos_ids_of
from forerun.request import GenerationRequest
from forerun.server.chat_stream import chat_events
from forerun.server.config import ServerConfig, load_trie_cache, sampling_defaults
from forerun.server.decoders import DecoderPool
from forerun.server.echo import echoed, prompt_counts
from forerun.server.errors import failed
from forerun.server.messages import takes_developer
from forerun.server.metrics import Metrics
from forerun.server.pool import Abandoned, BatchWorker, ShuttingDown, Worker
from forerun.server.renaming import Renaming
from forerun.server.schemas import ChatRequest, CompletionRequest
from forerun.server.shaping import Answer, Echo, completion
from forerun.server.stream import TokenStream, cancelling, started
from forerun.server.translate import APIError, GenerationArgs, Limits, translate
from forerun.template_kwargs import checked_template_kwargs, template_variables
from forerun.thoughts import thought_marks
from forerun.tool_specs import call_mark, parameters_of, short_call_ids, takes_tools

logger = logging.getLogger(__name__)


class Service:
    """One model served: its decoders, its worker (continuous batching or one at a time), its metrics and queue.

    A bad method, knob or cache file raises here (ValueError), before anything is served."""

    def __init__(self, model, tokenizer, config: ServerConfig, draft_model=None) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.limits = Limits(
            model_name=config.model_name,
            aliases=config.aliases,
            method=config.method,
            knobs=dict(config.knobs),
            max_tokens_limit=config.max_tokens_limit,
            default_max_tokens=config.default_max_tokens,
            sampling_defaults=sampling_defaults(model),
            device_type=next(model.parameters()).device.type,
            request_methods=config.request_methods,
            head=config.draft_head is not None,
            vocab_size=getattr(model.config.get_text_config(decoder=True), "vocab_size", None),
            context=getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None),
            eos_token_ids=tuple(sorted(eos_ids_of(model, None))),
            tools=takes_tools(tokenizer),
            short_call_ids=short_call_ids(tokenizer),
            call_mark=call_mark(tokenizer),
            developer=takes_developer(tokenizer),
            fim=fim_marks(tokenizer),
            template_variables=(variables := template_variables(tokenizer)),
            template_defaults=checked_template_kwargs(config.chat_template_kwargs, variables),
        )
        self.thoughts = thought_marks(tokenizer)
        """The marks of a reasoning model's thought, which chat answers send apart (`forerun.thoughts`)."""
        prefixes = "auto" if config.prefix_cache_tokens is None else config.prefix_cache_tokens
        self.pool = DecoderPool(
            model, tokenizer, config.method, config.knobs, draft_model, make_prefixes(model, prefixes, reads=True),
            config.max_tree_nodes, config.draft_head, config.compile_buckets,
        )  # fmt: skip
        self.pool.get(config.method, {})  # a bad method or knob fails now
        self.cache_decoder = load_trie_cache(self.pool, config.cache_path)
        self.metrics = Metrics()
        self.warm_up_s = self.warm_up(model)
        """Seconds spent capturing graphs before serving (0.0 without a static cache: a CPU's default)."""
        self.worker = self.make_worker(model)
        self.pending = 0
        """Requests waiting for or in generation."""
        self.rejected = 0
        """Requests refused because the queue was full."""

    def warm_up(self, model) -> float:
        """Capture the server's own method's graphs now, for its batch's rows (or single rows, unbatched;
        `ServerConfig.warm_up_tokens`), so that no client waits for a capture."""
        if self.config.warm_up_tokens == 0:
            return 0.0
        context = getattr(model.config, "max_position_embeddings", None) or self.config.warm_up_tokens
        decoder = self.pool.get(self.config.method, {})
        rows = self.config.max_batch if self.config.max_batch > 1 and decoder.batches else 1
        try:
            # a batched server's requests all join its batch: a lone request's own graphs would never replay
            return decoder.warm_up(min(self.config.warm_up_tokens, context), batch_size=rows, single=rows == 1)
        except ValueError as error:  # e.g. a sliding window shorter than the texts: those take the growing cache
            logger.warning("forerun: no graphs captured before serving (%s); each at its first use", error)
            return 0.0

    def make_worker(self, model) -> Worker | BatchWorker:
        decoder = self.pool.get(self.config.method, {})
        if self.config.max_batch > 1 and decoder.batches:
            # batch_budget: the curve's batched rows are measured now (once per model and device, then read from
            # disk), not while the first clients wait
            budget = decoder.batch_budget()
            chunk = self.config.prefill_chunk if decoder.reads_on else 0  # a hybrid losing its states: whole
            return BatchWorker(model, budget, self.config.max_batch, chunk, decoder.base)
        return Worker()  # one at a time (also for models whose cache cannot hold ragged rows)

    def shutdown(self) -> None:
        """Stop the worker (every request answered), then save the trie."""
        self.worker.shutdown()
        if self.cache_decoder is not None:
            self.cache_decoder.save_cache(self.config.cache_path)

    def health(self) -> dict:
        running, queued = self.worker.counts(self.pending)
        return {
            "status": "ok",
            "model": self.config.model_name,
            "queue": self.pending,
            "running": running,
            "queued": queued,
            "rejected": self.rejected,
            "max_queue": self.config.max_queue,
        }

    async def answer(self, body: ChatRequest | CompletionRequest, request: Request, chat: bool):
        """One completion or chat request: its JSON response, or a stream of server-sent events."""
        request.state.deadline = time.monotonic() + self.config.request_timeout_s
        args = translate(body, self.limits)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        answer = Answer(ident, int(time.time()), self.config.model_name, chat, self.limits.short_call_ids)
        cancel = threading.Event()
        groups = args.each()
        if not args.stream:
            decoder, done = await self.generate_groups(groups, request, None, cancel)
            self.metrics.count(request.url.path, 200)
            results = [result for _, results in done for result in results]
            echoes = [echo for echo, results in done for _ in results]
            return completion(answer, results, decoder.method, self.tokenizer, echoes, prompt_counts(done))
        loop, logprobs = asyncio.get_running_loop(), args.logprobs is not None
        tools = parameters_of(args.tools) if args.tools and args.tool_choice != "none" else None
        thoughts = self.thoughts if chat else None
        streams = [
            [
                TokenStream(self.tokenizer, loop, args.stop, logprobs, tools, self.limits.call_mark, thoughts)
                for _ in range(g.runs)
            ]
            for g in groups
        ]
        task = asyncio.create_task(self.generate_groups(groups, request, streams, cancel))
        await started([stream for each in streams for stream in each], task, cancel)
        self.metrics.count(request.url.path, 200)
        events = chat_events(self.tokenizer, streams, task, args, answer)
        return StreamingResponse(cancelling(events, task, cancel), media_type="text/event-stream")

    async def stream_one(
        self, args: GenerationArgs, request: Request, cancel: threading.Event, rename: Renaming
    ) -> tuple[TokenStream, asyncio.Task]:
        """One chat generation streamed (a Responses or Messages request's): its stream, once it has begun (its
        prompt checked, its place taken: a failure before is the request's own HTTP status), and the task whose
        result ends it (`generate_groups`'), its errors named as the client's API names its fields (`rename`)."""
        tools = parameters_of(args.tools) if args.tools and args.tool_choice != "none" else None
        logprobs, mark = args.logprobs is not None, self.limits.call_mark
        stream = TokenStream(
            self.tokenizer, asyncio.get_running_loop(), args.stop, logprobs, tools, mark, self.thoughts
        )
        task = asyncio.create_task(rename.awaited(self.generate_groups([args], request, [[stream]], cancel)))
        await started([stream], task, cancel)
        self.metrics.count(request.url.path, 200)
        return stream, task

    async def generate_groups(
        self,
        groups: list[GenerationArgs],
        request: Request,
        streams: list[list[TokenStream]] | None,
        cancel: threading.Event,
    ) -> tuple[Decoder, list[tuple[Echo | None, list[GenerationResult | None]]]]:
        """Each prompt's choices (`GenerationArgs.each`: a completions request may send several prompts), admitted
        together, under one watcher of the client and the deadline; one failing stops the others and fails the
        request. Returns, per prompt, its echo (None: not asked) and a result per choice (greedy: the one
        generation's, n times; None: nothing generated, `max_tokens` 0)."""
        try:
            decoder = self.pool.get(groups[0].method, groups[0].knobs)
            wanted = [
                [args.request(None if streams is None else streams[k][i], cancel, i) for i in range(args.runs)]
                for k, args in enumerate(groups)
            ]
        except ValueError as error:
            raise APIError(400, str(error), "forerun") from None
        held = next((request.held_format for each in wanted for request in each), None)
        if held is not None:  # compiled off the event loop and the batch's thread (GIL released)
            try:
                await asyncio.to_thread(decoder.grammars.compile, held)
            except ValueError as error:
                param = "tools" if held["type"] == "tool_calls" else "response_format"
                raise APIError(400, str(error), param) from None
        self.admit(sum(args.runs + args.echo for args in groups), "prompt" if len(groups) > 1 else "n")
        why: dict = {}
        watcher = asyncio.create_task(watch(request, cancel, request.state.deadline, why))
        runs = [
            asyncio.create_task(self.group(args, request, decoder, each, cancel, why, streams and streams[k]))
            for k, (args, each) in enumerate(zip(groups, wanted, strict=True))
        ]
        try:
            return decoder, await all_or_none(runs, cancel)
        finally:
            watcher.cancel()

    async def group(
        self,
        args: GenerationArgs,
        request: Request,
        decoder: Decoder,
        wanted: list[GenerationRequest],
        cancel: threading.Event,
        why: dict,
        streams: list[TokenStream] | None,
    ) -> tuple[Echo | None, list[GenerationResult | None]]:
        """One prompt's echo (first: a stream shows the prompt before its answer), then its generations side by
        side on the worker (a batch's rows)."""
        echo = None
        if args.echo:
            try:
                echo = await self.echo(args, decoder, cancel, why)
            except BaseException:
                self.release(len(wanted))  # the places `admit` took for generations that never start
                raise
            for stream in streams or []:
                stream.queue.put_nowait((echo.text, echo))
        runs = [asyncio.create_task(self.generate(args, request, decoder, each, cancel, why)) for each in wanted]
        results = await all_or_none(runs, cancel)
        return echo, (results * args.n if len(results) == 1 else results) or [None] * args.n

    async def echo(self, args: GenerationArgs, decoder: Decoder, cancel: threading.Event, why: dict) -> Echo:
        """The prompt shown before a completion (`echo`), its tokens scored on the worker where logprobs are asked
        (a chunk at a time, the batch's rows stepping between chunks), in a place `admit` took for it."""
        chunk = (self.config.prefill_chunk or None) if decoder.reads_on else None
        keep = decoder.prefixes.scoped(args.cache_salt)  # a scored head read from there; the prompt left there
        pieces = self.worker.run_pieces(lambda: echoed(decoder, args.prompt, args.logprobs, chunk, keep), cancel)
        return await self.on_worker(pieces, "prompt", why)

    async def generate(
        self,
        args: GenerationArgs,
        request: Request,
        decoder: Decoder,
        wanted: GenerationRequest,
        cancel: threading.Event,
        why: dict,
    ) -> GenerationResult:
        """Run one choice's generation on the worker, in a place `admit` took for it."""
        started_s = time.perf_counter()
        batched = isinstance(self.worker, BatchWorker)
        job = row_of(decoder, wanted) if batched else job_of(decoder, wanted, cancel)
        result = await self.on_worker(self.worker.run(job, cancel), "messages" if args.chat else "prompt", why)
        if why.get("reason") == "timeout":
            raise APIError(504, self.timed_out(), kind="timeout")
        if self.worker.closing and cancel.is_set() and "reason" not in why:  # stopped by the shutdown's drain
            raise APIError(503, "the server is shutting down; this request was stopped", kind="server_error")
        self.metrics.observe(request.url.path, decoder.method, result.stats, time.perf_counter() - started_s)
        return result

    async def on_worker(self, work: Awaitable, param: str, why: dict) -> Any:
        """`work` (a job on the worker, in a place `admit` took for it) awaited and its place given back; a
        ValueError (the decoder refused the prompt: over the context, empty, ids outside the vocabulary) is a 400
        naming `param`, a cancellation a 503 or 504, any other failure this request's own 500."""
        try:
            return await work
        except ValueError as error:
            raise APIError(400, str(error), param) from None
        except (Abandoned, ShuttingDown):
            raise self.cancelled(why) from None
        except Exception as error:  # noqa: BLE001 - this request's own failure, answered in OpenAI's shape
            raise failed(error) from None
        finally:
            self.release()

    def admit(self, places: int = 1, param: str = "n") -> None:
        """Take `places` places in the queue (a request's generations and echoes, all or none), or refuse with 429
        (backpressure: a clear "come back later", not minutes of waiting); 400 naming `param` where they could
        never fit (the choices, or the prompts, asked for)."""
        if places > self.config.max_queue:
            queues = self.config.max_queue
            raise APIError(
                400, f"the request needs {places} places (a generation per sampled choice, one per greedy prompt, one "
                f"per echo); this server queues {queues}", param
            )  # fmt: skip
        if self.pending + places > self.config.max_queue:
            self.rejected += 1
            self.metrics.rejected.inc()
            busy = f"the server is busy ({self.pending} requests queued); retry later"
            raise APIError(429, busy, kind="rate_limit_exceeded")
        self.metrics.queue.inc(places)
        self.pending += places

    def release(self, places: int = 1) -> None:
        """Give back `places` places `admit` took (a generation or an echo done, or never started)."""
        self.metrics.queue.dec(places)
        self.pending -= places

    def cancelled(self, why: dict) -> APIError:
        if why.get("reason") == "timeout":
            return APIError(504, self.timed_out(), kind="timeout")
        return APIError(503, "the request was cancelled (client gone or server shutting down)", kind="server_error")

    def timed_out(self) -> str:
        return f"the request took longer than the server's timeout of {self.config.request_timeout_s:g} s"


async def all_or_none(runs: list[asyncio.Task], cancel: threading.Event) -> list:
    """The results of `runs`, in order; where one fails, the others stop at their next step (`cancel`) and are
    awaited, then its error is raised."""
    try:
        return await asyncio.gather(*runs)
    except BaseException:
        cancel.set()
        await asyncio.gather(*runs, return_exceptions=True)
        raise


def job_of(decoder: Decoder, wanted, cancel: threading.Event):
    """The one-at-a-time worker's job: the whole generation."""

    def job() -> GenerationResult:
        if cancel.is_set():  # timed out or gone while queued
            raise Abandoned
        return decoder.generate(wanted)

    return job


def row_of(decoder: Decoder, wanted):
    """Continuous batching: the row this request adds to the running batch (built on the worker's thread)."""
    return lambda: (decoder.prepare(wanted), decoder)


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
