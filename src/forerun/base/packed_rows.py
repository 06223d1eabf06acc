"""How many rows a laid-out layer computes for a product of a few rows: as many as it is asked, or more where this
CPU computes more for less.

oneDNN picks its kernel for a laid-out matrix by the number of rows it multiplies, and on some CPUs the kernels for
one or two rows stream the weights more slowly than those for three or four: on an AVX-512 EPYC in fp32 (1 thread,
SmolLM2-135M's 211 layers, weights read from memory as in a forward) 1 row took ~40 ms, 2 rows ~48 and 4 rows
~33 (docs/benchmarks.md). A product of m rows there is computed as one of `rows[m]` rows, the extra rows zero, and
its first m rows kept: each output row is the same dot products of its own input row, whatever rows sit beside it,
so the numbers are the kernel's for `rows[m]` rows. Plain generate of a model loaded this way runs the same layers,
so forerun's text is still compared with the same model's.

The table is measured once per layer shapes, dtype, device, thread count and torch version (a second or two: every
laid-out layer of the model in turn, at 1 to `MOST_ROWS` rows) and kept under `~/.cache/forerun/packed-rows/`.

Example (1 row measured dearer than 4, 2 rows dearer than 3; 5 rows no cheaper than 6 by enough):
    >>> fastest_rows({1: 0.040, 2: 0.048, 3: 0.034, 4: 0.033, 5: 0.036, 6: 0.035, 7: 0.05, 8: 0.06})
    (0, 4, 4, 3, 4, 5, 6, 7, 8)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch

from forerun.measured import DEFAULT_CACHE_DIR, fastest, kept_answer, layers_measured

MOST_ROWS = 8
"""Products of up to this many rows may be computed as more rows (up to this many)."""
MARGIN = 0.9
"""More rows are computed only where they measured at most this share of the rows asked for: a tie keeps the
kernel the product would have had."""
VERSION = 1


def fastest_rows(seconds: Mapping[int, float]) -> tuple[int, ...]:
    """Per row count m (index m; index 0 unused): the row count m' >= m with the least measured time, where that is
    at most `MARGIN` of m's own, else m. `seconds`: measured time per row count 1..n."""
    most = max(seconds)
    table = [0]
    for m in range(1, most + 1):
        best = min(range(m, most + 1), key=lambda n: (seconds[n], n))
        table.append(best if seconds[best] <= MARGIN * seconds[m] else m)
    return tuple(table)


@torch.inference_mode()
def time_rows(
    layers: list[torch.nn.Module], pairs: list[tuple[int, int]], repeats: int = 3
) -> dict[tuple[int, int], float]:
    """Seconds of one pass through every layer of `layers` per (m, n) of `pairs`: m rows computed as n (each layer
    fed its own input, one after another as a forward feeds them, so the weights come from memory, not from a cache
    that held them a moment before; the zero rows' cost included). The fastest of `repeats` interleaved rounds
    after a warm-up round."""
    weight = layers[0].weight
    inputs = {
        (m, width): torch.randn(m, width, generator=torch.Generator().manual_seed(m)).to(weight.dtype)
        for m in {m for m, _ in pairs}
        for width in {layer.in_features for layer in layers}
    }

    def seconds_of(pair: tuple[int, int]) -> float:
        m, n = pair
        started = time.perf_counter()
        for layer in layers:
            layer.product(inputs[m, layer.in_features], n)
        return time.perf_counter() - started

    what = f"timing {len(layers)} layers' products of 1-{MOST_ROWS} rows (once per machine and threads)"
    return fastest(pairs, seconds_of, repeats, what)


def measure_table(layers: list[torch.nn.Module]) -> tuple[tuple[int, ...], dict[int, float], dict[int, float]]:
    """The row table for `layers`, the seconds per row count as asked, and those of each count computed as the
    table's choice: the choice from the products alone (`fastest_rows`), then kept only where, zero rows included,
    it measured at most `MARGIN` of the count as asked."""
    plain = {m: s for (m, _), s in time_rows(layers, [(m, m) for m in range(1, MOST_ROWS + 1)]).items()}
    chosen = fastest_rows(plain)
    padded = time_rows(
        layers, [pair for m in range(1, MOST_ROWS + 1) for pair in ((m, m), (m, chosen[m])) if chosen[m] != m]
    )
    as_chosen = {m: padded[m, n] for m, n in enumerate(chosen) if m and n != m}
    table = tuple(n if m == 0 or n == m or as_chosen[m] <= MARGIN * padded[m, m] else m for m, n in enumerate(chosen))
    return table, plain, as_chosen


def rows_for(layers: list[torch.nn.Module], cache_dir: Path | str | None = DEFAULT_CACHE_DIR) -> tuple[int, ...]:
    """The row table (`fastest_rows`) for these laid-out `layers`: read from `cache_dir`, else measured now and
    stored there (None: measured, nothing read or written)."""
    shapes = [[layer.out_features, layer.in_features] for layer in layers]
    settings, path = layers_measured("packed-rows", layers[0].weight, shapes, VERSION, cache_dir)

    def measure() -> tuple[list[int], dict]:
        table, plain, as_chosen = measure_table(layers)
        ms = {"ms": {m: s * 1e3 for m, s in plain.items()}, "ms_as_more": {m: s * 1e3 for m, s in as_chosen.items()}}
        return list(table), ms

    return tuple(kept_answer(path, settings, "rows", valid, measure))


def valid(table: object) -> bool:
    """Whether `table` is a row table: index 0 is 0, and each m maps to m..MOST_ROWS (a damaged file is measured
    again)."""
    return (
        isinstance(table, list)
        and len(table) == MOST_ROWS + 1
        and all(type(n) is int for n in table)
        and table[0] == 0
        and all(m <= n <= MOST_ROWS for m, n in enumerate(table) if m)
    )
