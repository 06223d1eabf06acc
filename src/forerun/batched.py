"""Many prompts through one `forerun.batch.Batch`: `decode_rows` (at most `width` rows at once, a finished row's
place going to the next waiting prompt: continuous batching, as the server's) and `decode_batch` (all of them, the
stats in order). `Decoder.generate([...])`, `forerun run` and transformers' `custom_generate` decode lists here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import torch

from forerun.base.static_rows import static_rows
from forerun.batch import Batch, batchable
from forerun.costmodel import Budget
from forerun.engine import decode
from forerun.row import RowJob
from forerun.stats import GenerationStats


def decode_batch(
    model: torch.nn.Module,
    jobs: Sequence[RowJob],
    budget: Budget,
    width: int | None = None,
    together: bool | None = None,
) -> list[GenerationStats]:
    """Decode every job; tokens land in each job's transcript, per-row stats are returned in job order.

    `width`: at most this many rows at once (default: all); `together`: see `decode_rows`.
    """
    stats: list[GenerationStats | None] = [None] * len(jobs)
    for index, row_stats in decode_rows(model, jobs, budget, width, together=together):
        stats[index] = row_stats
    return stats  # type: ignore[return-value]


def decode_rows(
    model: torch.nn.Module,
    jobs: Sequence[RowJob],
    budget: Budget,
    width: int | None = None,
    base=None,
    together: bool | None = None,
) -> Iterator[tuple[int, GenerationStats]]:
    """Decode the jobs, at most `width` rows at once, yielding (job index, stats) as each row finishes.

    A finished row's place goes to the next waiting job at the next step boundary (continuous batching, as the
    server's), so a batch never idles behind its slowest row while work waits: with 8 prompts and width 4, rows
    5-8 join as rows 1-4 finish, whenever that is. Once nothing waits the batch is closed (`Batch.closed`): it ends
    with its slowest row, and drafts are weighed by each row's steps left.

    Models whose cache cannot hold ragged rows (sliding windows, linear attention) or that cannot take a tree
    mask decode the rows one after another with the single-row engine (which falls back to plain decoding where
    it must): still exact, just not batched. `together`: whether the rows can decode together (`Decoder.batches`,
    which probes what this cannot see: a hybrid's rows, a model that counts positions its own way; None: where
    `batch.batchable` says so). `base`: the single row's static base
    (`forerun.base.static.StaticBase`, a GPU's captured steps): a row decoded alone (one job, or `width` 1) takes
    it, and a batch its sibling of `width` places (`forerun.base.static_rows.StaticRows`).

    Example (a list of 8 prompts through 4 rows; `forerun run --batch-size 4` does this):
        >>> for index, stats in decode_rows(model, jobs, budget, width=4):   # doctest: +SKIP
        ...     print(index, jobs[index].transcript.sources)
    """
    if width is not None and width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    alone = len(jobs) == 1 or width == 1
    together = batchable(model) if together is None else together
    if not together or (alone and base is not None):  # one row at a time: a single row's base
        for index, job in enumerate(jobs):
            yield index, decode(model, job, budget, True, base)
        return
    width = min(len(jobs), len(jobs) if width is None else width)
    waiting = deque(enumerate(jobs))
    longest = max(job.input_ids.shape[1] + job.max_new_tokens for job in jobs) + budget.max_nodes
    batch = Batch(model, budget, shared=static_rows(base, width, longest))
    index_of: dict[int, int] = {}
    alone = min(width, len(jobs)) == 1  # only a row that decodes alone drafts at its prefill (`Batch.add`)
    while waiting or batch.rows:
        joining = [waiting.popleft() for _ in range(min(len(waiting), width - len(batch.rows)))]
        for (index, _), row in zip(joining, batch.add_many([job for _, job in joining], draft=alone), strict=True):
            index_of[id(row)] = index
        batch.closed = not waiting
        for row in batch.step():
            if row.error is not None:
                raise row.error
            yield index_of.pop(id(row)), row.stats
