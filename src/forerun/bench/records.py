"""One benchmark run's results (`Record`, one per prompt and method), read back from results.json, and judged.

A greedy run is judged against plain `model.generate` (`REFERENCE`): identical, or in low precision first different
at a numerical tie (`forerun.exactness.TIE_ULPS`); anything else is a mismatch. `NOISE_FLOOR` is plain generate
against itself in a batch of two: its own flips are printed as notes, not mismatches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from forerun.bench.peers import PEER_METHODS
from forerun.exactness import TIE_ULPS

REFERENCE = "generate"
NOISE_FLOOR = "generate[batch=2]"


@dataclass
class Record:
    """One (prompt, method) run."""

    prompt_id: str
    dataset: str
    method: str
    new_tokens: int
    seconds: float
    identical: bool | None
    """Token-for-token equal to the reference; None for sampled runs."""
    forwards: int | None = None
    tokens_per_forward: float | None = None
    acceptance: float | None = None
    draft_share: float | None = None
    accepted_hist: dict = field(default_factory=dict)
    speedup: float | None = None
    """This run's tokens/s over the reference's, same prompt, same process (greedy: reference s / this run's s)."""
    tie_ulps: float | None = None
    """Low precision, greedy, not identical: the reference's logit margin at the first difference, in units in the
    last place (a tie when <= forerun.exactness.TIE_ULPS)."""
    mean_fed: float | None = None
    """Tokens fed per forward, on average."""
    single_token_share: float | None = None
    """Share of forwards that fed the root alone."""
    tie_reading: str | None = None
    """Where `tie_ulps` is more than a tie: "one forward" or "in company" when that reading of the same text calls
    the difference one (`forerun.exactness.tie_reading`: a mixture of experts' router tie, say); else None."""


def load_records(path: Path) -> list[Record]:
    """The records of a results.json (ours, or one written in our format by benchmarks/run_lade.py)."""
    if not path.is_file():
        raise FileNotFoundError(f"records file not found: {path}")
    try:
        rows = json.loads(path.read_text())["records"]
        return [Record(**row) for row in rows]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a benchmark results file ({error})") from None


def mismatch_lines(records: Sequence[Record]) -> list[str]:
    """One line per greedy run that differs from plain model.generate other than at a numerical tie (low
    precision only); sampled runs are not compared."""
    lines = []
    for r in records:
        # generate against itself, or another runtime: reported (`noise_floor_lines`, the tables), not forerun's
        if r.method == NOISE_FLOOR or r.method.split("[")[0] in PEER_METHODS:
            continue
        if beyond_tie(r):
            where = "" if r.tie_ulps is None else f" at a margin of {r.tie_ulps:.1f} ulp (more than a tie)"
            lines.append(f"{r.method} on {r.prompt_id} differs from model.generate{where}")
    return lines


def noise_floor_lines(records: Sequence[Record]) -> list[str]:
    """One line per prompt where plain generate in a batch of two differs from itself alone by more than a tie:
    the model's own rounding reaches past `TIE_ULPS` there, so a forerun run's difference of that size is noise."""
    return [
        f"{NOISE_FLOOR} on {r.prompt_id} differs from model.generate alone"
        + ("" if r.tie_ulps is None else f" at a margin of {r.tie_ulps:.1f} ulp")
        for r in records
        if r.method == NOISE_FLOOR and beyond_tie(r)
    ]


def beyond_tie(record: Record) -> bool:
    """A greedy run that differs from plain generate other than at a numerical tie (fp32: any difference)."""
    if record.identical is not False:
        return False
    return record.tie_ulps is None or (record.tie_ulps > TIE_ULPS and record.tie_reading is None)
