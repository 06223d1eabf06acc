"""The HTTP protocol `forerun serve` runs under uvicorn: h11, with a deadline for request heads and a cap on
open connections.

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends nothing, or begins a
request head and sends it a byte at a time (slowloris), holds its connection, and a file descriptor, for as long as
it likes. Measured here before this class (2026-11-25): ~22,000 such connections from two processes used up the
server's 20,000 descriptors, accept() failed with "Too many open files", and live clients' connections timed out
until the attack stopped. With it, a head must be complete within `HEAD_TIMEOUT_S` of the connection's opening
(a later head on a kept-alive connection: of its first byte; an idle kept-alive connection is closed by uvicorn's
own keep-alive timeout), and connections beyond `max_connections()` are closed as they arrive: an attack costs
live clients refused connections at worst (an error, not a hang), and the server keeps descriptors for its own
files. A slow body is the Guard middleware's (`ServerConfig.body_timeout_s`).

For a server exposed beyond one machine, a reverse proxy (nginx, Caddy) in front still does this better: per-client
limits, TLS.

Example (`forerun serve` does this; tests pass a quicker guard):
    >>> uvicorn.run(app, host="127.0.0.1", port=8000, http=guarded_h11())          # doctest: +SKIP
    >>> uvicorn.Config(app, http=guarded_h11(ConnectionGuard(head_timeout_s=1, cap=20)))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0
"""Seconds from a connection's opening (or a later head's first byte) to the end of the head; a real client sends
its head in one write."""
RESERVED_DESCRIPTORS = 256
"""File descriptors kept for the server's own use (model files, the trie cache, logs) below the process limit."""
MOST_CONNECTIONS = 4096
"""The cap on open connections where the process may open more descriptors than this."""
WARN_EVERY_S = 30.0
"""At most one warning per this many seconds about connections closed (an attack must not flood the log too)."""

logger = logging.getLogger("forerun.server")


def max_connections() -> int:
    """Open connections the server accepts: the process's descriptor limit less RESERVED_DESCRIPTORS, at most
    MOST_CONNECTIONS (ulimit -n 1024 -> 768; 20000 -> 4096)."""
    try:
        import resource
    except ImportError:  # not on Unix: no descriptor limit to read
        return MOST_CONNECTIONS
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MOST_CONNECTIONS
    return max(16, min(MOST_CONNECTIONS, soft - RESERVED_DESCRIPTORS))


@dataclass
class ConnectionGuard:
    """One server's connection limits, and its count of connections closed by them (logged at most every
    WARN_EVERY_S: per connection, a flood of them would flood the log)."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    cap: int = field(default_factory=max_connections)
    closed: dict[str, int] = field(default_factory=lambda: {"over the cap": 0, "head overdue": 0})
    warned_at: float = float("-inf")

    def close(self, transport: asyncio.BaseTransport, why: str) -> None:
        transport.close()
        self.closed[why] += 1
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
            counts = ", ".join(f"{n} {reason}" for reason, n in self.closed.items() if n)
            logger.warning("forerun: connections closed (cap %d, head deadline %g s): %s so far", self.cap,
                           self.head_timeout_s, counts)  # fmt: skip


def guarded_h11(guard: ConnectionGuard | None = None) -> Callable[..., GuardedH11]:
    """The protocol factory for uvicorn's `http=`: GuardedH11 bound to one server's ConnectionGuard."""
    return functools.partial(GuardedH11, guard=guard or ConnectionGuard())


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline per request head and a cap on open connections (module docstring)."""

    def __init__(self, *args, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.head_began: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guard.cap:
            self.guard.close(transport, "over the cap")
            return
        self.await_head()  # a connection that never sends a byte must not stay open either

    def await_head(self) -> None:
        self.head_began = began = self.loop.time()
        self.loop.call_later(self.guard.head_timeout_s, self.head_overdue, began)

    def data_received(self, data: bytes) -> None:
        if self.head_began is None and self.conn.their_state is h11.IDLE:  # the first bytes of the next head
            self.await_head()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete (or the connection failed)
            self.head_began = None

    def head_overdue(self, began: float) -> None:
        if self.head_began == began and not self.transport.is_closing():
            self.guard.close(self.transport, "head overdue")
