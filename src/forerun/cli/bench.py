"""`forerun bench`: interleaved against plain generate, or batched."""

from __future__ import annotations

import typer
from rich.markup import escape

from forerun.checks import writable_folder
from forerun.cli.common import (
    ATTENTION,
    COMPILE,
    DEVICE,
    DTYPE,
    HEAD,
    MODEL,
    PACK,
    PINNED_THREADS,
    QUANTIZE,
    app,
    console,
    errors,
    progress_bar,
    user_errors,
)

QUICK_METHODS = "plain,hf_prompt_lookup,prompt_lookup,auto"


DATASET = typer.Option(
    "gsm8k,humaneval",
    "--dataset",
    "-d",
    help="Comma-separated: gsm8k, humaneval, mbpp, typehints, restate, or a .jsonl file.",
)
PROMPTS = typer.Option(5, "--n", help="Prompts per dataset.")
METHODS = typer.Option(QUICK_METHODS, "--methods", help="e.g. plain,hf_prompt_lookup,auto,jacobi[window=4]")
NEW_TOKENS = typer.Option(256, "--max-new-tokens")
OUT = typer.Option(
    "bench-results",
    "--out",
    help="Folder for results.json/.md and PNG plots (results.partial.json holds the prompts finished while it runs).",
)
QUICK = typer.Option(False, "--quick", help="10 prompts (5 GSM8K + 5 HumanEval), the quick method set.")
SAMPLED = typer.Option(False, "--sample", help="Sampled runs (temperature/top-p) instead of greedy.")
SAMPLED_TEMPERATURE = typer.Option(0.7, "--temperature", help="With --sample.")
SAMPLED_TOP_P = typer.Option(0.9, "--top-p", help="With --sample.")
SEED = typer.Option(0, "--seed", help="With --sample: every run of a prompt starts from this seed.")
INCLUDE = typer.Option(
    [], "--include", help="Add the records of another run (e.g. benchmarks/compare_lade.sh's lade.json)."
)
DRAFT_MODEL = typer.Option(
    "", "--draft-model", help="Small model sharing the tokenizer, for methods draft_model and hf_assisted."
)
BATCH_SIZE = typer.Option(
    "", "--batch-size", help="e.g. 1,2,4,8: aggregate tokens/s of batched decoding vs plain batched generate."
)
REFILL = typer.Option(
    True,
    "--refill/--no-refill",
    help="With --batch-size: forerun gives a finished row's place to the next prompt (as `forerun run`), or "
    "decodes generate's very batches.",
)
ROUNDS = typer.Option(1, "--rounds", help="With --batch-size: each cell the fastest of this many rounds.")


@app.command()
@user_errors
def bench(
    model: str = MODEL,
    dataset: str = DATASET,
    n: int = PROMPTS,
    methods: str = METHODS,
    max_new_tokens: int = NEW_TOKENS,
    threads: int = PINNED_THREADS,
    out: str = OUT,
    quick: bool = QUICK,
    sample: bool = SAMPLED,
    temperature: float = SAMPLED_TEMPERATURE,
    top_p: float = SAMPLED_TOP_P,
    seed: int = SEED,
    include: list[str] = INCLUDE,
    draft_model: str = DRAFT_MODEL,
    draft_head: str = HEAD,
    compile_buckets: bool = COMPILE,
    batch_size: str = BATCH_SIZE,
    refill: bool = REFILL,
    rounds: int = ROUNDS,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
    attention: str = ATTENTION,
    pack: str = PACK,
) -> None:
    """Benchmark methods against plain model.generate on real prompts, interleaved, outputs checked."""
    from pathlib import Path

    from forerun.bench.datasets import load_dataset
    from forerun.bench.methods import parse_methods
    from forerun.bench.records import load_records
    from forerun.bench.report import write_partial
    from forerun.runspec import RunSpec

    if quick:
        dataset, n, methods = "gsm8k,humaneval", 5, QUICK_METHODS
    if n < 1 or max_new_tokens < 1 or threads < 1:
        raise ValueError(f"--n, --max-new-tokens and --threads must be >= 1 (got {n}, {max_new_tokens}, {threads})")
    specs = parse_methods(methods)
    writable_folder(out)
    spec = RunSpec(
        model=model, method="plain", device=device, dtype=dtype, threads=threads, quantize=quantize or None,
        attention=attention, compile_buckets=compile_buckets, pack=pack,
    )  # fmt: skip
    dtype = spec.dtype  # "auto" resolved for this device
    prompts = [p for name in dataset.split(",") for p in load_dataset(name.strip(), n)]
    included = [record for path in include for record in load_records(Path(path))]
    lm, tokenizer, _ = spec.load()
    draft, head = drafting_models(lm, tokenizer, specs, draft_model, draft_head)
    sampling = {"temperature": temperature, "top_p": top_p} if sample else None
    curve = bench_curve(lm, bool(batch_size), compile_buckets)
    if batch_size:
        bench_batched(
            lm, tokenizer, prompts, specs, batch_size, max_new_tokens, curve, Path(out), dtype, threads, refill, rounds
        )
        return
    announce(f"{escape(model)} {dtype}", len(prompts), max_new_tokens, sampling, threads, device, draft_model, specs)
    settings = {
        "model": model, "datasets": dataset, "n": n, "methods": methods, "max_new_tokens": max_new_tokens,
        "threads": threads, "dtype": dtype, "quantize": quantize or None, "sampling": sampling,
        "seed": seed if sampling else None, "draft_model": draft_model or None, "draft_head": draft_head or None,
    } | measured_settings(lm, curve)  # fmt: skip
    run = {"sampling": sampling, "seed": seed, "draft_model": draft, "latency": curve, "gguf": gguf_of(model),
           "threads": threads, "draft_head": head, "compile_buckets": compile_buckets, "source": model,
           "on_prompt": lambda so_far: write_partial(so_far, settings, Path(out))}  # fmt: skip
    records = run_with_progress(lm, tokenizer, prompts, specs, max_new_tokens, dataset, n, run)
    report_single(records, included, settings, Path(out))


def announce(
    what: str, prompts: int, new_tokens: int, sampling: dict | None, threads: int, device: str, draft: str, specs: list
) -> None:
    """The run's one-line header: `what` (the model and its dtype, markup escaped) is decoded how, with which
    methods against `generate` (`specs`: `forerun.bench.methods.BenchMethod`s)."""
    console.print(
        f"[bold]forerun bench[/]: {what}, {prompts} prompts, {new_tokens} new tokens, "
        f"{'sampled ' + str(sampling) if sampling else 'greedy'}, torch threads {threads}, device {device}, "
        f"{'draft ' + escape(draft) + ', ' if draft else ''}"
        f"methods generate (reference), {escape(', '.join(s.label for s in specs))}",
        highlight=False,
    )


def drafting_models(lm, tokenizer, specs, draft_model: str, draft_head: str) -> tuple:
    """(the draft model, the EAGLE-3 head) the command names, loaded for `lm`, each None where not named; a
    method that drafts with a head without one named is a ValueError."""
    draft = head = None
    if draft_model:
        from forerun.drafters.draft_model import load_draft

        draft = load_draft(draft_model, lm, tokenizer)
    if draft_head:
        from forerun.drafters.eagle3 import load_head

        head = load_head(draft_head, lm)
    elif any(s.reads_head(False) for s in specs):
        raise ValueError("method eagle3 needs an EAGLE-3 head (forerun bench --draft-head FOLDER)")
    return draft, head


def bench_curve(lm, batched: bool, compile_buckets: bool):
    """The latency curve the decoders price steps on: measured once per model, dtype, device and threads (a card's
    single rows verify on the static base, whose bucketed steps have their own curve)."""
    from forerun.base.static import StaticBase, static_support
    from forerun.latency import curve_for

    static = lm.device.type == "cuda" and not batched and static_support(lm) is None
    base = StaticBase(lm, compiled=compile_buckets) if static else None
    with console.status("latency curve (measured once per model, dtype, device and thread count)"):
        return curve_for(lm, batched=batched, base=base)


def run_with_progress(lm, tokenizer, prompts, specs, max_new_tokens: int, dataset: str, n: int, run: dict) -> list:
    """`run_interleaved` under a progress bar; a method with `warm=K` first answers K other prompts of each of the
    `dataset`s (those after the first `n`). `run`: run_interleaved's keyword arguments."""
    from forerun.bench.datasets import load_dataset
    from forerun.bench.runner import run_interleaved

    with progress_bar() as progress:
        task = progress.add_task("runs", total=len(prompts) * (len(specs) + 1))

        def step(prompt_id: str, label: str) -> None:
            progress.update(task, advance=1, description=f"{prompt_id} {label}")

        def warm_up_on_other_prompts(bench_method, decoder) -> None:
            if not bench_method.warm:
                return
            names = [name.strip() for name in dataset.split(",")]
            others = [p for name in names for p in load_dataset(name, n + bench_method.warm)[n:]]
            warm_task = progress.add_task(f"warming {bench_method.label}", total=len(others))
            for prompt in others:
                decoder.generate(list(prompt.messages), max_new_tokens)
                progress.advance(warm_task)

        return run_interleaved(
            lm, tokenizer, prompts, specs, max_new_tokens, step, warm_up_on_other_prompts, **run
        )  # fmt: skip


def measured_settings(lm, curve) -> dict:
    """What a run's figures were measured on: the weights' layout, the machine with its vector units, torch, the
    device, the day, the latency curve."""
    import torch

    from forerun.base.packed import packed
    from forerun.base.stacked import stacked
    from forerun.measured import machine_label

    return {
        "packed": packed(lm),
        "stacked": stacked(lm),
        "machine_label": machine_label(lm.device),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu",
        "latency_curve": curve.as_dict(),
    }


def report_single(records: list, included: list, settings: dict, out) -> None:
    """Print the tables, write results.json/.md and the plots under `out`, note the noise floor's flips; exit 1
    where a forerun method's greedy output differs from plain generate other than at a tie."""
    from forerun.bench.records import mismatch_lines, noise_floor_lines
    from forerun.bench.report import summarize, tables, write_outputs

    for line in mismatch_lines(included):
        errors.print(f"[yellow]note[/]: included run: {escape(line)}", highlight=False)
    summary = summarize(records + included)
    for table in tables(summary):
        console.print(table)
    for path in write_outputs(records + included, summary, settings, out):
        console.print(f"wrote {path}")
    for line in noise_floor_lines(records):
        errors.print(f"[yellow]note[/]: {escape(line)} (plain generate's own noise, not forerun's)", highlight=False)
    mismatches = mismatch_lines(records)
    for line in mismatches:
        errors.print(f"[bold red]MISMATCH[/]: {escape(line)}", highlight=False)
    if mismatches:
        raise typer.Exit(1)


def bench_batched(
    lm, tokenizer, prompts, specs, sizes_text, max_new_tokens, curve, out, dtype, threads, refill=True, rounds=1
) -> None:
    """`forerun bench --batch-size ...`: the batched table (forerun.bench.batched), written as JSON and Markdown."""
    import json

    from forerun.base.weights import weights_kind
    from forerun.bench.batched import markdown_table, run_batched
    from forerun.bench.methods import OTHER_METHODS
    from forerun.decoder import Decoder

    sizes = batch_sizes(sizes_text)
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    skipped = [s.label for s in specs if s.method in OTHER_METHODS or s.needs_draft()]
    if skipped:
        raise ValueError(f"--batch-size runs forerun methods without a draft model; drop {', '.join(skipped)}")

    def make_decoders() -> dict:
        return {
            s.label: Decoder(
                lm, tokenizer, s.method, max_tree_nodes=s.max_tree_nodes, adaptive=s.adaptive, latency=curve, **s.knobs
            )
            for s in specs
        }

    decoders = make_decoders()
    console.print(
        f"[bold]forerun bench --batch-size[/] {sizes}: {len(prompts)} prompts, {max_new_tokens} new tokens, greedy, "
        f"{dtype}, torch threads {threads}; plain batched generate (left-padded) vs {', '.join(decoders)}"
        f"{' (finished rows refilled)' if refill else ' (the same batches)'}",
        highlight=False,
    )
    decoders[next(iter(decoders))].generate([list(prompts[0].messages)] * 2, 8)  # warm-up (allocations)
    with progress_bar() as progress:
        chunks = sum(-(-len(prompts) // size) for size in sizes)
        total = (chunks + (len(sizes) if refill else chunks) * len(decoders)) * rounds
        task = progress.add_task("batches", total=total)

        def step(label: str) -> None:
            progress.update(task, advance=1, description=label)

        rows = run_batched(lm, tokenizer, prompts, make_decoders, sizes, max_new_tokens, step, refill, rounds)
    table = markdown_table(rows)
    console.print(table, highlight=False, markup=False)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batched.md").write_text(table + "\n", encoding="utf-8")
    settings = {"batch_sizes": sizes, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "dtype": dtype,
                "weights": weights_kind(lm), "threads": threads, "refill": refill, "rounds": rounds,
                "latency_curve": curve.as_dict()}  # fmt: skip
    (out / "batched.json").write_text(json.dumps({"settings": settings, "rows": [r.as_dict() for r in rows]}, indent=1))
    console.print(f"wrote {out / 'batched.md'} and {out / 'batched.json'}")
    mismatched = [r for r in rows if r.beyond]
    for row in mismatched:
        where = ", ".join(row.beyond)
        errors.print(f"[bold red]MISMATCH[/]: b={row.batch_size} {row.method}: beyond a tie on {escape(where)}")
    if mismatched:
        raise typer.Exit(1)


def batch_sizes(text: str) -> list[int]:
    """--batch-size's '1,2,4,8' -> [1, 2, 4, 8]; anything but integers >= 1 is a ValueError naming the option."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-size takes integers like 1,2,4,8, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size values must be >= 1, got {text!r}")
    return sizes


def gguf_of(model: str):
    """The model's GGUF file, where it was loaded from one (for llama.cpp in `forerun bench`), else None."""
    from pathlib import Path

    from forerun.models import resolve

    location, gguf_file = resolve(model)
    return Path(location) / gguf_file if gguf_file else None
