"""Two attention implementations of the same model on a CPU, interleaved in one process: by default, in bf16,
transformers' sdpa against forerun's fp32 sdpa; `--dtype fp32 --attentions sdpa,forerun_sdpa`: transformers' sdpa
against forerun's grouped sdpa (`forerun.attention`).

Both models are the same weights; for every prompt each runs plain `generate` and forerun `auto`, in turn, so a
busy machine slows all four alike. Prints tokens per second over all prompts (the prefill included), how many of
forerun's outputs equal its own model's generate (in fp32: all of them), and how many others first differ at a tie
(`forerun.exactness`).

    python benchmarks/attention_ab.py --n 3 --threads 1 --out benchmarks/results/attention-ab-epyc.json
    python benchmarks/attention_ab.py --dtype fp32 --attentions sdpa,forerun_sdpa --n 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forerun
from forerun.attention import SDPA_FP32
from forerun.bench.datasets import load_dataset
from forerun.exactness import first_divergence

DATASETS = ("gsm8k", "humaneval", "mbpp", "typehints")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantize", default="", help="int4 or int8 weights (bf16 activations) on both sides")
    parser.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    parser.add_argument("--attentions", default=f"sdpa,{SDPA_FP32}", help="the two implementations, comma-separated")
    parser.add_argument("--out", default="attention-ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantize = args.quantize or None
    names = args.attentions.split(",")
    models = {name: forerun.load_model("smollm2-135m", name, args.dtype, quantize=quantize) for name in names}
    tokenizer = models[names[0]][1]
    decoders = {name: forerun.Decoder(model, tokenizer, "auto") for name, (model, _) in models.items()}
    prompts = [p for name in DATASETS for p in load_dataset(name, args.n)]
    totals = {f"{kind} {name}": [0, 0.0] for name in models for kind in ("generate", "auto")}
    identical, ties = dict.fromkeys(models, 0), dict.fromkeys(models, 0)
    for decoder in decoders.values():  # warm-up: curves, output-matrix layout, first calls
        decoder.generate(list(prompts[0].messages), 16)
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for name, (model, _) in models.items():
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
            seconds = time.perf_counter() - started
            reference = out.sequences
            new = reference.shape[1] - ids.shape[1]
            totals[f"generate {name}"][0] += new
            totals[f"generate {name}"][1] += seconds
            started = time.perf_counter()
            result = decoders[name].generate(ids, args.max_new_tokens)
            totals[f"auto {name}"][0] += len(result.new_tokens)
            totals[f"auto {name}"][1] += time.perf_counter() - started
            identical[name] += torch.equal(result.sequences, reference)
            expected = reference[0, ids.shape[1] :].tolist()
            divergence = first_divergence(expected, result.new_tokens, [row[0] for row in out.logits], model.dtype)
            ties[name] += divergence is not None and divergence.is_tie
    rows = {label: tokens / seconds for label, (tokens, seconds) in totals.items()}
    for label, rate in rows.items():
        print(f"{label:32s} {rate:6.1f} tokens/s")
    print(f"forerun identical to its model's generate: {identical}, first difference a tie: {ties}, of {len(prompts)}")
    record = {"threads": args.threads, "dtype": args.dtype, "quantize": quantize, "prompts": len(prompts),
              "tokens_per_second": rows, "identical": identical, "ties": ties}  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
