"""The GPU check's `batch` section: `generate([...])` of a few row counts against transformers' batched generate
(`gpu_check.py batch`).

Usage (the same as `gpu_check.py batch`, with its options):
    python benchmarks/gpu_batch.py --model .gpu/smollm2.gguf --prompts .gpu/prompts.json --batch-rows 4,16
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling gpu_check, wherever it is run from

from gpu_check import DEVICE, Log, hf_generate, sync_time
from gpu_profile import top_functions

from forerun import Decoder
from forerun.exactness import first_divergence
from forerun.latency import synchronize


def batch(
    log: Log,
    model,
    tokenizer,
    prompts: list[dict],
    new_tokens: int,
    compiled: list[str],
    sizes: list[int],
    baselines: list[str],
    profiled: tuple[str, ...] = (),
    steered: tuple[str, ...] = (),
) -> None:
    """`generate([...])` of r rows (on the static base's places, graphs per (rows, bucket)) against transformers'
    batched generate of the same left-padded rows, eager and (in `baselines`) with its static cache (compiled;
    warmed per row count). `compiled`: these methods also with compiled buckets; `steered`: these also with choices
    steered by the run's timings (`reproducible=False`: the batch's draft switch pauses proposals where drafting
    measures slower, host work included). Each forerun row is compared with the eager batched generate's row
    (bf16: a padded batch may differ at ties, so this is reported, not asserted: the rows that differ, and of
    them how many first differ at a tie on generate's own logits).

    As a served process is (`forerun serve`, `forerun run`): every decoder warmed for its batch size before it is
    timed (each (rows, nodes) graph captured once: rows leave at different steps, so a cold run captures in its
    timed pass), and every timed run, transformers' too, starts with the heap frozen
    (`forerun.cli.common.freeze_start_up`: compiling leaves millions of objects that each full collection walks)."""
    for rows in sizes:
        if log.late(60):
            return
        texts = [torch.tensor(p["ids"]) for p in (prompts * rows)[:rows]]  # as many rows as asked, prompts repeated
        batch_of(log, model, tokenizer, texts, new_tokens, compiled, baselines, profiled, steered)


def batch_of(
    log: Log,
    model,
    tokenizer,
    texts: list[torch.Tensor],
    new_tokens: int,
    compiled: list[str],
    baselines: list[str],
    profiled: tuple[str, ...] = (),
    steered: tuple[str, ...] = (),
) -> None:
    from forerun.cli.common import freeze_start_up

    rows, width = len(texts), max(len(t) for t in texts)
    hf_out, hf_logits, record = transformers_rows(log, model, tokenizer, texts, new_tokens, baselines)
    lists = [t.tolist() for t in texts]
    # warmed on the texts reversed (the same shapes): a warm run of the very texts would leave their answers in the
    # trie, to be drafted whole in the timed run
    unseen = [t.flip(0).tolist() for t in texts]
    variants = [(m, m, False, None) for m in ("plain", "auto")] + [(f"{m} (steered)", m, False, False)
                                                                   for m in steered]  # fmt: skip
    variants += [(f"{m} (compiled)", m, True, None) for m in compiled]  # last: compiling may take the time left
    for label, method, fused, reproducible in variants:
        if log.late(45):
            return
        decoder = Decoder(model, tokenizer, method, static_cache=True, compile_buckets=fused, reproducible=reproducible)
        capture_s = decoder.warm_up(width + new_tokens, batch_size=rows, single=rows == 1)  # as a server warms
        _, warm_s = sync_time(lambda d=decoder: d.generate(unseen, new_tokens, eos_token_id=[]))
        freeze_start_up()
        results, took = sync_time(lambda d=decoder: d.generate(lists, new_tokens, eos_token_id=[]))
        same, ties = agreement(results, hf_out[:, width:].tolist(), hf_logits, model.dtype)
        sibling = decoder.base.siblings.get(rows) if decoder.base is not None and rows > 1 else decoder.base
        speed = {"vs_generate": round(record["seconds"] / took, 3)}
        if "static_seconds" in record:
            speed["vs_static_generate"] = round(record["static_seconds"] / took, 3)
        log("batch", rows=rows, method=label, seconds=round(took, 3), capture_s=round(capture_s, 1),
            warm_s=round(warm_s, 1), tokens=sum(len(r.new_tokens) for r in results), **speed,
            forwards=sum(r.stats.forwards for r in results) / rows, same_as_generate=f"{same}/{rows}",
            first_differences_at_ties=f"{ties}/{rows - same}",
            graphs=len(sibling.steps) if sibling is not None else None)  # fmt: skip
        if not fused:
            host_work(log, decoder, label, lists, new_tokens)
        if label in profiled:  # once more under cProfile: where a batched step's host time goes
            import cProfile

            profiler = cProfile.Profile()
            profiler.runcall(lambda d=decoder: d.generate(lists, new_tokens, eos_token_id=[]))
            log("batch_profile", rows=rows, method=label, top=top_functions(profiler, 1, "run", limit=60))


def agreement(results, reference: list[list[int]], logits: list[list[torch.Tensor]], dtype) -> tuple[int, int]:
    """(rows whose new tokens are the reference's, rows that differ first where the reference's own logits tie):
    a padded batch's rows may differ at bf16 ties, and only a difference that is no tie is wrong."""
    same = ties = 0
    for result, expected, row_logits in zip(results, reference, logits, strict=True):
        divergence = first_divergence(expected, result.new_tokens, row_logits, dtype)
        same += divergence is None
        ties += divergence is not None and divergence.is_tie
    return same, ties


def transformers_rows(
    log: Log, model, tokenizer, texts: list[torch.Tensor], new_tokens: int, baselines: list[str]
) -> tuple[torch.Tensor, list[list[torch.Tensor]], dict]:
    """Transformers' batched generate of the `texts` left-padded, eager (its sequences [rows, width + new_tokens]
    are what forerun's rows are compared with, and per row its logits [vocab] at each new token) and, in
    `baselines`, with its static cache compiled (compiled once, then timed); logged, and returned with the
    timings."""
    from forerun.cli.common import freeze_start_up

    rows, width = len(texts), max(len(t) for t in texts)
    pads = (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
    pad = next((t for t in pads if t is not None), 0)
    ids = torch.stack([torch.cat([torch.full((width - len(t),), pad), t]) for t in texts]).to(DEVICE)
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(t) for t in texts])[:, None]).long().to(DEVICE)

    def run_hf(**options):
        return hf_generate(model, ids, new_tokens, attention_mask=mask, pad_token_id=pad, eos_token_id=None, **options)

    # the untimed first run keeps its logits: a forerun row that differs is judged on them (a tie or not)
    reference = run_hf(output_logits=True, return_dict_in_generate=True)
    freeze_start_up()
    hf_out, hf_s = sync_time(run_hf)
    record = {"seconds": round(hf_s, 3)}
    if "generate_static_compiled" in baselines:
        _, compile_s = sync_time(lambda: run_hf(cache_implementation="static"))
        freeze_start_up()
        _, hf_static_s = sync_time(lambda: run_hf(cache_implementation="static"))
        record |= {"static_seconds": round(hf_static_s, 3), "static_compile_s": round(compile_s, 1)}
    log("batch", rows=rows, baseline="generate", **record)
    return reference.sequences, [[step[row] for step in reference.logits] for row in range(rows)], record


def host_work(log: Log, decoder: Decoder, label: str, lists: list[list[int]], new_tokens: int) -> None:
    """The batch once more, each forward waited for: what the host spends between a step's forwards (of it, what
    the timed runs above did while a forward ran: `overlapped_ms_per_step`, `batch_host.learning_timed`)."""
    from batch_host import timed_run

    run = timed_run(decoder, lists, new_tokens, sync=lambda: synchronize(DEVICE))
    steps = max(run["forwards"], 1)
    log("batch_host", rows=len(lists), method=label, forwards=run["forwards"],
        forward_ms_per_step=round(1e3 * run["forward_s"] / steps, 3),
        host_ms_per_step=round(1e3 * (run["wall_s"] - run["forward_s"]) / steps, 3),
        overlapped_ms_per_step=round(1e3 * run["overlapped_s"] / steps, 3))  # fmt: skip


def main() -> None:
    """`gpu_check.py batch ...`: this section alone, with gpu_check's options."""
    import gpu_check

    sys.argv.insert(1, "batch")
    gpu_check.main()


if __name__ == "__main__":
    main()
