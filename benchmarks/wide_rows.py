"""Many rows through 4- and 8-bit weights: the weight-only kernel against the weights unpacked to bf16
(`forerun.base.unpacked`), per matrix by rows and for whole prompts, interleaved.

- `matrix`: one of SmolLM2-135M's MLP matrices (1536 x 576) at 1-2048 rows: the quantized kernel, the unpacked
  product (unpacking included), and a dense bf16 product of the same shape (what unpacking leads to);
- `prefill`: SmolLM2-135M reading prompts of 128-2000 tokens of real text (HumanEval's prompts, joined) with its
  layers' kernels only and with the unpacked product from `WIDE_ROWS` rows (`load_model`'s default), and the dense
  bf16 model beside them; the last position's logits are compared (their argmax, and the largest difference);
- `batch`: one forward of 8 rows x 16 tokens after 200 cached ones each (a batch's wide step: 128 rows), both ways;
- `tree`: one forward of a single row's 32 tokens after 200 cached ones (8-bit weights take it unpacked), both ways.

Each cell is the fastest of --repeats, the ways interleaved.

    python benchmarks/wide_rows.py --threads 1 --out benchmarks/results/wide-rows-epyc.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from forerun.base.kernels import KernelLinear
from forerun.bench.datasets import load_dataset
from forerun.kvcache import roomy_cache
from forerun.models import load_model

ROWS = (1, 8, 32, 64, 128, 256, 512, 2048)
PROMPTS = (128, 512, 2000)


def fastest(run, repeats: int, *args) -> float:
    """The fastest of `repeats` calls of `run(*args)`, in ms (one call first, to warm)."""
    run(*args)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def layers_of(model: torch.nn.Module) -> list[KernelLinear]:
    return [module for module in model.modules() if isinstance(module, KernelLinear)]


def set_wide(layers: list[KernelLinear], wides: list, on: bool) -> None:
    for layer, wide in zip(layers, wides, strict=True):
        layer.wide = wide if on else None


def matrix_rows(layer: KernelLinear, repeats: int) -> list[dict]:
    """The kernel, the unpacked product and a dense bf16 product of the layer's shape, by rows."""
    dense = torch.randn(layer.out_features, layer.in_features).to(torch.bfloat16)
    rows = []
    for count in ROWS:
        x = torch.randn(count, layer.in_features).to(torch.bfloat16)
        rows.append({
            "rows": count,
            "kernel_ms": fastest(layer.product, repeats, x, *layer.operands),
            "unpacked_ms": fastest(layer.wide.product, repeats, x, *layer.operands),
            "dense_bf16_ms": fastest(torch.nn.functional.linear, repeats, x, dense),
        })  # fmt: skip
    return rows


def prefill(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, cache=roomy_cache(model.config), use_cache=True, logits_to_keep=1).logits[0, -1]


def batch_step(model: torch.nn.Module, ids: torch.Tensor, rows: int = 8, tokens: int = 16, context: int = 200):
    """A function running one forward of `rows` x `tokens` new tokens after `context` cached ones a row."""
    batch = ids[:, :context].expand(rows, -1).contiguous()
    cache = roomy_cache(model.config)
    with torch.inference_mode():
        model(batch, cache=cache, use_cache=True, logits_to_keep=1)
    fed = ids[:, context : context + tokens].expand(rows, -1).contiguous()
    positions = torch.arange(context, context + tokens)[None].expand(rows, -1)

    def step() -> None:
        with torch.inference_mode():
            model(input_ids=fed, cache=cache, use_cache=True, position_ids=positions, logits_to_keep=tokens)
        cache.crop(-tokens)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bits", default="int4,int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense, tokenizer = load_model(args.model, dtype="bf16")
    text = "\n".join(prompt.messages[-1]["content"] for prompt in load_dataset("humaneval", 60))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : max(PROMPTS)]
    out = {"env": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                   "torch": torch.__version__, "model": args.model}, "bits": {}}  # fmt: skip
    for bits in args.bits.split(","):
        model, _ = load_model(args.model, quantize=bits)
        layers = layers_of(model)
        wides = [layer.wide for layer in layers]
        found = {"matrix": matrix_rows(model.model.layers[0].mlp.gate_proj, args.repeats), "prefill": []}
        for length in PROMPTS:
            prompt = ids[:, :length]
            row = {"tokens": length}
            for way, on in (("kernel", False), ("unpacked", True)):
                set_wide(layers, wides, on)
                row[f"{way}_ms"] = fastest(prefill, args.repeats, model, prompt)
                row[f"{way}_logits"] = prefill(model, prompt)
            row["dense_bf16_ms"] = fastest(prefill, args.repeats, dense, prompt)
            kernel, unpacked = row.pop("kernel_logits"), row.pop("unpacked_logits")
            row["same_argmax"] = bool(kernel.argmax() == unpacked.argmax())
            row["largest_logit_difference"] = float((kernel.float() - unpacked.float()).abs().max())
            found["prefill"].append(row)
            print(bits, json.dumps(row), flush=True)
        for way, on in (("kernel", False), ("unpacked", True)):
            set_wide(layers, wides, on)
            found[f"batch_8x16_{way}_ms"] = fastest(batch_step(model, ids), args.repeats)
            found[f"tree_1x32_{way}_ms"] = fastest(batch_step(model, ids, rows=1, tokens=32), args.repeats)
        set_wide(layers, wides, True)
        out["bits"][bits] = found
        print(bits, json.dumps({k: v for k, v in found.items() if k != "prefill"}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
