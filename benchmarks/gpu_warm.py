"""gpu_check's `warm` section: compiled buckets' warm-up for a batch, program by program, as a batched server's
`Decoder.warm_up(max_len, batch_size=rows, single=False)` makes them: every (rows, nodes) of the batch's places and
its one-place prompt forwards (a lone request's buckets are not warmed there). Each record: the (rows, nodes,
placed) made, its seconds and dynamo's count of compiled graphs so far; the section stops at the call's deadline,
keeping what it timed (a 16-row warm-up had not finished in 4 minutes on an H200)."""

from __future__ import annotations

import time

import torch

from forerun import Decoder
from forerun.costmodel import LatencyCurve

FLAT = LatencyCurve((1, 64), (1.0, 1.0))
"""A given curve: the Decoder measures none (measuring would compile the buckets before the section times them)."""


def warm_programs(log, model, rows: int, max_len: int = 512) -> None:
    from torch._dynamo.utils import counters

    decoder = Decoder(model, None, "plain", latency=FLAT, static_cache=True, compile_buckets=True)
    base = decoder.base
    places = base.sibling(rows)
    plan = [(places, places.key_of(count, size, False)) for count in places.row_buckets for size in places.buckets]
    plan += [(places, (1, size, True)) for size in places.buckets]
    plan = list(dict.fromkeys(plan))  # a lone row is a placed one there (`StaticBase.lone_placed`)
    started = time.perf_counter()
    with torch.inference_mode():
        places.begin(max_len + decoder.budget.max_nodes)
        for each, key in plan:
            if log.late(30):
                log("warm", note="deadline: stopped", done_s=round(time.perf_counter() - started, 1))
                return
            took = time.perf_counter()
            each.prepare(*key)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            log("warm", places=each.places, key=list(key), seconds=round(time.perf_counter() - took, 1),
                graphs=counters["stats"].get("unique_graphs", 0))  # fmt: skip
    log("warm", note="done", seconds=round(time.perf_counter() - started, 1), programs=len(plan))


def main() -> None:
    """Standalone (gpu_check's `warm` section does the same): python benchmarks/gpu_warm.py --model .gpu/x.gguf"""
    import argparse
    import time as clock
    from pathlib import Path

    from gpu_check import DEVICE, Log, random_1b

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random-tiny", help="random-1b, random-tiny (a check), or a .gguf file")
    parser.add_argument("--rows", type=int, default=16, help="the batch's places")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new programs after this long")
    parser.add_argument("--out", type=Path, default=Path("gpu_warm.jsonl"))
    args = parser.parse_args()
    if args.model in ("random-1b", "random-tiny"):
        model, _ = random_1b(args.model == "random-tiny")
    else:
        from forerun.models import load_model

        model, _ = load_model(args.model, dtype=args.dtype, device=str(DEVICE))
    warm_programs(Log(args.out, clock.monotonic() + args.budget_s), model, args.rows)


if __name__ == "__main__":
    main()
