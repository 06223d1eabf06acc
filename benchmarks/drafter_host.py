"""A drafter's host work per request: a prompt read in (`start`), its answer learned and the prompt let go
(`finish`), and the garbage collector's full collections they set off, in a process holding the real model.

A request's drafter work runs between two forwards of every row of a batch: a long prompt's trie windows (up to
18 a token at a flat curve's defaults) enter the shared trie at its start and leave at its finish; prompt lookup
indexes every n-gram. Objects made for them by the ten thousand set off full collections, which walk every object
the process tracks (a loaded model and transformers: ~400,000) while no row moves.

Each round runs every prompt length once on one drafter (its trie grows as a server's does: answers stay), or on
`--rows` requests started together and then finished (a batch's rows), with the heap as a library user's process
leaves it, or frozen as `forerun serve` freezes it (`--frozen`). Reported per length: start and finish
milliseconds (all rows', median over rounds), the full collections inside them and their milliseconds, and the
objects the collector tracks for the drafter at the end.

Usage:
    .venv/bin/python benchmarks/drafter_host.py --lengths 100,1000,4000 --rounds 5 --out /tmp/trie-host.json
    .venv/bin/python benchmarks/drafter_host.py --method prompt_lookup --lengths 1000,4000 --rows 16 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import forerun
from forerun.assembly import method_plan
from forerun.drafters.base import DraftContext
from forerun.measured import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_stall import long_document  # noqa: E402


class Collections:
    """Full collections seen by the collector's callbacks: how many, and their seconds."""

    def __init__(self) -> None:
        self.count, self.seconds, self.began = 0, 0.0, 0.0
        gc.callbacks.append(self.heard)

    def heard(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self.began

    def since(self, mark: tuple[int, float]) -> tuple[int, float]:
        return self.count - mark[0], self.seconds - mark[1]


def timed(call, collections: Collections) -> tuple[float, int, float]:
    """Seconds of `call()`, and the full collections (count, seconds) inside it."""
    mark = (collections.count, collections.seconds)
    started = time.perf_counter()
    call()
    seconds = time.perf_counter() - started
    return (seconds, *collections.since(mark))


def each(what: str, drafters: list, ctxs: list[DraftContext]) -> None:
    """Every row's drafter `start`s or `finish`es its request."""
    for drafter, ctx in zip(drafters, ctxs, strict=True):
        getattr(drafter, what)(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="trie", choices=("trie", "prompt_lookup", "jacobi"))
    parser.add_argument("--lengths", default="100,1000,4000", help="prompt tokens, about")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--answer", type=int, default=128, help="answer tokens learned at each finish")
    parser.add_argument("--rows", type=int, default=1, help="requests started together (a batch's), then finished")
    parser.add_argument("--frozen", action="store_true", help="freeze the heap after loading, as forerun serve does")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype="fp32")
    lengths = [int(n) for n in args.lengths.split(",")]
    texts = {n: tokenizer(long_document(tokenizer, n)).input_ids for n in lengths}
    plan = method_plan(args.method, {}, "cpu", None).for_flat_curve()  # a flat curve's defaults (a card's)
    drafter = plan.build(None, len(tokenizer))[0]
    if args.frozen:
        gc.collect()
        gc.freeze()
    tracked_before = len(gc.get_objects())
    collections = Collections()
    samples: dict[int, list[tuple]] = {n: [] for n in lengths}
    for round_ in range(args.rounds):
        for n in lengths:
            prompt = texts[n]
            # each row a drafter of its own over the shared state (a batch forks the Decoder's: `forerun.batch.fork`)
            drafters = [copy.copy(drafter) for _ in range(args.rows)]
            ctxs = [DraftContext(list(prompt), len(prompt), 64, frozenset(), selective=True) for _ in drafters]
            start = timed(functools.partial(each, "start", drafters, ctxs), collections)
            for row, ctx in enumerate(ctxs):  # another answer each round and row
                ctx.tokens.extend((round_ * 7919 + row * 104729 + 31 * i) % 49152 for i in range(args.answer))
            finish = timed(functools.partial(each, "finish", drafters, ctxs), collections)
            samples[n].append((*start, *finish))
    rows = []
    for n in lengths:
        runs = samples[n]
        row = {"prompt_tokens": len(texts[n]), "start_ms": round(1000 * statistics.median(r[0] for r in runs), 2),
               "finish_ms": round(1000 * statistics.median(r[3] for r in runs), 2),
               "full_collections": sum(r[1] + r[4] for r in runs),
               "collections_ms": round(1000 * sum(r[2] + r[5] for r in runs), 1),
               "max_start_ms": round(1000 * max(r[0] for r in runs), 1)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    env = {"machine": machine_label(torch.device("cpu")), "python": platform.python_version(), "rounds": args.rounds,
           "method": args.method, "rows": args.rows, "frozen": args.frozen,
           "trie_nodes": len(getattr(drafter, "trie", ())),
           "tracked_objects_added": len(gc.get_objects()) - tracked_before}  # fmt: skip
    print(json.dumps(env))
    if args.out:
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
