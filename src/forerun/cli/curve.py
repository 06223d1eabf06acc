"""`forerun curve`: measure the forward-latency curves the cost model prices steps on, plotted and stored."""

from __future__ import annotations

import typer

from forerun.checks import writable_folder
from forerun.cli.common import ATTENTION, DEVICE, HEAD, MODEL, PACK, PINNED_THREADS, app, console, user_errors
from forerun.defaults import QUANTIZATIONS

CURVE_SIZES = ",".join(str(n) for n in (*range(1, 17), 20, 24, 32, 48, 64))
"""forerun.latency.SIZES, spelled out here so that `--help` does not import torch."""


SIZES = typer.Option(
    CURVE_SIZES, "--sizes", help="Tokens per forward to measure (default: what the cost model measures)."
)
CONTEXT = typer.Option(256, "--context", help="Cached tokens before each forward.")
REPEATS = typer.Option(5, "--repeats")
OUT = typer.Option("bench-results/latency", "--out")
DTYPES = typer.Option(
    "fp32",
    "--dtype",
    help="fp32, bf16, int8 or int4 (8- or 4-bit weights, bf16 activations), w8a8 (8-bit weights and activations), "
    "or several: fp32,bf16,int8,int4 (one plot).",
)
ROWS = typer.Option(
    "2,4,8", "--rows", help="Rows per forward for the batched curves (what batches decide on); '' for none."
)


@app.command()
@user_errors
def curve(
    model: str = MODEL,
    sizes: str = SIZES,
    context: int = CONTEXT,
    repeats: int = REPEATS,
    threads: int = PINNED_THREADS,
    out: str = OUT,
    device: str = DEVICE,
    dtype: str = DTYPES,
    rows: str = ROWS,
    attention: str = ATTENTION,
    pack: str = PACK,
    draft_head: str = HEAD,
) -> None:
    """Measure the forward-latency curve(s) (latency vs tokens per forward, and with several rows per forward):
    latency.json and latency.png, and the file the cost model reads for this model, dtype, device and threads
    (only a curve measured as the cost model measures it: the default sizes and context, rows 2,4,8 or none).
    With --draft-head, the EAGLE-3 head's forwards by rows too (head-costs.json)."""
    from pathlib import Path

    import torch

    from forerun.bench.latency import write_curves
    from forerun.drafters.eagle3 import load_head
    from forerun.measured import machine_label, write_json
    from forerun.runspec import RunSpec

    size_list, row_list = int_list(sizes, "--sizes"), int_list(rows, "--rows")
    if any(r < 2 or r > 256 for r in row_list):
        raise ValueError(f"--rows must be between 2 and 256, got {rows!r}")
    if threads < 1:
        raise ValueError("--threads must be >= 1")
    writable_folder(out)
    # int4, int8: bf16 activations; w8a8: fp32 around its integer products
    quantized = {label: {"dtype": "fp32" if label == "w8a8" else "bf16", "quantize": label} for label in QUANTIZATIONS}
    specs = {
        label: RunSpec(model=model, method="plain", device=device, threads=threads, attention=attention, pack=pack,
                       **quantized.get(label, {"dtype": label}))
        for label in (d.strip() for d in dtype.split(","))
    }  # fmt: skip
    curves, heads = {}, {}
    for label, spec in specs.items():
        lm, _, _ = spec.load()
        head = load_head(draft_head, lm) if draft_head else None  # a bad head stops the command before measuring
        curves[label] = measure_and_keep(lm, label, size_list, row_list, context, repeats)
        if head is not None:
            heads[label] = measure_head_and_keep(head, label)
        del lm, head
    print_curves(curves, f"forward latency, {context} cached tokens, {threads} thread(s), {device}")
    if heads:
        print_head_costs(heads, curves)
        write_json(Path(out) / "head-costs.json", {"head": draft_head, **{k: v.as_dict() for k, v in heads.items()}})
        console.print(f"wrote {Path(out) / 'head-costs.json'}")
    settings = {
        "model": model, "threads": threads, "device": device, "context": context, "repeats": repeats,
        "machine_label": machine_label(torch.device(device)),
    }  # fmt: skip
    for path in write_curves(curves, settings, Path(out)):
        console.print(f"wrote {path}")


def int_list(text: str, flag: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] ('' -> []); anything else is a ValueError naming `flag`."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def measure_and_keep(lm, label: str, sizes: list[int], rows: list[int], context: int, repeats: int):
    """The curve of model `lm` (and its batched curves over `rows` rows), stored where the cost model reads it."""
    from forerun.latency import (
        BATCH_ROWS,
        CONTEXT,
        DEFAULT_CACHE_DIR,
        SIZES,
        curve_path,
        curve_settings,
        kept_as_measured,
        measure_batched,
        measure_curve,
        save_curve,
    )

    with console.status(f"{label}: measuring {len(sizes)} sizes x {repeats} repeats"):
        measured = measure_curve(lm, sizes, context, repeats)
    if rows:
        with console.status(f"{label}: measuring batches of {','.join(map(str, rows))} rows"):
            measured = measured.with_batches(measure_batched(lm, rows, context=context, repeats=repeats))
    # The cost model prices every step on the file it reads: only what it would measure itself goes there (a curve
    # of one size there would stop all drafting).
    if context == CONTEXT and kept_as_measured(measured, None) is measured:
        save_curve(measured, curve_path(lm, DEFAULT_CACHE_DIR), curve_settings(lm))
    else:
        console.print(
            f"{label}: not kept for the cost model, which measures sizes {','.join(map(str, SIZES))} after "
            f"{CONTEXT} cached tokens and rows {','.join(map(str, BATCH_ROWS))} (or none); written to --out only"
        )
    return measured


def print_curves(curves: dict, title: str) -> None:
    """One table of every curve by tokens fed (ms, relative to 1 token), and per curve with batches, one grid of
    rows x tokens per row relative to 1 row x 1 token."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("tokens", justify="right")
    for label in curves:
        table.add_column(f"{label} ms", justify="right")
        table.add_column(f"{label} relative", justify="right")
    for n in next(iter(curves.values())).sizes:
        cells = [str(n)]
        for measured in curves.values():
            cells += [f"{measured.cost(n) * 1000:.1f}", f"{measured.relative(n):.2f}"]
        table.add_row(*cells)
    console.print(table)
    for label, measured in curves.items():
        if measured.batched:
            batch_sizes = measured.batched[0][1].sizes
            grid = Table(title=f"{label}: rows x tokens per row, relative to 1 row x 1 token")
            grid.add_column("rows", justify="right")
            for n in batch_sizes:
                grid.add_column(str(n), justify="right")
            for count, row_curve in ((1, measured), *measured.batched):
                grid.add_row(str(count), *[f"{row_curve.cost(n) / measured.seconds[0]:.2f}" for n in batch_sizes])
            console.print(grid)


def measure_head_and_keep(head, label: str):
    """The EAGLE-3 head's costs (loaded over its target as a Decoder loads it), measured again and stored where a
    reproducible budget reads them."""
    from forerun.config import Eagle3Config
    from forerun.drafters.eagle3.costs import head_costs

    with console.status(f"{label}: measuring the head's forwards"):
        return head_costs(head, Eagle3Config().topk, capture=True, again=True)


def print_head_costs(heads: dict, curves: dict) -> None:
    """Per dtype, the head's forwards by rows: a level's and a read's ms, and each as a share of the target's
    1-token forward."""
    from rich.table import Table

    for label, costs in heads.items():
        one = curves[label].seconds[0]
        table = Table(title=f"{label}: the EAGLE-3 head's forwards (share of the target's 1-token forward)")
        for column in ("rows", "level ms", "level share", "read ms", "read share"):
            table.add_column(column, justify="right")
        for n in costs.level.sizes:
            level, read = costs.cost(n, False), costs.cost(n, True)
            table.add_row(
                str(n), f"{level * 1000:.2f}", f"{level / one:.1%}", f"{read * 1000:.2f}", f"{read / one:.1%}"
            )
        console.print(table)
