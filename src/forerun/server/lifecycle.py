"""Graceful shutdown that answers every request: uvicorn's server, draining forerun's worker before its deadline.

On SIGTERM uvicorn stops accepting connections, waits `timeout_graceful_shutdown` seconds for the requests in
flight, then cancels their tasks, and only then runs the app's own shutdown. A request still generating at the
deadline was cut: a plain-text 500, a stream ended without an error event. `GracefulServer` starts forerun's drain
`DRAIN_MARGIN_S` before that deadline: every request still running or queued is ended by the worker, so its handler
answers in OpenAI's shape (503; a stream: an error event, then [DONE]) while there is still time to write it. The
app's shutdown (the trie saved) runs after, as before.

Example (what `forerun serve` runs):
    >>> config = uvicorn.Config(app, port=8000, timeout_graceful_shutdown=5, http=guarded_h11())  # doctest: +SKIP
    >>> GracefulServer(config, drain=app.state.worker.shutdown).run()                            # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn

DRAIN_MARGIN_S = 1.5
"""Seconds before uvicorn's graceful-shutdown deadline at which requests still in flight are ended and answered."""


class GracefulServer(uvicorn.Server):
    """uvicorn's server; `drain` (blocking: the worker ends every request it holds) runs in a thread
    `margin_s` before the graceful-shutdown deadline, if requests are still in flight then."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None], margin_s: float = DRAIN_MARGIN_S) -> None:
        super().__init__(config)
        self.drain, self.margin_s = drain, margin_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        grace = self.config.timeout_graceful_shutdown
        timer = None
        if grace is not None:
            timer = loop.call_later(max(0.0, grace - self.margin_s), lambda: loop.run_in_executor(None, self.drain))
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
