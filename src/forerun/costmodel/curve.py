"""The latency curve: seconds per forward against tokens fed, measured per model, dtype, device, threads and base."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

FLAT_AT_16 = 1.5
"""A latency curve is flat where a 16-token forward costs at most this many 1-token forwards."""


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds per forward against tokens fed in it, measured on one device, dtype and thread count.

    `cost(n)` is the measurement at n, linear between measured sizes, and extrapolated linearly from the last two
    sizes beyond the largest (a prefill of a long prompt plus a tree).

    `batched` optionally holds curves measured with several rows per forward: (rows, curve of seconds against
    tokens per row). A batch does not cost what one row of as many tokens costs: each row reads its own cache and
    attends through its own mask rows (on this CPU, fp32: 8 rows x 2 tokens cost 1.34x one row of 16 tokens).
    `batch_cost` uses them; without them it prices rows x n tokens as one row of rows * n.

    Example (one row: 1 token 10 ms, 2 tokens 15 ms; 2 rows: 12 ms and 24 ms):
        >>> curve = LatencyCurve((1, 2), (0.010, 0.015), ((2, LatencyCurve((1, 2), (0.012, 0.024))),))
        >>> round(curve.batch_cost(2, 2) * 1000, 1), round(curve.batch_cost(3, 1) * 1000, 1)  # 3 rows: beyond 2
        (24.0, 14.0)
        >>> round(LatencyCurve((1, 2, 4), (0.010, 0.015, 0.016)).batch_cost(2, 2) * 1000, 1)  # no rows measured
        16.0
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    batched: tuple[tuple[int, LatencyCurve], ...] = ()

    def __post_init__(self) -> None:
        sizes, seconds = tuple(int(n) for n in self.sizes), tuple(float(s) for s in self.seconds)
        if not sizes or len(sizes) != len(seconds):
            raise ValueError("a latency curve needs as many timings as sizes, and at least one")
        if sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"latency curve sizes must start at 1 and increase, got {list(sizes)}")
        if not all(math.isfinite(s) and s > 0 for s in seconds):
            raise ValueError(f"latency curve timings must be positive seconds, got {list(seconds)}")
        batched = tuple(sorted(((int(rows), curve) for rows, curve in self.batched), key=lambda item: item[0]))
        if any(rows < 2 for rows, _ in batched) or len({rows for rows, _ in batched}) != len(batched):
            raise ValueError(f"batched latency curves need distinct row counts >= 2, got {[r for r, _ in batched]}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "batched", batched)
        # Every whole size up to the largest, looked up: the cost model prices every prefix of every step, and on a
        # GPU's 64-size curve a scan per price was a fifth of `auto`'s host time between forwards.
        object.__setattr__(self, "table", tuple(self.interpolated(n) for n in range(sizes[-1] + 1)))
        object.__setattr__(self, "row_tables", {})  # rows -> the same table for a batch of that many rows

    def cost(self, n: int) -> float:
        """Seconds for a forward of `n` tokens."""
        if type(n) is int and 0 <= n < len(self.table):
            return self.table[n]
        return self.interpolated(n)

    def interpolated(self, n: int) -> float:
        """`cost(n)` worked out from the measured sizes (the module docstring's rule)."""
        sizes, seconds = self.sizes, self.seconds
        if n <= sizes[0]:
            return seconds[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                left, right = sizes[i - 1], sizes[i]
                return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (n - left) / (right - left)
        if len(sizes) == 1:
            return seconds[0] * n
        slope = max(0.0, (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]))
        return seconds[-1] + slope * (n - sizes[-1])

    def batch_cost(self, rows: int, nodes: int) -> float:
        """Seconds for a forward of `rows` rows x `nodes` tokens each: linear in rows between the measured row
        counts (this curve is rows = 1), extrapolated linearly beyond the largest."""
        if rows <= 1:
            return self.cost(nodes)
        if not self.batched:
            return self.cost(rows * nodes)
        table = self.row_tables.get(rows)
        if table is None:  # a batch prices every count of every step at its row count: looked up too
            table = self.row_tables[rows] = tuple(self.rows_cost(rows, n) for n in range(len(self.table)))
        if type(nodes) is int and 0 <= nodes < len(table):
            return table[nodes]
        return self.rows_cost(rows, nodes)

    def rows_cost(self, rows: int, nodes: int) -> float:
        """`batch_cost` of two rows or more on batched curves, worked out from the measured row counts."""
        measured = [(1, self), *self.batched]
        for (low, lower), (high, higher) in zip(measured, measured[1:], strict=False):
            if rows <= high:
                share = (rows - low) / (high - low)
                return lower.cost(nodes) + (higher.cost(nodes) - lower.cost(nodes)) * share
        (low, lower), (high, higher) = measured[-2], measured[-1]
        slope = max(0.0, (higher.cost(nodes) - lower.cost(nodes)) / (high - low))
        return higher.cost(nodes) + slope * (rows - high)

    def relative(self, n: int) -> float:
        """cost(n) / cost(1)."""
        return self.cost(n) / self.seconds[0]

    @property
    def flat(self) -> bool:
        """Whether 16 tokens cost at most `FLAT_AT_16` times one token: drafters may then propose wide trees (the
        cost model still cuts each step's). bf16 on a CPU with native bf16 (1.21x), a GPU; not fp32 on a CPU
        (2.2x) nor bf16 on one without bf16 units (10x).

            >>> LatencyCurve((1, 16), (0.030, 0.036)).flat, LatencyCurve((1, 16), (0.035, 0.080)).flat
            (True, False)
        """
        return self.relative(16) <= FLAT_AT_16

    def default_cap(self, most: float = 3.0) -> int:
        """The largest measured size whose forward costs at most `most` times a 1-token forward."""
        return max(n for n, s in zip(self.sizes, self.seconds, strict=True) if s <= most * self.seconds[0])

    def with_batches(self, batched: Sequence[tuple[int, LatencyCurve]]) -> LatencyCurve:
        """This curve with `batched` row curves (replacing any it had)."""
        return LatencyCurve(self.sizes, self.seconds, tuple(batched))

    def as_dict(self) -> dict:
        data: dict = {"sizes": list(self.sizes), "seconds": list(self.seconds)}
        if self.batched:
            data["batched"] = {str(rows): curve.as_dict() for rows, curve in self.batched}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> LatencyCurve:
        batched = tuple((int(rows), cls.from_dict(curve)) for rows, curve in (data.get("batched") or {}).items())
        return cls(tuple(data["sizes"]), tuple(data["seconds"]), batched)
