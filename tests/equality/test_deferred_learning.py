"""A batch's rows learn a paused step while the next forward runs (`forerun.batch.Batch.learn`).

On a card the forward is launched and runs on while the host works until the step's one copy to the host; a
step whose rows feed their roots alone needs nothing of the last step's learning before it, so the drafters learn
the last step in that window. These tests watch the order of events on a CPU: where the learning happens, that
every drafter has learnt every token before it proposes, and that a failure in learning late ends its own row.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_batch import jobs_for, model_of, ragged_prompts, single

import forerun
import forerun.batch
from forerun.base.rows import DynamicRows
from forerun.base.static import StaticBase
from forerun.base.static_rows import StaticRows
from forerun.batch import Batch, RowJob
from forerun.batched import decode_rows
from forerun.costmodel import CostModel, LatencyCurve

from helpers import RandomDrafter
from tiny_models import VOCAB

LINEAR = LatencyCurve((1, 2, 4, 8, 16, 32, 64, 128), tuple(float(n) for n in (1, 2, 4, 8, 16, 32, 64, 128)))
"""Every token fed costs a whole forward: no candidate pays, so a reproducible batch pauses proposals."""
NEW = 40


class Watched(RandomDrafter):
    """Never right; logs its calls into `log` and checks that what it learns is the text as it was then."""

    def __init__(self, truth: list[int], row: int, log: list[tuple]) -> None:
        super().__init__(truth, VOCAB, seed=row)
        self.row, self.log, self.seen, self.late = row, log, 0, []

    def start(self, ctx) -> None:
        self.seen = len(ctx.tokens)

    def propose(self, ctx):
        self.log.append(("propose", self.row))
        if self.seen != len(ctx.tokens):  # a token it has not learnt yet
            self.late.append(("propose", len(ctx.tokens), self.seen))
        return super().propose(ctx)

    def observe(self, ctx, outcome) -> None:
        self.log.append(("observe", self.row))
        new = list(outcome.new_tokens)
        if ctx.tokens[len(ctx.tokens) - len(new) :] != new or len(ctx.tokens) != self.seen + len(new):
            self.late.append(("observe", len(ctx.tokens), self.seen))  # the text moved on before it learnt
        self.seen = len(ctx.tokens)

    def finish(self, ctx) -> None:
        self.log.append(("finish", self.row))


def logged(log: list[tuple], monkeypatch) -> None:
    """Log every batch step's forward (both kinds of rows' cache) and every copy to the host."""
    for rows in (DynamicRows, StaticRows):
        monkeypatch.setattr(rows, "forward", logging_first(rows.forward, log, ("forward",)))
    monkeypatch.setattr(forerun.batch, "to_host", logging_first(forerun.batch.to_host, log, ("copy",)))


def logging_first(call, log: list[tuple], event: tuple):
    def logged_call(*args, **kwargs):
        log.append(event)
        return call(*args, **kwargs)

    return logged_call


def watched(
    static: bool, log: list[tuple], monkeypatch, rows: int = 2
) -> tuple[CostModel, list[RowJob], list[Watched], list, StaticBase | None]:
    """`rows` rows of a never-right drafter on a curve where nothing pays (their budget, jobs, drafters, texts
    alone, and the static base where `static`), forwards and host copies logged."""
    model = model_of("llama", "sdpa")
    truths = [single("llama", "sdpa", i, None, NEW)[0].tolist() for i in range(rows)]
    budget = CostModel(LINEAR, 16, times=None, reproducible=True)
    base = forerun.Decoder(model, None, "plain", static_cache=True).base if static else None
    logged(log, monkeypatch)
    drafters = [Watched(truth, row, log) for row, truth in enumerate(truths)]
    jobs = jobs_for(model, ragged_prompts()[:rows], [[d] for d in drafters], NEW)
    return budget, jobs, drafters, truths, base


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_a_paused_rows_drafters_learn_while_the_next_forward_runs(static, monkeypatch):
    """Between a paused step's forward and its copy to the host the rows' drafters learn the step before; every
    observation still sees the text as it was right after the step it learns, every proposal comes after every
    token was learnt, each row's drafters finish once, after their last observation, and the rows stay exact."""
    log: list[tuple] = []
    budget, jobs, drafters, truths, base = watched(static, log, monkeypatch)
    for _ in decode_rows(model_of("llama", "sdpa"), jobs, budget, base=base):  # as `Decoder.generate` does
        pass
    for job, truth in zip(jobs, truths, strict=True):
        assert job.transcript.sequence[0].tolist() == truth
    assert [d.late for d in drafters] == [[], []]
    windows, running = 0, False  # observations made while a forward ran (after it, before its copy)
    for event in log:
        if event in (("forward",), ("copy",)):
            running = event == ("forward",)
        elif event[0] == "observe":
            windows += running
    observed = sum(event[0] == "observe" for event in log)
    proposed = sum(event[0] == "propose" for event in log)
    assert proposed < observed / 4  # paused most steps: nothing paid
    assert windows > observed / 2, (windows, observed)
    for row in (0, 1):
        mine = [event[0] for event in log if event[1:] == (row,)]
        assert mine.count("finish") == 1 and mine[-1] == "finish"


def test_what_a_batch_put_off_is_learnt_before_a_row_joins_and_when_it_empties(monkeypatch):
    """A row joining sees drafters that learnt everything written so far (a join may read what the others
    learnt: the trie is shared); a batch that empties learns its last rows' text at once."""
    log: list[tuple] = []
    budget, jobs, drafters, _, _ = watched(False, log, monkeypatch, rows=3)
    batch = Batch(model_of("llama", "sdpa"), budget)
    batch.add_many(jobs[:2])
    for _ in range(8):  # past the first proposing steps: paused
        batch.step()
    assert batch.unlearned
    batch.add(jobs[2])
    assert not batch.unlearned and [d.late for d in drafters] == [[], [], []]
    while batch.rows:
        batch.step()
    assert not batch.unlearned and log[-1][0] == "finish"


class FailsLate(Watched):
    """Its observation fails on the `fail_at`-th call, or its finish fails."""

    def __init__(self, *args, fail_at: int | None = None, fail_finish: bool = False) -> None:
        super().__init__(*args)
        self.calls, self.fail_at, self.fail_finish = 0, fail_at, fail_finish

    def observe(self, ctx, outcome) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("observe broke")
        super().observe(ctx, outcome)

    def finish(self, ctx) -> None:
        if self.fail_finish:
            raise RuntimeError("finish broke")
        super().finish(ctx)


def test_a_drafter_failing_to_learn_late_ends_its_own_row_and_a_failed_finish_is_logged(monkeypatch, caplog):
    """Row 0's drafter fails while learning a paused step: row 0 ends with that error and keeps what it wrote
    before (a prefix of its text alone); row 1 goes on, exact. A drafter whose finish fails after its row's
    answer was whole is logged and hurts no one."""
    log: list[tuple] = []
    budget, jobs, _, truths, _ = watched(False, log, monkeypatch)
    batch = Batch(model_of("llama", "sdpa"), budget)
    jobs[0].drafters = [FailsLate(truths[0], 0, log, fail_at=10)]
    jobs[1].drafters = [FailsLate(truths[1], 1, log, fail_finish=True)]
    for job in jobs:
        batch.add(job)
    rows = list(batch.rows)
    with caplog.at_level(logging.WARNING, logger="forerun.batch"):
        while batch.rows:
            batch.step()
    assert isinstance(rows[0].error, RuntimeError) and "observe broke" in str(rows[0].error)
    written = jobs[0].transcript.sequence[0].tolist()
    assert len(written) < len(truths[0]) and written == truths[0][: len(written)]
    assert rows[1].error is None and jobs[1].transcript.sequence[0].tolist() == truths[1]
    assert "finish broke" in caplog.text
    assert torch.equal(jobs[1].transcript.sequence, single("llama", "sdpa", 1, None, NEW))
