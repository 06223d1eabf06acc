"""What an EAGLE-3 head's own forwards cost on this device, by rows: measured once, kept on disk like the target's
latency curve (`forerun.latency`), and what a reproducible budget prices them at.

A head makes two kinds of forward, and each costs what its rows cost on this device, not what its weights weigh:
- a **level** (`project=False`): the drafted nodes of one tree level, each row's draft distribution computed (its
  output matrix over the draft vocabulary, every row);
- a **read** (`project=True`): committed positions through `fc` (3 x the target's hidden size in), only the last
  row's distribution computed.

On a CPU a few rows cost about the bytes of weights read and then grow with the rows (a 4-bit product re-reads
its weights every few rows); on a card a forward's launches or one graph replay cost the same for 1 or 16 rows.
Costs are the fastest of `repeats` rounds, interleaved across sizes, after `context` committed positions.

Example:
    >>> costs = HeadCosts(LatencyCurve((1, 4), (0.001, 0.0014)), LatencyCurve((1, 4), (0.0012, 0.0015)))
    >>> round(costs.cost(4, project=False) * 1000, 2), round(costs.cost(2, project=True) * 1000, 2)
    (1.4, 1.3)
    >>> head_costs(head, topk=8, capture=False, cache_dir=DEFAULT_CACHE_DIR)  # read, or measured and stored
    ...                                                                                       # doctest: +SKIP
    HeadCosts(level=LatencyCurve(sizes=(1, 2, 3, 4, 6, 8, 12, 16, 32), ...), read=LatencyCurve(...))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from forerun.base.weights import weights_kind
from forerun.costmodel import LatencyCurve
from forerun.drafters.eagle3.head import Eagle3Head
from forerun.drafters.eagle3.runner import HeadRunner
from forerun.measured import (
    DEFAULT_CACHE_DIR,
    config_shape,
    device_name,
    read_json,
    settings_digest,
    synchronize,
    write_json,
)

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Rows per forward measured: a level has up to `Eagle3Config.width` rows (4 by default), a read the tokens a step
committed (up to the tree's depth + 1), or what waited while the head sat out (`catch_up`, chunked by 64)."""
CONTEXT = 256
"""Committed positions in the head's slots before each measured forward (as for the target's curve)."""
REPEATS = 5
FORWARDS = 2
"""How the head's forwards are run, part of the stored costs' key: costs stored by an older way are measured
again (2: on a CPU its keys and values in fp32 under a half-precision head, `runner.slots_dtype`)."""

__all__ = ["DEFAULT_CACHE_DIR", "HeadCosts", "costs_path", "head_costs", "measure_head_costs"]


@dataclass(frozen=True)
class HeadCosts:
    """Seconds of a head's forwards by rows: `level` (drafted nodes) and `read` (committed positions)."""

    level: LatencyCurve
    read: LatencyCurve

    def cost(self, rows: int, project: bool) -> float:
        """Seconds of one forward of `rows` rows: a read of committed positions (`project`) or a level."""
        return (self.read if project else self.level).cost(rows)

    def as_dict(self) -> dict:
        return {"level": self.level.as_dict(), "read": self.read.as_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> HeadCosts:
        return cls(LatencyCurve.from_dict(data["level"]), LatencyCurve.from_dict(data["read"]))


def costs_settings(head: Eagle3Head, topk: int, capture: bool) -> dict[str, object]:
    """What the costs depend on: the head's sizes, dtype and weights, the device, threads, torch, captured or not."""
    weight = head.fc.weight
    return {
        "head": config_shape(head.config),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "weights": weights_kind(head) or "dense",
        "device": device_name(weight.device),
        "threads": torch.get_num_threads() if weight.device.type == "cpu" else None,
        "torch": torch.__version__,
        "topk": min(topk, head.config.draft_vocab_size),  # as the runner draws them
        "captured": capture and weight.device.type == "cuda",
        "sizes": list(SIZES),
        "forwards": FORWARDS,
    }


def costs_path(head: Eagle3Head, topk: int, capture: bool, cache_dir: Path | str = DEFAULT_CACHE_DIR) -> Path:
    settings = costs_settings(head, topk, capture)
    threads = f"-t{settings['threads']}" if settings["threads"] else ""
    name = f"eagle3-head-{settings['dtype']}-{settings['weights']}{threads}-{settings_digest(settings)}.json"
    return Path(cache_dir).expanduser() / "latency" / name


def head_costs(
    head: Eagle3Head,
    topk: int,
    capture: bool,
    cache_dir: Path | str | None = DEFAULT_CACHE_DIR,
    again: bool = False,
) -> HeadCosts:
    """The head's costs on this device: read from `cache_dir`, else (or with `again`) measured now (a second or
    so) and stored there; `cache_dir=None` measures without reading or writing any file."""
    if cache_dir is None:
        return measure_head_costs(head, topk, capture)
    path = costs_path(head, topk, capture, cache_dir)
    data = None if again else read_json(path)
    try:
        return HeadCosts.from_dict(data["costs"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError, AttributeError):
        pass  # missing or unreadable: measured again
    costs = measure_head_costs(head, topk, capture)
    try:
        write_json(path, {"settings": costs_settings(head, topk, capture), "costs": costs.as_dict()})
    except OSError:
        pass  # a read-only home: the costs still serve this process
    return costs


@torch.inference_mode()
def measure_head_costs(
    head: Eagle3Head,
    topk: int,
    capture: bool,
    sizes: Sequence[int] = SIZES,
    context: int = CONTEXT,
    repeats: int = REPEATS,
) -> HeadCosts:
    """Time the head's forwards as a drafter runs them (its own runner: slots, and graphs where `capture` on a
    card), `context` committed positions in its slots; per size the fastest of `repeats` rounds after a warm-up
    round, sizes interleaved."""
    if not sizes or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError("sizes must be >= 1, context >= 1 and repeats >= 1")
    sizes = sorted(set(int(n) for n in sizes) | {1})
    runner = HeadRunner(head, topk, capture)
    runner.reserve(0, context + max(sizes))
    device, dtype = runner.device, runner.dtype
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(context, head.fc.in_features, generator=generator).to(device, dtype)
    slots = list(range(context))
    runner.read([0] * context, slots, slots, [(slot + 1, []) for slot in slots], features, True, True)
    kinds = {
        False: lambda n: runner.read([0] * n, [context] * n, list(range(context, context + n)),
                                     [(context, [context + i]) for i in range(n)],
                                     torch.zeros(n, head.config.hidden_size, dtype=dtype, device=device), False),
        True: lambda n: runner.read([0] * n, list(range(context, context + n)), list(range(context, context + n)),
                                    [(context + i + 1, []) for i in range(n)], features[:n], True, True),
    }  # fmt: skip
    samples: dict[tuple[bool, int], list[float]] = {(kind, n): [] for kind in kinds for n in sizes}
    for _ in range(repeats + 1):  # the first round warms up (and captures) and is dropped
        for (kind, n), times in samples.items():
            synchronize(device)
            started = time.perf_counter()
            kinds[kind](n)
            synchronize(device)
            times.append(time.perf_counter() - started)
    curves = {kind: LatencyCurve(tuple(sizes), tuple(min(samples[kind, n][1:]) for n in sizes)) for kind in kinds}
    return HeadCosts(level=curves[False], read=curves[True])
