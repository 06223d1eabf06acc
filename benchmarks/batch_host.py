"""Host work per step of a batch on the static base: what a card's captured forward leaves to Python.

On a GPU a 16-row step of a small model is a ~4-5 ms captured forward; what the rows' drafters, the cost model's
ranking, the verifier and the commits cost between forwards is then as large as the forward itself, and it is
Python, so this CPU measures it as well as a card's host would (scaled by their single-thread speeds). Each run
decodes `--rows` prompts on the static base's eager buckets and reports, per step, the wall time minus the time
inside the bucketed forwards (`StaticBase.run`): the host work. Choices are made on a card-like latency curve
(`--curve`, default the H200's measured one-row curve, batches priced at a quarter more per row doubling) with
`reproducible=True`, so every step drafts where the curve says it pays, as on a card, whatever this CPU's own
timings: the figures are host work per step at the card's choices, plus tokens per forward, and `priced_tok_s`:
tokens per second where every forward costs its (rows, bucket) price on the curve and the host work is this
machine's (what the batch would write a second on that card, were its host as fast as this one; a model, not a
measurement of the card). The drafters' learning a batch does while a forward runs (`Batch.learn` between the
forward and the step's copy to the host: a paused step's) hides behind that forward on a card, up to its price
there: `overlapped_ms_per_step`, left out of `priced_tok_s` (it stays in `host_ms_per_step`, this CPU's own).

`--curve steep`: every node costs a whole forward, so no draft ever pays and every step feeds the rows' roots
alone: what a method's rows still spend proposing and ranking (where choices are reproducible the batch's draft
switch would steer by timings; `IdleProposals` pauses them on what the cost model fed) is all that sets it apart
from `plain`.

A method named with `-always` (`auto-always`) proposes every step, as reproducible batches did before they paused
proposals the cost model fed none of (`forerun.costmodel.switch.IdleProposals`).

`--replay` (`plain`, or any method on the steep curve: steps whose work does not depend on the tokens): every
(rows, bucket) forward runs once, and later calls return its outputs again, as a card's captured graph returns
its own buffers; the wall time is then the host work alone, without the eager forwards' allocations and the
caches they leave cold (the texts are not the model's).

Usage:
    .venv/bin/python benchmarks/batch_host.py --rows 16 --methods plain,auto --threads 2 --rounds 2 \
        --out benchmarks/results/batch-host-epyc.json
    .venv/bin/python benchmarks/batch_host.py --rows 16 --methods plain --replay --rounds 3
    .venv/bin/python benchmarks/batch_host.py --rows 16 --methods plain,auto,auto-always --curve steep --replay \
        --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import forerun
from forerun.bench.datasets import load_dataset
from forerun.costmodel import LatencyCurve
from forerun.costmodel.switch import IdleProposals
from forerun.models import load_model

H200_MS = {1: 3.421, 2: 3.927, 4: 4.019, 8: 4.071, 16: 4.189, 32: 4.265, 64: 4.453}
"""SmolLM2-135M's one-row step by bucket on an H200, bf16, captured (`benchmarks/results/gpu-h200-run6.jsonl`)."""
DATASETS = ("gsm8k", "humaneval", "mbpp", "typehints")


def card_curve(ms: dict[int, float], row_step: float = 0.25) -> LatencyCurve:
    """`ms` as the one-row curve; a batch of 2^i rows costs (1 + row_step * i) times it (a card's regime: rows
    share the weights' reading, each reads its own cache)."""
    sizes = tuple(sorted(ms))

    def scaled(k: float) -> LatencyCurve:
        return LatencyCurve(sizes, tuple(ms[s] * k / 1000 for s in sizes))

    return scaled(1.0).with_batches([(2**i, scaled(1 + row_step * i)) for i in range(1, 7)])


CARD = card_curve(H200_MS)
"""What a forward costs on the card: the host's work a batch does while one runs hides behind it up to that."""


def steep_curve() -> LatencyCurve:
    """Every node, every row, a whole forward's price (`--curve steep`): no draft pays."""
    sizes = tuple(sorted(H200_MS))

    def rows(k: int) -> LatencyCurve:
        return LatencyCurve(sizes, tuple(H200_MS[1] * k * size / 1000 for size in sizes))

    return rows(1).with_batches([(2**i, rows(2**i)) for i in range(1, 7)])


@contextmanager
def proposing_every_step(on: bool):
    """With `on`, a reproducible batch's rows propose every step (`IdleProposals` held off), as before it existed."""
    proposing = IdleProposals.proposing
    if on:
        IdleProposals.proposing = lambda self: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        IdleProposals.proposing = proposing  # type: ignore[method-assign]


def chat_ids(tokenizer, n: int) -> list[list[int]]:
    """`n` prompts per dataset, chat-templated, as token ids."""
    out = []
    for name in DATASETS:
        for prompt in load_dataset(name, n):
            ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def replayed(decoder: forerun.Decoder) -> None:
    """Make each of the decoder's bases answer a (rows, bucket) forward it has run before with the same outputs
    (`--replay`)."""
    for base in [decoder.base, *decoder.base.siblings.values()]:
        outputs, run = {}, base.run

        def replay(fed, placed, base=base, outputs=outputs, run=run):
            key = base.step_key(fed, placed)
            if key not in outputs:
                outputs[key] = run(fed, placed)
            return outputs[key]

        base.run = replay


def timed_run(
    decoder: forerun.Decoder, prompts: list[list[int]], new_tokens: int, sync=None, curve: LatencyCurve | None = None
) -> dict:
    """Decode `prompts` as one batch; wall seconds, seconds inside the bucketed forwards, forwards, tokens.
    `sync`: called inside each forward's timing (a card's `torch.cuda.synchronize`: a replay only launches, and
    the step's copy to the host would wait for it outside). `curve`: each forward's (rows, bucket) priced on it
    too (`priced_s`: what the forwards would cost where the curve was measured)."""
    inside, held, priced = [0.0, 0], [None], [0.0]
    # the last forward's price, whether it still runs (on a card), and the learning forwards would hide
    overlap = {"price": 0.0, "open": False, "s": 0.0}
    bases = [decoder.base, *decoder.base.siblings.values()]
    originals = [base.run for base in bases]

    def wrap(run, base):
        def timed(*args, **kwargs):
            rows, size, _ = base.step_key(*args, **kwargs)
            overlap["price"] = CARD.batch_cost(rows, size)  # how long a card's forward hides the host's work
            priced[0] += curve.batch_cost(rows, size) if curve is not None else 0.0
            started = time.perf_counter()
            try:
                # the last forward's outputs are let go here: eager on a CPU they are fresh tensors (16 rows of 64
                # nodes: 200 MB of logits, ~10 ms to free), which a card's graphs never allocate
                held[0] = None
                held[0] = run(*args, **kwargs)
                if sync is not None:
                    sync()
                return held[0]
            finally:
                inside[0] += time.perf_counter() - started
                inside[1] += 1
                overlap["open"] = True

        return timed

    for base, run in zip(bases, originals, strict=True):
        base.run = wrap(run, base)
    try:
        started = time.perf_counter()
        with learning_timed(overlap):
            results = decoder.generate(prompts, new_tokens, eos_token_id=[])
        wall = time.perf_counter() - started
    finally:
        for base, run in zip(bases, originals, strict=True):
            base.run = run  # a replaying one (`replayed`) stays; a bound method, as it was
    steps = [r.stats.forwards for r in results]
    texts = [r.sequences[0, r.prompt_len :].tolist() for r in results]
    tokens = sum(len(text) for text in texts)
    return {"wall_s": wall, "forward_s": inside[0], "forwards": inside[1], "row_forwards": sum(steps),
            "tokens": tokens, "texts": texts, "priced_s": priced[0], "overlapped_s": overlap["s"]}  # fmt: skip


@contextmanager
def learning_timed(overlap: dict):
    """Time the drafters' learning a batch does while a forward runs (`Batch.learn` between a forward and the
    step's copy to the host): on a card that work hides behind the forward, up to its price (`overlap["price"]`,
    set by each forward). Adds what would hide to `overlap["s"]`."""
    learn, copies = forerun.batch.Batch.learn, (forerun.batch.to_host, forerun.row.to_host)

    def timed_learn(batch):
        started, pending = time.perf_counter(), bool(batch.unlearned)
        learn(batch)
        if overlap["open"] and pending:
            overlap["s"] += min(time.perf_counter() - started, overlap["price"])

    def copied(*args, **kwargs):
        overlap["open"] = False  # the step waits for the card here: nothing after it hides
        return copies[0](*args, **kwargs)

    forerun.batch.Batch.learn = timed_learn  # type: ignore[method-assign]
    forerun.batch.to_host = forerun.row.to_host = copied
    try:
        yield
    finally:
        forerun.batch.Batch.learn = learn  # type: ignore[method-assign]
        forerun.batch.to_host, forerun.row.to_host = copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--methods", default="plain,auto")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--curve", choices=("h200", "steep"), default="h200", help="what steps are priced on")
    parser.add_argument("--replay", action="store_true", help="forwards replayed: the host work alone")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.replay and args.methods != "plain" and args.curve != "steep":
        parser.error("--replay times undrafted steps only (--methods plain, or --curve steep): drafts would follow "
                     "the replayed text")  # fmt: skip
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype="fp32")
    # a round's prompts are its own: a trie that had decoded them would know the answers
    pool = chat_ids(tokenizer, max(1, -(-args.rows * args.rounds // len(DATASETS))))
    warm = [list(reversed(p)) for p in pool[: args.rows]]  # same shapes, other answers
    curve = card_curve(H200_MS) if args.curve == "h200" else steep_curve()
    decoders = {m: forerun.Decoder(model, tokenizer, m.removesuffix("-always"), static_cache=True, reproducible=True,
                                   latency=curve)
                for m in args.methods.split(",")}  # fmt: skip
    for method, decoder in decoders.items():
        with proposing_every_step(method.endswith("-always")):
            decoder.generate(warm, args.new_tokens, eos_token_id=[])
            if args.replay:
                replayed(decoder)
                decoder.generate(warm, args.new_tokens, eos_token_id=[])  # every (rows, bucket) once more
    gc.collect()
    gc.freeze()
    rows, texts = [], {}
    for round_ in range(args.rounds):
        for method, decoder in decoders.items():  # interleaved
            with proposing_every_step(method.endswith("-always")):
                run = timed_run(decoder, pool[round_ * args.rows : (round_ + 1) * args.rows], args.new_tokens,
                                curve=curve)  # fmt: skip
            host, steps = run["wall_s"] - run["forward_s"], max(run["forwards"], 1)
            row = {"round": round_, "method": method, "rows": args.rows, "steps": run["forwards"],
                   "host_ms_per_step": round(1000 * host / steps, 3),
                   "overlapped_ms_per_step": round(1000 * run["overlapped_s"] / steps, 3),
                   "tokens_per_forward": round(run["tokens"] / max(run["row_forwards"], 1), 2),
                   "priced_tok_s": round(run["tokens"] / (run["priced_s"] + host - run["overlapped_s"]), 1),
                   "wall_s": round(run["wall_s"], 2), "forward_s": round(run["forward_s"], 2)}  # fmt: skip
            texts.setdefault(method, run["texts"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    first = next(iter(texts.values()))  # the first round's
    same = {m: sum(a == b for a, b in zip(t, first, strict=True)) for m, t in texts.items()}
    env = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
           "same_as_first_method": same, "replay": args.replay, "curve": args.curve}  # fmt: skip
    print(json.dumps(env))
    if args.out:
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
