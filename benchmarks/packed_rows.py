"""A few rows computed as more (`forerun.base.packed_rows`): plain generate and forerun `auto`, each with the laid-out
layers computing every product as asked and with this CPU's row table, interleaved in one process (`load_model` gives
fp32 layers their table; for bf16 it is measured here, to show why it does not).

Per dtype: the table measured for the model (kept under ~/.cache/forerun/packed-rows/), then per prompt, in turn,
generate as asked, generate with the table, `auto` as asked, `auto` with the table (a fresh Decoder per
configuration, its own curve). Reported: tokens per second of each (summed times), the table's gain, and whether
every `auto` output is identical to generate of the same configuration (fp32) or first differs at a tie (bf16).

    python benchmarks/packed_rows.py --dtypes fp32,bf16 --n 2 --threads 1 \
        --out benchmarks/results/packed-rows-epyc-avx512.json
    python benchmarks/packed_rows.py --dtypes fp32 --n 1 --max-new-tokens 64 --batch-rows 2 --threads 1 \
        --out benchmarks/results/packed-rows-batch2-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forerun
from forerun.base.packed import PackedLinear, products, row_table
from forerun.base.packed_rows import rows_for
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.exactness import first_divergence
from forerun.measured import machine_label

DATASETS = ("gsm8k", "humaneval", "mbpp", "typehints")


def set_rows(model: torch.nn.Module, table: tuple[int, ...]) -> None:
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            layer.rows = table


def timed(call, *args, **kwargs):
    started = time.perf_counter()
    out = call(*args, **kwargs)
    return time.perf_counter() - started, out


def configured(dtype: str, method: str):
    """The model, its tokenizer, the two configurations ({name: row table}) and a Decoder of `method` for each."""
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=dtype)
    table = row_table(model) or rows_for(products(model))  # bf16: measured here (load_model gives only fp32 layers one)
    configs = {"as asked": (), "table": table}
    decoders = {}
    for name, rows in configs.items():
        set_rows(model, rows)  # each Decoder measures (or reads) the curve of its own configuration
        decoders[name] = forerun.Decoder(model, tokenizer, method)
    return model, tokenizer, configs, decoders


def run_dtype(dtype: str, n: int, new_tokens: int) -> dict:
    model, tokenizer, configs, decoders = configured(dtype, "auto")
    table = configs["table"]
    seconds = {f"{kind} {name}": 0.0 for kind in ("generate", "auto") for name in configs}
    tokens, same = dict.fromkeys(seconds, 0), {name: True for name in configs}
    prompts = [p for dataset in DATASETS for p in load_dataset(dataset, n)]
    for prompt in prompts:
        ids = encode(tokenizer, prompt, torch.device("cpu"))
        for name, rows in configs.items():
            set_rows(model, rows)
            greedy = {"max_new_tokens": new_tokens, "do_sample": False}
            spent, out = timed(model.generate, ids, **greedy, output_logits=True, return_dict_in_generate=True)
            expected = out.sequences[0, ids.shape[1] :].tolist()
            seconds[f"generate {name}"] += spent
            tokens[f"generate {name}"] += len(expected)
            spent, result = timed(decoders[name].generate, ids[0].tolist(), new_tokens)
            seconds[f"auto {name}"] += spent
            tokens[f"auto {name}"] += len(result.new_tokens)
            logits = torch.cat(out.logits).float()
            divergence = first_divergence(expected, result.new_tokens, logits, model.dtype)
            same[name] &= divergence is None or (dtype != "fp32" and divergence.is_tie)
    rates = {key: tokens[key] / seconds[key] for key in seconds}
    return {"table": list(table), "tokens_per_second": rates, "identical_or_tie": same, "prompts": len(prompts)}


def run_batch(dtype: str, rows: int, new_tokens: int, rounds: int = 3) -> dict:
    """forerun `plain` on one batch of `rows` GSM8K prompts, as asked and with the table, interleaved `rounds` times:
    a batch's undrafted step multiplies `rows` rows (2 rows: computed as the table says)."""
    model, _, configs, decoders = configured(dtype, "plain")
    prompts = [p.messages[-1]["content"] for p in load_dataset("gsm8k", rows)]
    spent, texts = dict.fromkeys(configs, 0.0), {}
    for _ in range(rounds):
        for name, table in configs.items():
            set_rows(model, table)
            seconds, results = timed(decoders[name].generate, prompts, new_tokens, chat=True)
            spent[name] += seconds
            texts[name] = [result.text for result in results]
    return {
        "rows": rows,
        "seconds": {k: v / rounds for k, v in spent.items()},
        "same_text": len(set(map(tuple, texts.values()))) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--n", type=int, default=2, help="Prompts per dataset (4 datasets).")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--batch-rows", type=int, default=0, help="Also time forerun `plain` on a batch of this many.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"machine": machine_label(torch.device("cpu")), "threads": args.threads, "dtypes": {}}
    print(f"{report['machine']}, {args.threads} thread(s), {args.max_new_tokens} new tokens")
    print("| dtype | table | generate as asked | generate, table | auto as asked | auto, table | identical |")
    print("|---|---|---:|---:|---:|---:|---|")
    for dtype in args.dtypes.split(","):
        found = run_dtype(dtype, args.n, args.max_new_tokens)
        report["dtypes"][dtype] = found
        r = found["tokens_per_second"]
        gain = {kind: r[f"{kind} table"] / r[f"{kind} as asked"] for kind in ("generate", "auto")}
        print(f"| {dtype} | {found['table'][1:4]} | {r['generate as asked']:.1f} | {r['generate table']:.1f} "
              f"({gain['generate']:.2f}x) | {r['auto as asked']:.1f} | {r['auto table']:.1f} ({gain['auto']:.2f}x) "
              f"| {found['identical_or_tie']} |", flush=True)  # fmt: skip
    if args.batch_rows:
        for dtype in args.dtypes.split(","):
            found = run_batch(dtype, args.batch_rows, args.max_new_tokens)
            report["dtypes"][dtype]["batch"] = found
            seconds = found["seconds"]
            print(f"{dtype}, `plain`, a batch of {args.batch_rows}: {seconds['as asked']:.2f} s as asked, "
                  f"{seconds['table']:.2f} s with the table ({seconds['as asked'] / seconds['table']:.2f}x), "
                  f"same text: {found['same_text']}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
