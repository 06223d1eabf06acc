"""The products a decode step of SmolLM2-135M's shapes calls, through four CPU kernels: bf16 laid out for oneDNN
(`load_model`'s bf16 layers where it measured faster), bf16 `F.linear`, fbgemm's u8 x s8 product (`quantize="w8a8"`)
and oneDNN's u8 x s8 product (`torch.ops.onednn.qlinear_pointwise`: AMX's int8 tiles where the CPU has them).

Each cell is the fastest of --repeats passes through 30 layers' products (q, k, v stacked; o; gate and up stacked;
down: 120 matrices, weights read from memory as in a forward) of `rows` rows, random weights. The integer kernels
take rows already in codes (each row quantized on its own, as `forerun.base.row_int8` does, so the kernel's scale for
the input is 1), through `row_int8`'s own packings and calls; the cost of quantizing the rows is not in these
figures. Both integer kernels must give the same numbers: their outputs are compared.

    python benchmarks/int8_kernels.py --threads 1 --out benchmarks/results/int8-kernels-xeon-amx.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from forerun.base.packed import lay_out
from forerun.base.row_int8 import packed_rows, tile_packing, tile_product
from forerun.base.row_int8 import product as fbgemm_product
from forerun.measured import machine_label

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
"""(out, in) of a SmolLM2-135M block's products, q/k/v and gate/up stacked, 30 blocks (the output matrix left out)."""


def fastest_pass(products: list, inputs: list[torch.Tensor], repeats: int) -> float:
    """Milliseconds of the fastest of `repeats` passes calling each product on its input, after one warm-up pass."""
    best = float("inf")
    for round_ in range(repeats + 1):
        started = time.perf_counter()
        for product, x in zip(products, inputs, strict=True):
            product(x)
        if round_:
            best = min(best, time.perf_counter() - started)
    return best * 1e3


def kernels(weights: list[torch.Tensor], rows: int) -> dict[str, tuple[list, list[torch.Tensor]]]:
    """Per kernel: (its products, their inputs of `rows` rows)."""
    inputs = [torch.randn(1, rows, w.shape[1], generator=torch.Generator().manual_seed(i)) for i, w in
              enumerate(weights)]  # fmt: skip
    codes = [torch.randint(-127, 128, x.shape, generator=torch.Generator().manual_seed(7)).float() for x in inputs]
    laid = [lay_out(w.bfloat16()) for w in weights]
    dense = [w.bfloat16() for w in weights]
    fbgemm = [packed_rows(w) for w in weights]  # `quantize="w8a8"`'s codes and packings, both kernels' the same
    onednn = [tile_packing(p) for p in fbgemm]
    fbgemm_op = fbgemm_product()

    return {
        "bf16 laid out": (
            [lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in laid],
            [x.bfloat16() for x in inputs],
        ),  # fmt: skip
        "bf16 F.linear": (
            [lambda x, w=w: torch.nn.functional.linear(x, w) for w in dense],
            [x.bfloat16() for x in inputs],
        ),  # fmt: skip
        "w8a8 fbgemm": ([lambda x, p=p: fbgemm_op(x, 1.0, 128, p) for p in fbgemm], codes),
        "w8a8 oneDNN": ([lambda x, t=t: tile_product(x, t) for t in onednn], codes),
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, width, generator=generator) * 0.02 for out, width in SHAPES]
    ms: dict[str, dict[int, float]] = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        found = kernels(weights, rows)
        (fb, fb_in), (dn, dn_in) = found["w8a8 fbgemm"], found["w8a8 oneDNN"]
        same = all(torch.equal(fb[i](fb_in[i]), dn[i](dn_in[i])) for i in range(4))  # bitwise
        assert same, "fbgemm's and oneDNN's integer products differ"
        for name, (products, inputs) in found.items():
            ms.setdefault(name, {})[rows] = fastest_pass(products, inputs, args.repeats)
    machine = machine_label(torch.device("cpu"))
    print(f"{machine}, {args.threads} thread(s), ms per pass through {len(SHAPES)} products")
    print("| kernel | " + " | ".join(f"{rows} rows" for rows in next(iter(ms.values()))) + " |")
    for name, cells in ms.items():
        print(f"| {name} | " + " | ".join(f"{value:.1f}" for value in cells.values()) + " |")
    if args.out:
        settings = {"machine": machine, "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__}
        args.out.write_text(json.dumps({"settings": settings, "ms": ms}, indent=1))


if __name__ == "__main__":
    main()
