"""An EAGLE-3 head in fewer bits (`load_head`'s default: as the target's weights where those are quantized, int4
over a dense target where the head computes in bf16 on a CPU) against the same head with dense bf16 weights, and
`auto` without a head, all in one process, interleaved per prompt.

Each prompt: plain generate of the quantized model (the reference), then every method in turn; speed is tokens per
second over the reference's on the same prompt, and each greedy output is judged against it (identical, or a first
difference at a numerical tie).

    .venv/bin/python benchmarks/head_weights.py --quantize int4 --n 12 --threads 1          # 12 chat questions
    .venv/bin/python benchmarks/head_weights.py --quantize int4 --dataset gsm8k,humaneval,mbpp,typehints --n 6
    .venv/bin/python benchmarks/head_weights.py --quantize none --dtype bf16 --n 12     # a dense bf16 target

(`benchmarks/results/head-weights-int4-epyc-avx2.md` holds both runs' tables.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import forerun
from forerun.base.weights import weights_kind
from forerun.bench.datasets import load_dataset
from forerun.bench.methods import BenchMethod
from forerun.bench.records import REFERENCE, Record
from forerun.bench.report import markdown, overview, summarize
from forerun.bench.runner import Run, encode
from forerun.drafters.eagle3 import load_head


def decoders(model, tokenizer, head: str) -> dict[str, forerun.Decoder]:
    """label -> decoder: auto without a head; eagle3 and auto with the quantized head, then with the dense one."""
    quantized, dense = load_head(head, model), load_head(head, model, quantized=False)
    made = {"auto (no head)": forerun.Decoder(model, tokenizer, "auto")}
    for label, loaded in ((f"{weights_kind(quantized)} head", quantized), ("dense bf16 head", dense)):
        for method in ("eagle3", "auto"):
            made[f"{method}, {label}"] = forerun.Decoder(model, tokenizer, method, draft_head=loaded)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", default="int4", choices=["int4", "int8", "none"], help="the target's weights")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="a dense target's dtype")
    parser.add_argument("--dataset", default="benchmarks/chat_questions.jsonl", help="comma-separated")
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head", default="smollm2-135m")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    model, tokenizer = forerun.load_model("smollm2-135m", quantize=quantize, dtype=args.dtype)
    made = decoders(model, tokenizer, args.head)
    prompts = [p for name in args.dataset.split(",") for p in load_dataset(name, args.n)]
    run = Run(model, args.max_new_tokens, None, 0)
    for decoder in made.values():  # every decoder's first request before anything is timed
        decoder.generate(encode(tokenizer, prompts[0], model.device), 8)
    records: list[Record] = []
    for index, prompt in enumerate(prompts):
        ids = encode(tokenizer, prompt, model.device)
        reference, seconds = run.hf(ids)
        new = reference.shape[1] - ids.shape[1]
        records.append(Record(prompt.id, prompt.dataset, REFERENCE, new, seconds, True, new, 1.0, None, 0.0, {}, 1.0))
        for label, decoder in made.items():
            records.append(run.one(ids, BenchMethod(label, "auto"), decoder, prompt, reference, seconds))
        print(f"{index + 1}/{len(prompts)} {prompt.id}", flush=True)
    summary = summarize(records)
    text = f"{overview(summary)}\n\n{markdown(summary)}"
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
