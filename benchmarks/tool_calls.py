"""Tool calls end to end: forerun's methods against plain `generate` from the same prompt (the tools shown by the
shipped `chatml-tools` template), holding the answer to calls with the same token mask (forerun's `Constraint` as
its `logits_processor`: what a transformers user forcing a call with llguidance runs), interleaved per prompt in
one process, every greedy output checked against that generate's, every call read back.

Three workloads, each an agent's step on a real dataset's task:
- `gsm8k`: a math question with a calculator and an answer tool ({"expression"}, {"answer": a number}), a call
  required (`tool_choice` required);
- `mbpp` and `humaneval`: a programming task with a Python runner ({"code"}), its call named (`tool_choice`
  {"type": "function", "function": {"name": "run_python"}}): the model writes the code into the call.

    python benchmarks/tool_calls.py --n 10 --threads 1 --new-tokens 256 \
        --out benchmarks/results/tool-calls-fp32-epyc-avx512.json
    python benchmarks/tool_calls.py --model qwen2.5-coder-0.5b --choice auto --n 10 --threads 1 --new-tokens 256 \
        --out benchmarks/results/tool-calls-auto-qwen05-fp32-epyc-avx512.json
    python benchmarks/tool_calls.py --model qwen2.5-coder-1.5b --choice auto --dtype bf16 --n 5 --threads 2 \
        --new-tokens 128 --methods plain,auto --out benchmarks/results/tool-calls-auto-qwen15-bf16-epyc-avx512.json

`--chat-template FILE` shows the tools through another template (one teaching Llama 3's bare JSON calls, say: a
required call is then held to that form). `--add-tokens A,B` adds special tokens the template's calls are marked
with where the model's tokenizer lacks them (LFM2's `<|tool_call_start|>`, on SmolLM2), the model's embeddings
grown to match (transformers' mean of the others: the same model for every run; its weights then stay as
transformers lays them out).

With `--choice auto` the model decides whether to call (nothing is held: the baseline is plain generate from the
same prompt); "calls" counts the answers it made calls in. `--strict` marks every function strict: under auto the
answer is free until it opens a call in the template's format, then held (the baseline is generate with that
lazy mask). Qwen2.5-Coder's own template takes tools. In bf16,
"ties" counts the answers that differ from generate's only from a numerical tie on (the low-precision contract,
`forerun.exactness`, read on one forward's logits).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from compiled_cpu import report  # a sibling script (`python benchmarks/tool_calls.py` puts this folder first)
from transformers import LogitsProcessorList

import forerun
from forerun.bench.datasets import load_dataset
from forerun.cli.common import read_chat_template
from forerun.exactness import Divergence, judged_by_one_forward
from forerun.tool_specs import shipped_template, takes_tools


def function(name: str, description: str, **properties: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties),
                  "additionalProperties": False}  # fmt: skip
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


CALCULATOR = function(
    "calculator", "Evaluate an arithmetic expression", expression={"type": "string", "maxLength": 200}
)
ANSWER = function("submit_answer", "Give the final answer", answer={"type": "number"})
RUNNER = function("run_python", "Run Python code and return what it prints", code={"type": "string"})
WORKLOADS = {
    "gsm8k": ([CALCULATOR, ANSWER], "required"),
    "mbpp": ([RUNNER], {"type": "function", "function": {"name": "run_python"}}),
    "humaneval": ([RUNNER], {"type": "function", "function": {"name": "run_python"}}),
}


def run(args: argparse.Namespace) -> dict:
    """Per (workload, method): tokens, seconds, forwards, per-prompt speedups over held generate, outputs identical
    to it, others first different at a tie (bf16), answers whose calls were read."""
    workloads, n, methods, new_tokens = args.workloads.split(","), args.n, args.methods.split(","), args.new_tokens
    # added tokens grow the embeddings, which a layout for oneDNN's kernels cannot: transformers' own then
    model, tokenizer = forerun.load_model(args.model, dtype=args.dtype, pack=False if args.add_tokens else None)
    if args.chat_template:  # a file, or a template forerun ships by name
        tokenizer.chat_template = read_chat_template(args.chat_template)
    if args.add_tokens:  # marks the template's calls need and this tokenizer lacks
        tokenizer.add_special_tokens({"additional_special_tokens": args.add_tokens.split(",")})
        model.resize_token_embeddings(len(tokenizer))
    elif not takes_tools(tokenizer):  # SmolLM2's own template takes no tools
        tokenizer.chat_template = shipped_template("chatml-tools")
    decoders = {m: forerun.Decoder(model, tokenizer, m) for m in methods}
    for decoder in decoders.values():  # the latency curve and llguidance's view of the tokenizer: once, untimed
        decoder.generate("Hi", 8)
    ends = frozenset({tokenizer.eos_token_id})
    out = {}
    for name in workloads:
        tools, choice = WORKLOADS[name]
        choice = args.choice or choice
        if args.strict:  # OpenAI's per-function flag: under auto, a call the answer opens is held from there
            tools = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in tools]
        out |= {f"{name}, {label}": {"tokens": 0, "seconds": 0.0, "forwards": 0, "speedups": [], "identical": 0,
                                      "ties": 0, "calls": 0} for label in ["generate", *methods]}  # fmt: skip
        for prompt in load_dataset(name, n):
            messages = [prompt.messages[-1]]
            request = forerun.GenerationRequest(messages, new_tokens, tools=tools, tool_choice=choice)
            ids = decoders[methods[0]].encode(messages, tools=tools)
            masks = []
            if request.held_format is not None:
                masks.append(decoders[methods[0]].grammars.constraint(request.held_format, ids.shape[1], ends))
            started = time.perf_counter()
            held = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                  logits_processor=LogitsProcessorList(masks))  # fmt: skip
            seconds = time.perf_counter() - started
            tokens = held[0, ids.shape[1] :].tolist()
            add(out[f"{name}, generate"], len(tokens), seconds, 1.0, True, False)
            for method in methods:
                started = time.perf_counter()
                result = decoders[method].generate(request)
                took = time.perf_counter() - started
                row = out[f"{name}, {method}"]
                add(
                    row,
                    len(result.new_tokens),
                    took,
                    seconds / took,
                    result.new_tokens == tokens,
                    bool(result.tool_calls),
                )
                row["forwards"] += result.stats.forwards
                row["ties"] += int(result.new_tokens != tokens and at_a_tie(model, ids, tokens, result.new_tokens))
            print(" ".join(f"[{k}] {v['tokens'] / v['seconds']:.1f}" for k, v in out.items() if k.startswith(name)))
    return out


def at_a_tie(model, ids, reference: list[int], other: list[int]) -> bool:
    """Whether two greedy answers first differ where the model's logits (one forward over the prompt and the
    reference's tokens before it) hold a tie (`forerun.exactness`): the low-precision contract."""
    position = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), None)
    if position is None:  # one stopped earlier: no difference where both wrote
        return True
    found = Divergence(position, reference[position], other[position], 0.0, 0.0)
    return judged_by_one_forward(model, ids, reference, found).is_tie


def add(row: dict, tokens: int, seconds: float, speedup: float, same: bool, called: bool) -> None:
    """One prompt's run into its row."""
    row["tokens"] += tokens
    row["seconds"] += seconds
    row["speedups"].append(speedup)
    row["identical"] += int(same)
    row["calls"] += int(called)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--choice", default=None, help="tool_choice for every workload (default: each one's own)")
    parser.add_argument("--workloads", default="gsm8k,mbpp,humaneval")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--methods", default="plain,prompt_lookup,auto")
    parser.add_argument("--strict", action="store_true", help="mark every function strict (held once called)")
    parser.add_argument("--chat-template", default=None, help="a template file, or a shipped template's name")
    parser.add_argument("--add-tokens", default="", help="special tokens to add (comma-separated), embeddings grown")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report(run(args), args)


if __name__ == "__main__":
    main()
