"""`forerun run`: a JSONL file through batched decoding, resumable, sharded under torchrun."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.markup import escape

from forerun.cli.common import (
    CHAT_TEMPLATE,
    COMPILE,
    DEVICE,
    DRAFT,
    DTYPE,
    HEAD,
    KNOB,
    METHOD,
    MODEL,
    NODES,
    PACK,
    QUANTIZE,
    SAMPLE,
    TEMPERATURE,
    TEMPLATE_KWARGS,
    THREADS,
    TOP_K,
    TOP_P,
    app,
    console,
    errors,
    freeze_start_up,
    progress_bar,
    read_chat_template,
    run_spec,
    sampling,
    template_kwargs_of,
    use_chat_template,
    user_errors,
)

PROMPTS_FILE = typer.Argument(..., help='JSONL: {"id", "prompt" | "messages", optional settings} per line.')
OUT = typer.Option(..., "--out", "-o", help="Results JSONL (appended as records finish; resumable).")
BATCH_SIZE = typer.Option(
    8, "--batch-size", "-b", help="Rows decoded at once; a finished row's place goes to the next record."
)
NEW_TOKENS = typer.Option(128, "--max-new-tokens", "-n")
CHAT = typer.Option(False, "--chat", help="Apply the chat template to text prompts.")
SEED = typer.Option(None, "--seed", help="With --sample: the file's i-th record draws from seed + i.")


@app.command("run")
@user_errors
def run_file(
    prompts_file: str = PROMPTS_FILE,
    out: str = OUT,
    model: str = MODEL,
    method: str = METHOD,
    knob: list[str] = KNOB,
    batch_size: int = BATCH_SIZE,
    max_new_tokens: int = NEW_TOKENS,
    chat: bool = CHAT,
    do_sample: bool = SAMPLE,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: int = SEED,
    max_tree_nodes: int = NODES,
    threads: int = THREADS,
    draft_model: str = DRAFT,
    draft_head: str = HEAD,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
    pack: str = PACK,
    compile_buckets: bool = COMPILE,
    chat_template: str = CHAT_TEMPLATE,
    chat_template_kwargs: str = TEMPLATE_KWARGS,
) -> None:
    """Decode a JSONL file of prompts, --batch-size rows at once; rerun to resume. Under torchrun each rank takes a
    shard."""
    import torch.distributed as dist

    from forerun.runner import check_writable, merge_results, pending_records, read_records

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"--batch-size and --max-new-tokens must be >= 1 (got {batch_size}, {max_new_tokens})")
    source, target = Path(prompts_file), Path(out)
    if not source.is_file():
        raise ValueError(f"prompts file {source} " + ("is not a regular file" if source.exists() else "does not exist"))
    check_writable(target)
    defaults = {"max_new_tokens": max_new_tokens, "chat": chat} | sampling(do_sample, temperature, top_p, top_k)
    if seed is not None:
        defaults["seed"] = seed
    if variables := template_kwargs_of(chat_template_kwargs):  # a record's own take their place
        defaults["chat_template_kwargs"] = variables
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize, draft_head,
                    compile_buckets, pack)  # fmt: skip
    template = read_chat_template(chat_template) if chat_template else None
    records, problems = read_records(source, defaults)
    shard = join_shard(spec.device)
    if shard.rank == 0:  # every rank reads the same file: one report
        for problem in problems:
            errors.print(f"[bold yellow]skipped:[/] {escape(problem)}", highlight=False)
    pending = pending_records(records, target)
    if shard.world > 1:
        dist.barrier()  # every rank has read what is done before any rank appends
    lm, tokenizer, draft = spec.load()
    if template is not None:
        use_chat_template(tokenizer, template)
    decoder = spec.decoder(lm, tokenizer, draft)
    freeze_start_up()  # the model and its tokenizer: no full collection walks them again, for the whole run
    decoded, refused = decode_with_progress(decoder, shard.take(pending), pending, target, batch_size, shard)
    if shard.world > 1:
        dist.barrier()  # every rank's part file is complete
    if shard.rank == 0:
        written = merge_results(target, records) if decoded or shard.world > 1 or target.exists() else 0
        console.print(f"{written} records in {target} ({decoded} decoded now)", highlight=False)
    if shard.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    exit_on_failures(refused, len(problems) if shard.rank == 0 else 0, shard.label(), source, target)


def exit_on_failures(refused: int, bad_lines: int, rank: str, source: Path, target: Path) -> None:
    """Say what the run could not do, records refused (`rank`: the shard's label) and the file's bad lines, and
    exit with status 2 if there were any: a script that runs the file learns of them."""
    if refused:
        errors.print(
            f"[bold red]error:[/] {rank}{refused} record(s) refused; their rows in {target} hold the "
            "reason under 'error' (a rerun tries them again)",
            highlight=False,
        )
    if bad_lines:
        errors.print(f"[bold red]error:[/] {bad_lines} bad line(s) in {source} were skipped", highlight=False)
    if refused or bad_lines:
        raise typer.Exit(2)


def join_shard(device: str):
    """This process's shard of the file: under torchrun (which set the rendezvous) one per rank, else the whole."""
    import torch.distributed as dist

    from forerun.runner import Shard

    if not dist.is_torchelastic_launched():
        return Shard()
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Shard(dist.get_rank(), dist.get_world_size())


def decode_with_progress(decoder, mine: list, pending: list, target, batch_size: int, shard) -> tuple[int, int]:
    """`run_records` under a progress bar of `mine` (this shard's records) that shows tokens per second and per
    forward, each refused record printed as it comes; (records decoded, records refused)."""
    from forerun.runner import run_records

    label = shard.label()
    totals = {"tokens": 0, "forwards": 0, "refused": 0}
    with progress_bar() as bar:
        task = bar.add_task(f"{label}records", total=len(mine))
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
    return decoded, totals["refused"]
