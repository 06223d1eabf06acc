"""Full garbage collections in a long-lived process, with and without `gc.freeze()` after start-up.

A loaded model leaves hundreds of thousands of Python objects (modules, parameters, tokenizer tables); the trie and
the rows add more as they decode. Python's full collection walks every one of them: here a fraction of a second,
during which no stream moves. `forerun serve` and `forerun run` freeze what start-up made (`gc.freeze()`, as vLLM
and SGLang do), so a full collection walks only what decoding made since.

Each round decodes the same batch twice in fresh processes, one frozen after a warm-up batch and one not,
interleaved; it reports seconds, full collections and their time.

Usage:
    .venv/bin/python benchmarks/gc_freeze.py --model tiny --rows 16 --new-tokens 96 --rounds 3
    .venv/bin/python benchmarks/gc_freeze.py --model smollm2-135m --rows 8 --new-tokens 64 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def one_run(model_name: str, rows: int, new_tokens: int, freeze: bool) -> dict:
    """Decode a batch of `rows` prompts (after a warm-up batch), `gc.freeze()` first if `freeze`."""
    sys.path.insert(0, str(ROOT / "tests"))
    import forerun
    from forerun.costmodel import LatencyCurve

    torch.set_num_threads(1)
    if model_name == "tiny":
        from tiny_models import prompts, tiny_model

        model = tiny_model("llama", "sdpa")
        batch = [p[0].tolist() for p in prompts(rows, length=40, seed=3)]
        # a card's shape (wide trees nearly free): the host's work per step is what this model leaves to time
        curve = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3))
        decoder = forerun.Decoder(model, None, "auto", latency=curve, static_cache=True)
        run = {"eos_token_id": []}
    else:
        from forerun.bench.datasets import load_dataset

        model, tokenizer = forerun.load_model(model_name)
        batch = [list(p.messages) for p in load_dataset("gsm8k", rows)]
        decoder = forerun.Decoder(model, tokenizer, "auto")
        run = {"chat": False}
    decoder.generate(batch, new_tokens // 2, **run)
    if freeze:
        gc.freeze()
    collections = {"full": 0, "seconds": 0.0}
    started: dict[str, float] = {}

    def timed(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started["at"] = time.perf_counter()
        else:
            collections["full"] += 1
            collections["seconds"] += time.perf_counter() - started.pop("at")

    gc.callbacks.append(timed)
    began = time.perf_counter()
    results = decoder.generate(batch, new_tokens, **run)
    seconds = time.perf_counter() - began
    tokens = sum(len(r.new_tokens) for r in results)
    return {"freeze": freeze, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "full_collections": collections["full"], "full_collection_s": round(collections["seconds"], 3),
            "tracked_objects": len(gc.get_objects())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (a host-bound batch: a card's regime) or a model name")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", choices=["frozen", "not"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.model, args.rows, args.new_tokens, args.one == "frozen")))
        return
    for round_ in range(args.rounds):
        for which in ("not", "frozen"):  # each in a fresh process: a collection's cost depends on the heap
            command = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows),
                       "--new-tokens", str(args.new_tokens), "--one", which]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()
            print(json.dumps({"round": round_, "model": args.model, "rows": args.rows, **json.loads(out[-1])}))


if __name__ == "__main__":
    main()
