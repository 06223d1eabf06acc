"""`forerun bench --batch-size 1,2,4,8`: aggregate throughput of batched decoding against plain batched generate.

For each batch size b, plain batched `model.generate` (left-padded, greedy) decodes the prompts in batches of b (in
order), each batch lasting as long as its longest row. forerun decodes the same prompts with at most b rows at once,
a finished row's place going to the next prompt (`--refill`, the default: what `forerun run --batch-size b` does),
or in generate's very batches, interleaved batch by batch (`--no-refill`). Reported per (b, method): new tokens
per second over all prompts, the ratio against plain batched generate at the same b, tokens per forward (per row),
and whether every row is identical to plain batched generate's row (fp32: it must be; bf16: rows may differ at
numerical ties, see forerun.exactness).

Example:
    forerun bench --batch-size 1,2,4,8 --methods plain,prompt_lookup,auto --n 4 --max-new-tokens 64
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from forerun.bench.datasets import BenchPrompt
from forerun.decoder import Decoder


@dataclass
class BatchRow:
    """One (batch size, method) cell of the table."""

    batch_size: int
    method: str
    new_tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    """Summed over rows: each row counts the forwards it took part in."""
    identical_rows: int = 0
    rows: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def left_padded(tokenizer, prompts: Sequence[BenchPrompt], device: torch.device) -> dict[str, torch.Tensor]:
    texts = [
        tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False) for p in prompts
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return {key: value.to(device) for key, value in batch.items()}


def new_rows(sequences: torch.Tensor, prompt_width: int, pad_id: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens, up to and including its first EOS (the pad after it dropped)."""
    out = []
    for row in sequences[:, prompt_width:].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        out.append(row[:cut])
    return out


def run_batched(
    model,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    make_decoders: Callable[[], dict[str, Decoder]],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    step: Callable[[str], None] | None = None,
    refill: bool = True,
    rounds: int = 1,
) -> list[BatchRow]:
    """The table's cells, generate's first at each batch size. Every batch size and round gets fresh decoders: a
    trie that had seen these very answers would flatter the next.

    refill: forerun decodes every prompt with at most b rows at once, a finished row's place going to the next
    prompt (`Decoder.generate(prompts, batch_size=b)`, what `forerun run --batch-size b` does), after generate's
    batches; otherwise it gets generate's very batches, interleaved batch by batch (both wait for their slowest
    row). rounds: each cell is the fastest of this many interleaved rounds (a shared machine's load comes and
    goes; the outputs are the same each round).
    """
    results: list[BatchRow] = []
    for size in batch_sizes:
        best: dict[str, BatchRow] = {}
        for _ in range(rounds):
            for cell in run_round(model, tokenizer, prompts, make_decoders(), size, max_new_tokens, step, refill):
                if cell.method not in best or cell.seconds < best[cell.method].seconds:
                    best[cell.method] = cell
        results += best.values()
    return results


def run_round(
    model,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    decoders: dict[str, Decoder],
    size: int,
    max_new_tokens: int,
    step: Callable[[str], None] | None,
    refill: bool,
) -> list[BatchRow]:
    """One round at batch size `size`: generate's cell, then each decoder's."""
    eos_config = model.generation_config.eos_token_id
    eos = {eos_config} if isinstance(eos_config, int) else set(eos_config or [])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos or {0})
    reference = BatchRow(size, "generate")
    cells = {name: BatchRow(size, name) for name in decoders}
    expected: list[list[int]] = []
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        inputs = left_padded(tokenizer, chunk, model.device)
        began = time.perf_counter()
        with torch.inference_mode():
            sequences = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
        reference.seconds += time.perf_counter() - began
        rows = new_rows(sequences, inputs["input_ids"].shape[1], pad_id, eos)
        expected += rows
        reference.new_tokens += sum(len(row) for row in rows)
        reference.forwards += sum(len(row) for row in rows)
        reference.rows += len(chunk)
        reference.identical_rows += len(chunk)
        if step:
            step(f"b={size} generate")
        if not refill:
            time_decoders(decoders, cells, chunk, rows, size, max_new_tokens, step)
    if refill:
        time_decoders(decoders, cells, prompts, expected, size, max_new_tokens, step)
    return [reference, *cells.values()]


def time_decoders(
    decoders: dict[str, Decoder],
    cells: dict[str, BatchRow],
    prompts: Sequence[BenchPrompt],
    expected: Sequence[list[int]],
    size: int,
    max_new_tokens: int,
    step: Callable[[str], None] | None,
) -> None:
    """Each decoder on `prompts` (at most `size` rows at once), timed and checked row by row into its cell."""
    messages = [list(p.messages) for p in prompts]
    for name, decoder in decoders.items():
        began = time.perf_counter()
        out = decoder.generate(messages, max_new_tokens, batch_size=size)
        cell = cells[name]
        cell.seconds += time.perf_counter() - began
        for result, tokens in zip(out, expected, strict=True):
            cell.new_tokens += len(result.new_tokens)
            cell.forwards += result.stats.forwards
            cell.rows += 1
            cell.identical_rows += result.new_tokens == tokens
        if step:
            step(f"b={size} {name}")


def markdown_table(rows: Sequence[BatchRow]) -> str:
    """| batch | method | tok/s | vs generate | tokens/forward | identical rows |"""
    lines = [
        "| batch | method | tok/s | vs batched generate | tokens/forward (per row) | identical rows |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    base = {row.batch_size: row.tokens_per_second for row in rows if row.method == "generate"}
    for row in rows:
        ratio = row.tokens_per_second / base[row.batch_size] if base.get(row.batch_size) else 0.0
        per_forward = "-" if row.method == "generate" else f"{row.tokens_per_forward:.2f}"
        lines.append(
            f"| {row.batch_size} | {row.method} | {row.tokens_per_second:.1f} | {ratio:.2f}x | {per_forward} | "
            f"{row.identical_rows}/{row.rows} |"
        )
    return "\n".join(lines)
