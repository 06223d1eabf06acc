"""`quantize="w8a8"` (`forerun.base.row_int8`) beside `quantize="int4"`: the products, a forward's steps, and how
far each sits from the fp32 model.

llama.cpp multiplies its 4-bit blocks by activations quantized to 8 bits (a scale per 32 values) in integer dot
products; forerun's 4-bit kernel (tinygemm, `_weight_int4pack_mm_for_cpu`) unpacks each weight to bf16 and
multiplies in fp32, compute-bound for one row and steeper still for a tree's rows. w8a8 multiplies 8-bit rows (a
scale per row) by 8-bit weights in fbgemm's integer product.

- `products`: one [8960, 1536] matrix (Qwen2.5-1.5B's MLP), 24 copies read in turn (beyond the caches, as a
  forward reads its weights), by rows: tinygemm 4-bit (bf16 activations), w8a8's layer (no measured activations),
  dense bf16; ms per matrix, the fastest quarter's mean. `exactness`: rows computed together equal rows computed
  alone, and the distance from the integer sums computed in float64.
- `steps`: a forward of 1, 4 and 16 tokens after 200 cached ones, `load_model`'s int4 and w8a8 models,
  interleaved, the fastest of N (1 thread).
- `tokens`: as `int4_fidelity.py`: at every position of real text, whether the argmax is the fp32 model's, and the
  mean KL from it, for `int4`, `w8a8`, and `rows_only` (w8a8's layers without measured activations: one scale per
  row for every channel, the control for smoothing).

    python benchmarks/int8_activations.py --model qwen2.5-coder-1.5b --n 4 --length 384 --steps 4 \
        --out benchmarks/results/int8-activations-qwen2.5-coder-1.5b-epyc.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import time
from pathlib import Path

import torch
from int4_fidelity import (  # sibling scripts (`python benchmarks/x.py` puts its folder first)
    interleaved_steps,
    next_tokens,
    texts,
)

from forerun.base.kernels import replace_linears
from forerun.base.row_int8 import LEVELS, RowInt8Linear
from forerun.models import load_model


def rows_only(model: torch.nn.Module) -> torch.nn.Module:
    """Every plain linear layer of fp32 `model` (the output matrix too) as a RowInt8Linear without measured
    activations: a row's one scale for all its channels (the control for smoothing)."""
    replace_linears(model, RowInt8Linear)
    return model


def best(call, repeats: int = 20) -> float:
    """ms of `call`: the mean of the fastest quarter of `repeats` runs after two warm ones."""
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    fastest = sorted(times)[: max(1, repeats // 4)]
    return sum(fastest) / len(fastest) * 1e3


def layer_of(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free fp32 linear layer holding `weight` [out, in]."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
    linear.weight.copy_(weight)
    return linear


def exact_rows(layer: RowInt8Linear, x: torch.Tensor) -> dict:
    """Whether `layer`'s rows of `x` [rows, in] equal the same rows fed one at a time, and the largest distance of its
    output from the integer sums computed in float64 (a saturated sum would show as a large one)."""
    together = layer(x)
    alone = torch.cat([layer(row[None]) for row in x])
    scale = x.abs().amax(-1, keepdim=True) / LEVELS
    codes, weights = (x / scale).round().double(), torch.ops.quantized.linear_unpack(layer.packed)[0]
    exact = codes @ weights.int_repr().double().T * weights.q_per_channel_scales()[None] * scale.double()
    return {"rows_alone_equal": bool(torch.equal(together, alone)), "max_error": float((together - exact).abs().max())}


def products(copies: int = 24) -> dict:
    """ms per [8960, 1536] matrix by rows, three ways (module docstring), and the integer product's exactness."""
    n, k = 8960, 1536
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    lines = [RowInt8Linear(layer_of(weight)) for _ in range(copies)]
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1) for _ in range(copies)]
    scales = torch.randn(k // 32, n, 2, dtype=torch.bfloat16)
    dense = [weight.bfloat16() for _ in range(copies)]
    found = []
    for rows in (1, 2, 4, 8, 16, 32):
        x = torch.randn(rows, k)
        low = x.bfloat16()
        ways = {
            "int4_tinygemm": lambda low=low: [
                torch.ops.aten._weight_int4pack_mm_for_cpu(low, p, 32, scales) for p in packed
            ],
            "int8_rows": lambda x=x: [line(x) for line in lines],
            "bf16_dense": lambda low=low: [low @ w.T for w in dense],
        }
        found.append({"rows": rows} | {way: round(best(call) / copies, 3) for way, call in ways.items()})
        print(found[-1], flush=True)
    return {"ms": found, "exactness": exact_rows(lines[0], torch.randn(8, k) * 3)}


def steps(name: str, repeats: int) -> list[dict]:
    """ms per forward of 1, 4 and 16 tokens after 200 cached: `load_model`'s int4 and w8a8."""
    return interleaved_steps({way: load_model(name, quantize=way)[0] for way in ("int4", "w8a8")}, repeats)


def fidelity(name: str, n: int, length: int) -> dict:
    """The `tokens` section (module docstring): one quantized model at a time beside the fp32 one."""
    reference, tokenizer = load_model(name, dtype="fp32", pack=False)
    builds = {
        "int4": lambda: load_model(name, quantize="int4")[0],
        "rows_only": lambda: rows_only(copy.deepcopy(reference)),
        "w8a8": lambda: load_model(name, quantize="w8a8")[0],
    }
    found = {}
    for way, build in builds.items():
        shares = next_tokens(reference, {way: build()}, tokenizer, texts(n), length)
        found[way], found["positions"] = shares[way], shares["positions"]
        print(way, found[way], flush=True)
        gc.collect()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="for `tokens` (products and steps: 1 thread)")
    parser.add_argument("--n", type=int, default=4, help="texts per dataset (0: none)")
    parser.add_argument("--length", type=int, default=512, help="tokens read per text, at most")
    parser.add_argument("--steps", type=int, default=5, help="time steps, the fastest of this many (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = {"model": args.model, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    torch.set_num_threads(1)
    with torch.inference_mode():
        record["products"] = products()
        if args.steps:
            record["steps"] = steps(args.model, args.steps)
    if args.n:
        torch.set_num_threads(args.threads)
        record["tokens"] = fidelity(args.model, args.n, args.length)
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
