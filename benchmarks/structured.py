"""JSON answers (`response_format`) end to end: forerun's methods against plain `generate` with the same token mask
(forerun's `Constraint` as its `logits_processor`: what a transformers user holding answers to a schema with
llguidance runs), interleaved per prompt in one process, every greedy output checked against that generate's.

Two workloads, each a schema a client would send:
- `gsm8k`: a math question answered as {"steps": [up to 6 strings], "answer": a number};
- `mbpp`: a programming task described as {"function_name", "parameters": [{"name", "type"}], "returns",
  "summary"}, much of it copied from the task's own text (its test's call names the function and its arguments).

Also timed: plain `generate` without the mask on the same prompts (its answer differs: what the mask costs a step).

    python benchmarks/structured.py --n 10 --threads 1 --out benchmarks/results/structured-fp32-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from compiled_cpu import report  # a sibling script (`python benchmarks/structured.py` puts this folder first)
from transformers import LogitsProcessorList

import forerun
from forerun.bench.datasets import load_dataset

STEPS = {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 6}
SCHEMAS = {
    "gsm8k": {
        "type": "object",
        "properties": {"steps": STEPS, "answer": {"type": "number"}},
        "required": ["steps", "answer"],
        "additionalProperties": False,
    },
    "mbpp": {
        "type": "object",
        "properties": {
            "function_name": {"type": "string"},
            "parameters": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                    "required": ["name", "type"],
                    "additionalProperties": False,
                },
            },
            "returns": {"type": "string"},
            "summary": {"type": "string"},
        },
        "required": ["function_name", "parameters", "returns", "summary"],
        "additionalProperties": False,
    },
}
ASK = {
    "gsm8k": 'Solve this problem. Reply in JSON with "steps" (short sentences) and "answer" (a number).\n\n{}',
    "mbpp": "Describe the Python function this task asks for, in JSON: its name, its parameters with their types, "
    "what it returns and a one-line summary.\n\n{}",
}


def workload(tokenizer, name: str, n: int) -> list[tuple[torch.Tensor, dict]]:
    """(input_ids [1, L], response_format) for the first `n` prompts of a workload."""
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    out = []
    for prompt in load_dataset(name, n):
        messages = [{"role": "user", "content": ASK[name].format(prompt.messages[-1]["content"])}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out.append((ids["input_ids"], response_format))
    return out


def run(workloads: list[str], n: int, methods: list[str], new_tokens: int, dtype: str) -> dict:
    """Per (workload, method): tokens, seconds, forwards, per-prompt speedups over constrained generate, and how
    outputs compared with it (identical, or JSON that parses)."""
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=dtype)
    decoders = {(w, m): forerun.Decoder(model, tokenizer, m) for w in workloads for m in methods}
    for (name, _), decoder in decoders.items():  # the latency curve, llguidance's view of the tokenizer and the
        decoder.generate("Hi", 8)  # schema's grammar: built once per Decoder, outside every run
        decoder.grammars.compile({"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})
    eos = frozenset({tokenizer.eos_token_id})
    out = {}
    for name in workloads:
        labels = ["generate, no mask", "generate", *methods]
        out |= {f"{name}, {label}": {"tokens": 0, "seconds": 0.0, "forwards": 0, "speedups": [], "identical": 0,
                                      "json": 0} for label in labels}  # fmt: skip
        for ids, response_format in workload(tokenizer, name, n):
            started = time.perf_counter()
            free = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            add(out[f"{name}, generate, no mask"], free.shape[1] - ids.shape[1], time.perf_counter() - started)
            mask = decoders[name, methods[0]].grammars.constraint(response_format, ids.shape[1], eos)
            started = time.perf_counter()
            held = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                  logits_processor=LogitsProcessorList([mask]))  # fmt: skip
            seconds = time.perf_counter() - started
            tokens = held[0, ids.shape[1] :].tolist()
            add(out[f"{name}, generate"], len(tokens), seconds, 1.0, True, parses(tokenizer, tokens))
            for method in methods:
                started = time.perf_counter()
                result = decoders[name, method].generate(ids, new_tokens, response_format=response_format)
                took = time.perf_counter() - started
                row = out[f"{name}, {method}"]
                add(
                    row,
                    len(result.new_tokens),
                    took,
                    seconds / took,
                    result.new_tokens == tokens,
                    parses(tokenizer, tokens),
                )
                row["forwards"] += result.stats.forwards
            print(" ".join(f"[{k}] {v['tokens'] / v['seconds']:.1f}" for k, v in out.items() if k.startswith(name)))
    return out


def parses(tokenizer, tokens: list[int]) -> bool:
    """Whether the answer is JSON (an answer cut at the token limit is not)."""
    try:
        json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
    except ValueError:
        return False
    return True


def add(row: dict, tokens: int, seconds: float, speedup: float | None = None, same: bool = False, ok: bool = False):
    """One prompt's run into its row."""
    row["tokens"] += tokens
    row["seconds"] += seconds
    if speedup is not None:
        row["speedups"].append(speedup)
    row["identical"] += int(same)
    row["json"] += int(ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gsm8k,mbpp")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--methods", default="plain,prompt_lookup,auto")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report(run(args.workloads.split(","), args.n, args.methods.split(","), args.new_tokens, args.dtype), args)


if __name__ == "__main__":
    main()
