"""State learned from requests, kept apart by tenant (`cache_salt`).

A trie or an n-gram pool that learns from every answer drafts one tenant's text for another, and its speed shows
it (tenant B sending tenant A's prompt was drafted at 4 tokens a forward against 1.3 for a fresh prompt). Requests
without a salt share one state, as before; each salt gets its own, smaller one, and at most `MAX_TENANTS` salts are
kept (the least recently used is dropped first, so memory stays bounded however many salts clients invent).

Example:
    >>> state = TenantState(["shared"], lambda: [])
    >>> state.get("").append("x"); state.get("a").append("y")
    >>> state.get(""), state.get("a"), state.get("b")
    (['shared', 'x'], ['y'], [])
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
MAX_TENANTS = 64
"""Salts whose learned state is kept at once (each bounded by its own budget)."""


class TenantState(Generic[T]):
    """The unsalted `shared` state, and one made by `make` per salt (least recently used dropped past `limit`)."""

    def __init__(self, shared: T, make: Callable[[], T], limit: int = MAX_TENANTS) -> None:
        self.shared, self.make, self.limit = shared, make, limit
        self.salted: OrderedDict[str, T] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, salt: str) -> T:
        if not salt:
            return self.shared
        with self.lock:
            state = self.salted.get(salt)
            if state is None:
                state = self.salted[salt] = self.make()
                while len(self.salted) > self.limit:
                    self.salted.popitem(last=False)
            else:
                self.salted.move_to_end(salt)
            return state
