"""What every command shares: the app, its consoles, the run options, the error wrapper and the run specification."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.text import Text

from forerun.defaults import DEFAULT_METHOD, DEFAULT_MODEL

if TYPE_CHECKING:
    from forerun.runspec import RunSpec

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Faster, identical text from Hugging Face LMs.")
# Tables are wide: give them room when the output is a file or a pipe (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 150)
errors = Console(stderr=True)


def versions() -> str:
    """forerun's version and those of what it runs on, read from the installed packages' metadata (nothing
    imported): what a bug report needs. Example: 'forerun 0.1.0 (torch 2.13.0, transformers 5.25.0, python 3.11.7)'."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    found = ", ".join(f"{name} {of(name)}" for name in ("torch", "transformers"))
    return f"forerun {of('forerun')} ({found}, python {sys.version.split()[0]})"


def print_versions(asked: bool) -> None:
    """`--version`: print `versions()` and stop (eager: before any command is looked for)."""
    if asked:
        console.print(versions(), highlight=False)
        raise typer.Exit()


@app.callback()
def options(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=print_versions,
        help="Print forerun's, torch's and transformers' versions.",
    ),
) -> None:
    """Faster, identical text from Hugging Face LMs."""


# The run options, shared by every command (one definition each, so they cannot drift apart).
CHAT_TEMPLATE = typer.Option(
    "",
    "--chat-template",
    help="A Jinja chat template file used instead of the model's own, or one forerun ships by name: 'chatml-tools' "
    "(ChatML with tools, for SmolLM2 and Qwen2.5 models whose own template takes none).",
)
TEMPLATE_KWARGS = typer.Option(
    "",
    "--chat-template-kwargs",
    help="""A JSON object of chat template variables, e.g. '{"enable_thinking": false}' (Qwen3: no thought); """
    "checked against the template once the model is loaded (a request's or record's own override them by name)",
)
MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Alias, local folder, .gguf file or cached hub id.")
METHOD = typer.Option(
    DEFAULT_METHOD,
    "--method",
    help="plain | prompt_lookup | jacobi | trie | draft_model | eagle3 | auto, or joined: a+b.",
)
KNOB = typer.Option([], "--knob", "-k", help="Method knob NAME=VALUE (repeatable; METHOD.NAME when combined).")
DEVICE = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ...")
QUANTIZE = typer.Option(
    "",
    "--quantize",
    help="int4 | int8: every linear layer's weights in 4 or 8 bits (CPU, bf16 activations) | w8a8: 8-bit weights "
    "and activations, integer products (CPU with AVX-512 VNNI or AMX, fp32 around them); empty: as loaded.",
)
ATTENTION = typer.Option(
    "auto",
    "--attention",
    help="auto (forerun_sdpa: sdpa reading grouped key/value heads in place; forerun_sdpa_fp32 for bf16/fp16 on a "
    "CPU that measured it faster) | sdpa (transformers' own) | eager | forerun_sdpa | forerun_sdpa_fp32.",
)
DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="auto (bf16 on a GPU, fp32 on a CPU) | fp32 (identical to generate) | bf16 | fp16 (identical up to ties).",
)
PACK = typer.Option(
    "auto",
    "--pack",
    help="auto | on | off: dense linear layers laid out once for oneDNN's CPU kernels (auto: on a CPU with AVX-512, "
    "fp32 or bf16, where measured no slower at the first load; off: transformers' own layers).",
)
THREADS = typer.Option(0, "--threads", help="torch threads (0 = torch's default).")
PINNED_THREADS = typer.Option(1, "--threads", help="torch threads, pinned for the whole run (measurements).")
DRAFT = typer.Option("", "--draft-model", help="Method draft_model: the small model that drafts.")
HEAD = typer.Option(
    "",
    "--draft-head",
    help="Method eagle3 (and auto): a folder holding an EAGLE-3 head, or a shipped head's name (smollm2-135m).",
)
NODES = typer.Option(0, "--max-tree-nodes", help="Most tokens fed in one forward (0 = the method's or device's).")
COMPILE = typer.Option(
    False,
    "--compile-buckets",
    help="CUDA: compile each tree size's forward before capturing it (steps ~2x shorter; minutes of compiling once).",
)
SAMPLE = typer.Option(False, "--sample", help="Sample instead of greedy decoding (the model's own distribution).")
TEMPERATURE = typer.Option(None, "--temperature", help="With --sample.")
TOP_P = typer.Option(None, "--top-p", help="With --sample.")
TOP_K = typer.Option(None, "--top-k", help="With --sample.")


def sampling(
    do_sample: bool, temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None = None
) -> dict:
    """The request options of the sampling flags ({} for greedy decoding). A sampling setting without --sample is
    a ValueError naming it: greedy decoding would ignore it, and the user would not learn why nothing changed.

    Example:
        >>> sampling(True, 0.7, None, 40), sampling(False, None, None, None)
        ({'do_sample': True, 'temperature': 0.7, 'top_k': 40}, {})
    """
    settings = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    given = {name: value for name, value in settings.items() if value is not None}
    if given and not do_sample:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise ValueError(f"{flags} given without --sample: greedy decoding takes the likeliest token (add --sample)")
    return {"do_sample": True, **given} if do_sample else {}


def freeze_start_up() -> None:
    """Exempt what start-up made (the model's modules and parameters, the tokenizer's tables, captured or compiled
    programs: hundreds of thousands of objects) from Python's garbage collections. A full collection walks every
    tracked object, and decoding (trie nodes, trees, rows) makes enough new ones to start one every so often: each
    held every stream for a fifth of a second in a 16-row batch here (`benchmarks/gc_freeze.py`). Garbage is
    collected first, so none is kept. A long-running command's choice for its own process (as vLLM's and SGLang's
    servers make it), never the library's."""
    gc.collect()
    gc.freeze()


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
    draft_head: str = "",
    compile_buckets: bool = False,
    pack: str = "auto",
) -> RunSpec:
    """The command line's run options as a checked RunSpec (raises ValueError before anything loads)."""
    from forerun.methods import parse_knob_pairs
    from forerun.runspec import RunSpec

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
        draft_head=draft_head or None,
        compile_buckets=compile_buckets,
        pack=pack,
    )


def progress_bar() -> Progress:
    """The live progress bar of long commands (bench, trie build)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console)


def legend(names: tuple[str, ...]) -> Text:
    from forerun.methods import source_style

    line = Text("legend: ")
    line.append("own step ", style="default")
    for name in names:
        line.append(f"{name} ", style=source_style(name))
    return line


MAX_TEMPLATE_CHARS = 1_000_000


def read_chat_template(path: str) -> str:
    """The text of a `--chat-template` file, or of a template forerun ships by name (`chatml-tools`), read before
    the model loads; a ValueError naming it otherwise."""
    from forerun.tool_specs import shipped_template

    if not Path(path).expanduser().exists() and "/" not in path and not path.endswith(".jinja"):
        return shipped_template(path)
    try:
        with Path(path).expanduser().open(encoding="utf-8") as file:
            text = file.read(MAX_TEMPLATE_CHARS + 1)  # /dev/zero, or a model file given by mistake: not all of it
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--chat-template {path}: cannot be read ({error})") from None
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"--chat-template {path}: longer than {MAX_TEMPLATE_CHARS} characters; not a chat template")
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return text


def use_chat_template(tokenizer, template: str) -> None:
    """Make `template` the tokenizer's chat template, once it has rendered a conversation (a ValueError naming
    `--chat-template` where it does not)."""
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 - any template error is the file's
        raise ValueError(f"--chat-template: the template does not render a conversation ({error})") from None


def template_kwargs_of(text: str) -> dict:
    """`--chat-template-kwargs`: '' -> {}, a JSON object -> it (its names are checked against the template once
    the model is loaded); anything else a ValueError naming the option.

    Example:
        >>> template_kwargs_of('{"enable_thinking": false}')
        {'enable_thinking': False}
    """
    import json

    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--chat-template-kwargs must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, got {type(value).__name__}")
    return value
