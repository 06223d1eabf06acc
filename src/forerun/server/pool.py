"""The server's Decoders, and the worker thread that runs generations on them.

Decoders are shared by all requests of one method (its trie, n-gram pool and cost-model calibration learn across
requests); a request with knobs of its own gets a private Decoder, kept in a small LRU so a flood of distinct knob
sets cannot grow memory. Generation runs in one worker thread, so the event loop keeps answering /health, /metrics
and queued clients; every request carries a cancel event that a disconnect, the request's deadline or shutdown
sets, and its generation stops after the current step.

Two workers: `BatchWorker` (continuous batching: requests join the running batch between steps, up to
`max_batch` rows, and leave when they finish; `forerun.batch.Batch`) and `Worker` (one request at a time, in
arrival order; `--max-batch 1`, and models whose cache cannot hold ragged rows).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from forerun.base.static import StaticBase
from forerun.base.static_rows import static_rows
from forerun.batch import Batch
from forerun.batch_join import Joining
from forerun.checks import is_count
from forerun.decoder import Decoder, GenerationResult
from forerun.drafters.eagle3 import load_head
from forerun.methods import plan_method
from forerun.prefixcache import PrefixCache
from forerun.preparation import Prepared

logger = logging.getLogger(__name__)

PRIVATE_DECODERS = 8


class ShuttingDown(RuntimeError):
    """The server stops taking requests."""


class Abandoned(Exception):
    """The job's request was cancelled (timeout, disconnect, shutdown) before the worker reached it."""


class DecoderPool:
    def __init__(
        self,
        model,
        tokenizer,
        method: str,
        knobs: dict,
        draft_model=None,
        prefixes=None,
        max_tree_nodes=None,
        draft_head: str | None = None,
        compile_buckets: bool = False,
    ) -> None:
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.compile_buckets = compile_buckets
        """The server's own Decoder (its method and knobs) compiles its tree sizes before capturing them (a CUDA
        device's), in the warm-up. One a request asks for (another method, other knobs) does not: compiling in a
        request's time would hold every stream for minutes."""
        self.head = None if draft_head is None else load_head(draft_head, model)
        """The EAGLE-3 head, read once and shared by every Decoder that drafts with it."""
        self.max_tree_nodes = max_tree_nodes
        """The operator's cap on tokens per forward, for every Decoder of the server (None: the curve's)."""
        self.prefixes = prefixes if prefixes is not None else PrefixCache(0)
        """One prefix cache for every Decoder: the KV of a text is the model's, whichever method drafts."""
        self.method, self.knobs = method, dict(knobs)
        self.shared: dict[str, Decoder] = {}
        self.private: OrderedDict[tuple, Decoder] = OrderedDict()
        self.lock = threading.Lock()

    def build(self, method: str, knobs: dict, compiled: bool = False) -> Decoder:
        plan = plan_method(method, knobs, next(self.model.parameters()).device.type, head=self.head is not None)
        draft = {}
        if plan.needs_draft():
            if self.draft_model is None:
                raise ValueError("method draft_model needs a draft model: start the server with --draft-model NAME")
            draft = {"draft_model": self.draft_model}
        if plan.uses_head():
            if self.head is None:
                raise ValueError("method eagle3 needs an EAGLE-3 head: start the server with --draft-head FOLDER")
            draft["draft_head"] = self.head
        return Decoder(
            self.model, self.tokenizer, method, prefix_cache=self.prefixes, max_tree_nodes=self.max_tree_nodes,
            compile_buckets=compiled, **draft, **knobs
        )  # fmt: skip

    def get(self, method: str, knobs: dict) -> Decoder:
        """The shared Decoder of `method` (with the server's knobs for its own method), or a private one."""
        with self.lock:
            if not knobs or (method == self.method and knobs == self.knobs):
                if method not in self.shared:
                    own = method == self.method
                    self.shared[method] = self.build(method, self.knobs if own else {}, own and self.compile_buckets)
                return self.shared[method]
            key = (method, tuple(sorted((k, repr(v)) for k, v in knobs.items())))
            if key not in self.private:
                self.private[key] = self.build(method, knobs)
                while len(self.private) > PRIVATE_DECODERS:
                    self.private.popitem(last=False)
            self.private.move_to_end(key)
            return self.private[key]

    def trie_decoder(self) -> Decoder | None:
        """The shared Decoder whose trie the cache file holds (the server's own method, if it has a trie)."""
        if not plan_method(self.method, self.knobs, head=self.head is not None).saves_state():
            return None
        return self.get(self.method, {})


class Worker:
    """Runs jobs one at a time, first come first served; tracks their cancel events."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forerun-generate")
        self.cancels: set[threading.Event] = set()
        self.closing = False

    def counts(self, pending: int) -> tuple[int, int]:
        """(running, queued) out of `pending` requests."""
        running = min(1, pending)
        return running, pending - running

    async def run(self, job: Callable[[], Any], cancel: threading.Event) -> Any:
        """Run `job` on the worker thread after the jobs before it. A request cancelled while it waits (its
        client gone, its deadline passed) leaves the queue at once (within WITHDRAW_POLL_S), not when its turn
        comes: dead requests must not hold places of `--max-queue` (the job, when its turn comes, sees the cancel
        and does nothing)."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        self.cancels.add(cancel)
        started = threading.Event()

        def guarded() -> Any:
            started.set()
            return job()

        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, guarded)
            while True:
                done, _ = await asyncio.wait({future}, timeout=WITHDRAW_POLL_S)
                if done:
                    return future.result()
                if cancel.is_set() and not started.is_set():
                    raise Abandoned
        finally:
            self.cancels.discard(cancel)

    def shutdown(self) -> None:
        """Cancel every job (running or queued) and wait for the worker to finish its current step."""
        self.closing = True
        for cancel in list(self.cancels):
            cancel.set()
        self.executor.shutdown(wait=True, cancel_futures=True)


Prepare = Callable[[], tuple[Prepared, Decoder]]
"""Builds a request's row (encode, checks, processors) on the worker thread; a ValueError is the client's fault."""


@dataclass
class Admission:
    prepare: Prepare
    cancel: threading.Event
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    prepared: Prepared | None = None
    decoder: Decoder | None = None


WITHDRAW_POLL_S = 0.1
"""How often a request waiting for the one-at-a-time worker checks whether it was cancelled."""

DEFAULT_PREFILL_CHUNK = 256
"""Prompt tokens a joining request feeds between two steps of the running rows (about a second of a 1-thread
fp32 CPU forward of SmolLM2-135M): a long prompt delays the other streams by a chunk at a time, not by its whole
prefill."""


class BatchWorker:
    """Continuous batching: one thread steps a `Batch`; waiting requests join it between steps (at most
    `max_batch` rows), finished and cancelled rows leave, each request's future gets its GenerationResult.

    A joining prompt longer than `prefill_chunk` tokens is fed in chunks, one chunk between two steps of the
    running rows (0: every prompt in one forward, the running rows waiting for it)."""

    def __init__(
        self, model, budget, max_batch: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, base: StaticBase | None = None
    ) -> None:
        """`base`: a static base (a GPU's); the batch's rows then take places of its sibling (`StaticRows`)."""
        if not is_count(prefill_chunk):
            raise ValueError(f"prefill_chunk must be a whole number of tokens >= 0 (0: off), got {prefill_chunk!r}")
        self.model, self.budget, self.max_batch = model, budget, max_batch
        self.prefill_chunk = prefill_chunk or None
        # the rows take places of the static base's sibling, where there is one
        self.batch = Batch(model, budget, shared=static_rows(base, max_batch, 1))
        self.waiting: deque[Admission] = deque()
        self.joining: list[tuple[Joining, Admission]] = []
        """Requests whose prompts are being fed; the one with the least left to feed goes first."""
        self.members: dict[int, Admission] = {}
        self.wake = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self.loop, name="forerun-batch", daemon=True)
        self.thread.start()

    def counts(self, pending: int) -> tuple[int, int]:
        running = len(self.batch.rows) + len(self.joining)
        return running, max(0, pending - running)

    async def run(self, prepare: Prepare, cancel: threading.Event) -> GenerationResult:
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        admission = Admission(prepare, cancel, loop.create_future(), loop)
        with self.wake:
            self.waiting.append(admission)
            self.wake.notify()
        return await admission.future

    @staticmethod
    def settle(admission: Admission, result: object = None, error: BaseException | None = None) -> None:
        def done() -> None:
            if admission.future.done():
                return
            if error is not None:
                admission.future.set_exception(error)
            else:
                admission.future.set_result(result)

        admission.loop.call_soon_threadsafe(done)

    def admit(self) -> None:
        """Move waiting requests into the batch while there is room: each begins its prefill here (`prefill`
        feeds it). Requests cancelled while they wait (client gone, deadline passed) leave the queue first, at every
        step, whether or not there is room: dead requests must not hold places of `--max-queue`."""
        with self.wake:  # one pass: a request cancelled in between must be either settled here or still waiting
            gone = [admission for admission in self.waiting if admission.cancel.is_set()]
            for admission in gone:
                self.waiting.remove(admission)
        for admission in gone:
            self.settle(admission, error=Abandoned())
        while True:
            with self.wake:
                if not self.waiting or len(self.batch.rows) + len(self.joining) >= self.max_batch:
                    return
                admission = self.waiting.popleft()
            if admission.cancel.is_set():  # timed out or gone while waiting
                self.settle(admission, error=Abandoned())
                continue
            try:
                admission.prepared, admission.decoder = admission.prepare()
                joining = self.batch.begin(admission.prepared.job, admission.decoder.batch_budget())
            except Exception as error:  # a ValueError is the client's (400); anything else fails this request only
                self.settle(admission, error=error)
                continue
            self.joining.append((joining, admission))

    def prefill(self) -> None:
        """Feed one joining request (the one with the least prompt left: a short prompt need not wait for a long
        one's whole prefill) a chunk of its prompt, or the rest of it and its first token (it then joins the batch);
        a request gone meanwhile is dropped between chunks. Where the rows' cache feeds side by side (a static
        base's places), every request whose rest fits in a chunk joins in the same forwards (a burst of requests
        costs a card about one prefill's forwards, not one per request)."""
        if not self.joining:
            return
        place = min(range(len(self.joining)), key=lambda i: self.joining[i][0].left)
        joining, admission = self.joining[place]  # stays listed while fed: shutdown must find its cancel event
        if admission.cancel.is_set():
            del self.joining[place]
            self.batch.abandon(joining)
            self.settle(admission, error=Abandoned())
            return
        if self.batch.shared.side_by_side and self.fits(joining):
            group = [(j, a) for j, a in self.joining if self.fits(j) and not a.cancel.is_set()]
            if len(group) > 1:
                self.prefill_together(group)
                return
        with self.wake:  # a lone row drafts at its prefill too
            alone = not self.batch.rows and len(self.joining) == 1 and not self.waiting
        try:
            row = self.batch.feed(joining, self.prefill_chunk, draft=alone)
        except Exception as error:  # fails this request only
            del self.joining[place]
            self.batch.abandon(joining)
            self.settle(admission, error=error)
            return
        if row is not None:
            del self.joining[place]
            self.members[id(row)] = admission

    def fits(self, joining: Joining) -> bool:
        """Whether the rest of a joining request's prompt goes in its next feed (no chunk of it left over)."""
        return self.prefill_chunk is None or joining.left - 1 <= self.prefill_chunk

    def prefill_together(self, group: list[tuple[Joining, Admission]]) -> None:
        """Feed the rest of every request of `group` in the same forwards; a request whose row fails is failed
        alone (a failed forward fails the group, as a failed step fails its rows)."""
        try:
            outcomes = self.batch.feed_apart([joining for joining, _ in group], draft=False)
        except Exception as error:  # noqa: BLE001
            outcomes = [error] * len(group)
        fed = {id(joining) for joining, _ in group}
        self.joining = [(j, a) for j, a in self.joining if id(j) not in fed]
        for (joining, admission), outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self.batch.abandon(joining)
                self.settle(admission, error=outcome)
            else:
                self.members[id(outcome)] = admission

    def loop(self) -> None:
        while True:
            with self.wake:
                while not self.closing and not self.waiting and not self.joining and not self.batch.rows:
                    self.wake.wait()
                if self.closing and not self.waiting and not self.joining and not self.batch.rows:
                    return
            self.admit()
            self.prefill()
            if not self.batch.rows:
                continue
            try:
                finished = self.batch.step()
            except Exception as error:  # never leave a client hanging: fail the batch's rows, start afresh
                logger.exception("forerun: a batch step failed; its %d requests get an error", len(self.batch.rows))
                for row in self.batch.rows:
                    self.settle(self.members.pop(id(row)), error=error)
                self.batch.learn()  # what rows that had left put off (their drafters' finishing): never lost
                # the requests still joining keep what they fed (their own caches, or their places)
                self.batch = Batch(self.model, self.budget, shared=self.batch.shared.without_rows())
                continue
            for row in finished:
                admission = self.members.pop(id(row))
                if row.error is not None:  # its own drafters, budget or verification failed: only it ends
                    self.settle(admission, error=row.error)  # logged where it is answered (server.errors.failed)
                    continue
                self.settle(admission, admission.decoder.result(admission.prepared, row.stats))

    def shutdown(self) -> None:
        """Cancel every request (running or waiting) and wait for the worker to finish its current step."""
        self.closing = True
        with self.wake:
            for admission in [*self.waiting, *(admission for _, admission in self.joining), *self.members.values()]:
                admission.cancel.set()
            self.wake.notify()
        self.thread.join(timeout=60)
