"""`forerun bench --batch-size 1,2,4,8`: aggregate throughput of batched decoding against plain batched generate.

For each batch size b, plain batched `model.generate` (left-padded, greedy) decodes the prompts in batches of b (in
order), each batch lasting as long as its longest row. forerun decodes the same prompts with at most b rows at once,
a finished row's place going to the next prompt (`--refill`, the default: what `forerun run --batch-size b` does),
or in generate's very batches, interleaved batch by batch (`--no-refill`). Reported per (b, method): new tokens
per second over all prompts, the ratio against plain batched generate at the same b, tokens per forward (per row),
and how many rows are identical to plain batched generate's, first differ at a numerical tie, or neither (fp32: every
row must be identical; bf16, 4-bit weights and w8a8: a row may first differ at a tie, judged on the model's logits
for generate's text, `row_verdict`; `forerun.exactness`).

Example:
    forerun bench --batch-size 1,2,4,8 --methods plain,prompt_lookup,auto --n 4 --max-new-tokens 64
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from forerun.bench.datasets import BenchPrompt
from forerun.decoder import Decoder
from forerun.exactness import Divergence, resolution, tie_reading

Judge = Callable[[BenchPrompt, list[int], list[int]], str]
"""(prompt, generate's row, forerun's row) -> "identical", "tie" or "other" (`row_verdict`)."""


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
    tied_rows: int = 0
    """Rows whose first difference from generate's is a numerical tie (low precision only)."""
    rows: int = 0
    beyond: list[str] = field(default_factory=list)
    """The prompts whose row differs from generate's other than at a tie: what the contract forbids."""

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


def row_verdict(model, tokenizer, prompt: BenchPrompt, expected: list[int], got: list[int]) -> str:
    """forerun's row `got` against plain batched generate's `expected` (new tokens, EOS included): "identical",
    "tie" where the first difference is a numerical tie on the model's logits for generate's text before it (one
    forward over it, or fed as a tree's root: `exactness.tie_reading`; the batch's own logits are not kept), else
    "other". fp32 (not w8a8) holds rows to identity: any difference is "other", and so is a row that is only shorter
    or longer than generate's (a stop misplaced, not a rounding).

    Example: `row_verdict(model, tokenizer, prompt, [5, 7, 2], [5, 9, 2])` reads the model's logits after the prompt
    and token 5, and calls it "tie" where tokens 7 and 9 score within `TIE_ULPS` there.
    """
    if got == expected:
        return "identical"
    position = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    if position is None or resolution(model) == torch.float32:
        return "other"
    ids = left_padded(tokenizer, [prompt], model.device)["input_ids"]
    unread = Divergence(position, expected[position], got[position], margin=math.nan, ulps=math.inf)
    return "tie" if tie_reading(model, ids, expected, unread) is not None else "other"


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

    def judge(prompt: BenchPrompt, expected: list[int], got: list[int]) -> str:
        return row_verdict(model, tokenizer, prompt, expected, got)

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
            time_decoders(decoders, cells, chunk, rows, size, max_new_tokens, step, judge)
    if refill:
        time_decoders(decoders, cells, prompts, expected, size, max_new_tokens, step, judge)
    return [reference, *cells.values()]


def time_decoders(
    decoders: dict[str, Decoder],
    cells: dict[str, BatchRow],
    prompts: Sequence[BenchPrompt],
    expected: Sequence[list[int]],
    size: int,
    max_new_tokens: int,
    step: Callable[[str], None] | None,
    judge: Judge,
) -> None:
    """Each decoder on `prompts` (at most `size` rows at once), timed, then each row judged (`judge`, untimed)
    against generate's into its cell."""
    messages = [list(p.messages) for p in prompts]
    for name, decoder in decoders.items():
        began = time.perf_counter()
        out = decoder.generate(messages, max_new_tokens, batch_size=size)
        cell = cells[name]
        cell.seconds += time.perf_counter() - began
        for prompt, result, tokens in zip(prompts, out, expected, strict=True):
            cell.new_tokens += len(result.new_tokens)
            cell.forwards += result.stats.forwards
            cell.rows += 1
            verdict = judge(prompt, tokens, list(result.new_tokens))
            cell.identical_rows += verdict == "identical"
            cell.tied_rows += verdict == "tie"
            if verdict == "other":
                cell.beyond.append(prompt.id)
        if step:
            step(f"b={size} {name}")


def markdown_table(rows: Sequence[BatchRow]) -> str:
    """| batch | method | tok/s | vs generate | tokens/forward | identical / tie / other rows |"""
    lines = [
        "| batch | method | tok/s | vs batched generate | tokens/forward (per row) | identical / tie / other rows |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    base = {row.batch_size: row.tokens_per_second for row in rows if row.method == "generate"}
    for row in rows:
        ratio = row.tokens_per_second / base[row.batch_size] if base.get(row.batch_size) else 0.0
        per_forward = "-" if row.method == "generate" else f"{row.tokens_per_forward:.2f}"
        lines.append(
            f"| {row.batch_size} | {row.method} | {row.tokens_per_second:.1f} | {ratio:.2f}x | {per_forward} | "
            f"{row.identical_rows} / {row.tied_rows} / {len(row.beyond)} |"
        )
    return "\n".join(lines)
