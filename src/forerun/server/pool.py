"""The server's Decoders, and the one worker thread that runs generations on them, in arrival order.

Decoders are shared by all requests of one method (its trie, n-gram pool and cost-model calibration learn across
requests); a request with knobs of its own gets a private Decoder, kept in a small LRU so a flood of distinct knob
sets cannot grow memory. Generation runs in a single worker thread (a CPU runs one forward at a time), so the
event loop keeps answering /health, /metrics and queued clients; every job carries a cancel event that a
disconnect, the request's deadline or shutdown sets, and the job stops after its current step.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from forerun.decoder import Decoder
from forerun.methods import plan_method

PRIVATE_DECODERS = 8


class Abandoned(Exception):
    """The job's request was cancelled (timeout, disconnect, shutdown) before the worker reached it."""


class DecoderPool:
    def __init__(self, model, tokenizer, method: str, knobs: dict, draft_model=None) -> None:
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.method, self.knobs = method, dict(knobs)
        self.shared: dict[str, Decoder] = {}
        self.private: OrderedDict[tuple, Decoder] = OrderedDict()
        self.lock = threading.Lock()

    def build(self, method: str, knobs: dict) -> Decoder:
        plan = plan_method(method, knobs, next(self.model.parameters()).device.type)
        draft = {}
        if plan.needs_draft():
            if self.draft_model is None:
                raise ValueError("method draft_model needs a draft model: start the server with --draft-model NAME")
            draft = {"draft_model": self.draft_model}
        return Decoder(self.model, self.tokenizer, method, **draft, **knobs)

    def get(self, method: str, knobs: dict) -> Decoder:
        """The shared Decoder of `method` (with the server's knobs for its own method), or a private one."""
        with self.lock:
            if not knobs or (method == self.method and knobs == self.knobs):
                if method not in self.shared:
                    self.shared[method] = self.build(method, self.knobs if method == self.method else {})
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
        if "trie" not in plan_method(self.method, self.knobs).names:
            return None
        return self.get(self.method, {})


class Worker:
    """Runs jobs one at a time, first come first served; tracks their cancel events."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forerun-generate")
        self.cancels: set[threading.Event] = set()
        self.closing = False

    async def run(self, job: Callable[[], Any], cancel: threading.Event) -> Any:
        if self.closing:
            raise RuntimeError("the server is shutting down")
        self.cancels.add(cancel)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, job)
        finally:
            self.cancels.discard(cancel)

    def shutdown(self) -> None:
        """Cancel every job (running or queued) and wait for the worker to finish its current step."""
        self.closing = True
        for cancel in list(self.cancels):
            cancel.set()
        self.executor.shutdown(wait=True, cancel_futures=True)
