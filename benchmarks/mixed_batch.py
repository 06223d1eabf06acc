"""A batch of one long document and short chat questions: attending row by row against the padded batch.

A batch's rows share one cache as long as its longest row. Beside a ~2000-token document, each short question's
queries read ~2000 keys, most of them padding; forerun's sdpa attention (`forerun.attention.by_rows`) attends such
a batch row by row from each row's first visible key. This runs the same batch (the document and `--short` chat
questions, `--batch-size` rows at once) on one model both ways, interleaved, `--rounds` times: as forerun runs it,
and with the row split turned off for the run (`row_starts` answering None: the padded batch as before); reports
the faster round of each, tokens per second over all rows, and whether every row equals plain greedy `generate`
of its prompt alone.

    python benchmarks/mixed_batch.py --methods plain,auto --threads 1 --dtype fp32 \
        --out benchmarks/results/mixed-batch-fp32-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import forerun
from forerun import attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_stall import long_document  # noqa: E402

WAYS = ("by rows", "padded")


def prompts(tokenizer, document_tokens: int, short: int) -> list[list[int]]:
    """The chat-templated document, then `short` chat questions, as token ids."""
    questions = [json.loads(line)["prompt"] for line in Path(__file__).with_name("chat_questions.jsonl").open()]
    texts = [long_document(tokenizer, document_tokens), *questions[:short]]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        for text in texts
    ]  # fmt: skip


def run(
    decoder: forerun.Decoder, rows: list[list[int]], new: int, batch: int, by_rows: bool
) -> tuple[float, list[list[int]]]:
    """Seconds for the batch and each row's new tokens; `by_rows=False`: the row split off for this run."""
    measured = attention.row_starts
    if not by_rows:
        attention.row_starts = lambda mask, rows: None
    try:
        started = time.perf_counter()
        results = decoder.generate(rows, new, batch_size=batch)
        return time.perf_counter() - started, [result.new_tokens for result in results]
    finally:
        attention.row_starts = measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="plain,auto")
    parser.add_argument("--document-tokens", type=int, default=2000)
    parser.add_argument("--short", type=int, default=3, help="chat questions beside the document")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=args.dtype)
    rows = prompts(tokenizer, args.document_tokens, args.short)
    alone = [
        model.generate(torch.tensor([row]), max_new_tokens=args.max_new_tokens, do_sample=False)[0, len(row) :]
        for row in rows
    ]
    lengths = [len(row) for row in rows]
    print(f"{args.dtype}, {args.threads} thread(s); prompts of {lengths} tokens, batch {args.batch_size}")
    records = []
    for method in args.methods.split(","):
        best: dict[str, float] = {}
        same: dict[str, int] = {}
        for _ in range(args.rounds):
            for name in WAYS:
                decoder = forerun.Decoder(model, tokenizer, method)
                seconds, texts = run(decoder, rows, args.max_new_tokens, args.batch_size, name == "by rows")
                best[name] = min(best.get(name, seconds), seconds)
                same[name] = sum(t == a.tolist() for t, a in zip(texts, alone, strict=True))
        tokens = len(rows) * args.max_new_tokens
        for name in WAYS:
            record = {"method": method, "attention": name, "seconds": round(best[name], 2),
                      "tokens_per_second": round(tokens / best[name], 1), "identical_rows": same[name],
                      "rows": len(rows), "speedup_vs_padded": round(best["padded"] / best[name], 3)}  # fmt: skip
            records.append(record)
            print(record, flush=True)
    if args.out:
        machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({"args": vars(args), **machine, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
