"""The worker thread that runs generations on the server's Decoders (`forerun.server.decoders`).

Generation runs in one worker thread, so the event loop keeps answering /health, /metrics and queued clients;
every request carries a cancel event that a disconnect, the request's deadline or shutdown sets, and its generation
stops after the current step.

Two workers: `BatchWorker` (continuous batching: requests join the running batch between steps, up to
`max_batch` rows, and leave when they finish; `forerun.batch.Batch`) and `Worker` (one request at a time, in
arrival order; `--max-batch 1`, and models whose cache cannot hold ragged rows). Both run jobs of pieces too
(`run_pieces`: a prompt scored a chunk a piece), the batch's rows stepping between two pieces.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from forerun.base.static import StaticBase
from forerun.base.static_rows import static_rows
from forerun.batch import Batch
from forerun.batch_join import Joining
from forerun.checks import is_count
from forerun.decoder import Decoder, GenerationResult
from forerun.preparation import Prepared

logger = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The server stops taking requests."""


class Abandoned(Exception):
    """The job's request was cancelled (timeout, disconnect, shutdown) before the worker reached it."""


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

    async def run_pieces(self, start: Pieces, cancel: threading.Event) -> Any:
        """Run a job made of pieces (`Pieces`) after the jobs before it: its return value."""
        return await self.run(lambda: finish(start(), cancel), cancel)

    def shutdown(self) -> None:
        """Cancel every job (running or queued) and wait for the worker to finish its current step."""
        self.closing = True
        for cancel in list(self.cancels):
            cancel.set()
        self.executor.shutdown(wait=True, cancel_futures=True)


def finish(pieces: Iterator, cancel: threading.Event) -> Any:
    """Run `pieces` to its end (its return value), stopping between two pieces once `cancel` is set."""
    while True:
        if cancel.is_set():
            raise Abandoned
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


Pieces = Callable[[], Iterator]
"""Starts a job that runs a piece per `next` and returns its value at the end (`forerun.scoring.scoring`: a
chunk of a prompt each), so a batch's rows step between two pieces."""

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


@dataclass
class Task:
    """A job of pieces waiting for or running on the batch's thread (`BatchWorker.run_pieces`)."""

    start: Pieces
    cancel: threading.Event
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    pieces: Iterator | None = None


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
        self.tasks: deque[Task] = deque()
        """Jobs of pieces (a prompt scored for `echo`), the oldest advanced a piece between two steps."""
        self.wake = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self.loop, name="forerun-batch", daemon=True)
        self.thread.start()

    def counts(self, pending: int) -> tuple[int, int]:
        running = len(self.batch.rows) + len(self.joining)
        return running, max(0, pending - running)

    async def run_pieces(self, start: Pieces, cancel: threading.Event) -> Any:
        """Run a job of pieces on the batch's thread, a piece between two steps of the running rows: its value."""
        return await self.queued(self.tasks, Task, start, cancel)

    async def queued(self, queue: deque, kind: type[Admission] | type[Task], job: Callable, cancel) -> Any:
        """Put `job` (as a `kind`) at the end of `queue` for the batch's thread, and wait for what it settles."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        item = kind(job, cancel, loop.create_future(), loop)
        with self.wake:
            queue.append(item)
            self.wake.notify()
        return await item.future

    def advance(self) -> None:
        """One piece of the oldest job of pieces; a job cancelled meanwhile ends between two pieces."""
        if not self.tasks:
            return
        task = self.tasks[0]
        try:
            if task.cancel.is_set():
                raise Abandoned
            if task.pieces is None:
                task.pieces = task.start()
            next(task.pieces)
        except StopIteration as done:
            self.tasks.popleft()
            self.settle(task, done.value)
        except Exception as error:  # noqa: BLE001 - this job's own failure, answered to its request alone
            self.tasks.popleft()
            self.settle(task, error=error)

    async def run(self, prepare: Prepare, cancel: threading.Event) -> GenerationResult:
        return await self.queued(self.waiting, Admission, prepare, cancel)

    @staticmethod
    def settle(admission: Admission | Task, result: object = None, error: BaseException | None = None) -> None:
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

    def busy(self) -> bool:
        return bool(self.waiting or self.joining or self.batch.rows or self.tasks)

    def loop(self) -> None:
        while True:
            with self.wake:
                while not self.closing and not self.busy():
                    self.wake.wait()
                if self.closing and not self.busy():
                    return
            self.admit()
            self.prefill()
            self.advance()
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
            joining = (admission for _, admission in self.joining)
            for admission in [*self.waiting, *joining, *self.members.values(), *self.tasks]:
                admission.cancel.set()
            self.wake.notify()
        self.thread.join(timeout=60)
