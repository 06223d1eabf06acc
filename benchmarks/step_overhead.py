"""What a quantized CPU step costs beyond its products: one forward on the growing cache, three ways, interleaved.

- `subclass`: each linear layer's `F.linear` dispatched through torchao's tensor subclass (torchao's own path);
- `direct`: forerun's `KernelLinear` calling the same ATen kernel on the same operands (`load_model`'s default);
- `compiled` (with --compiled): `direct` with the whole forward through `torch.compile` (inductor, dynamic shapes),
  the module guards skipped; minutes of compiling, and its fused kernels round differently from eager.

Each cell is the fastest of --repeats forwards of `tokens` new tokens after `context` cached ones (the cache cropped
back after each). `subclass` and `direct` must give identical logits (asserted); `compiled` reports whether it did.

    python benchmarks/step_overhead.py --quantize int4 --threads 1 --compiled \
        --out benchmarks/results/step-overhead-int4-epyc.json
    python benchmarks/step_overhead.py --quantize int4 --threads 1 --compiled --cpp-wrapper --repeats 7 \
        --out benchmarks/results/step-overhead-int4-cpp-wrapper-epyc.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from forerun.base.kernels import KernelLinear
from forerun.models import load_model

SHAPES = ((200, 1), (200, 2), (200, 4), (200, 8), (400, 1))
"""(cached tokens, tokens fed) per cell."""


def subclass_dispatch(model: torch.nn.Module) -> torch.nn.Module:
    """Give `model` plain `nn.Linear` layers over the same packed weights (torchao's dispatch), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, KernelLinear):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
    return model


def stepper(model: torch.nn.Module, forward, ids: torch.Tensor, context: int, tokens: int):
    """A function running one forward of `tokens` tokens after `context` cached ones; returns its logits."""
    cache = DynamicCache()
    for start in range(0, context, 64):  # chunks under `unpacked`'s rows: every way reads the text through its kernel
        model(ids[:, start : min(start + 64, context)], past_key_values=cache, use_cache=True)
    fed, positions = ids[:, context : context + tokens], torch.arange(context, context + tokens)[None]

    def step() -> torch.Tensor:
        logits = forward(input_ids=fed, past_key_values=cache, use_cache=True, position_ids=positions).logits
        cache.crop(-tokens)
        return logits

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="int4", choices=("int4", "int8"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compiled", action="store_true", help="also time the compiled forward (minutes)")
    wrapper_help = "compile with inductor's C++ wrapper (no Python between its kernels; ~10 min cold)"
    parser.add_argument("--cpp-wrapper", action="store_true", help=wrapper_help)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    direct, _ = load_model(args.model, quantize=args.quantize)
    subclass = subclass_dispatch(load_model(args.model, quantize=args.quantize)[0])
    ways = {"subclass": (subclass, subclass.forward), "direct": (direct, direct.forward)}
    ids = torch.randint(100, 1000, (1, 512), generator=torch.Generator().manual_seed(0))
    compile_seconds = None
    with torch.inference_mode():
        if args.compiled:
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            options |= {"cpp_wrapper": True} if args.cpp_wrapper else {}
            ways["compiled"] = (direct, torch.compile(direct.forward, dynamic=True, options=options))
            started = time.perf_counter()
            for context, tokens in SHAPES:
                stepper(direct, ways["compiled"][1], ids, context, tokens)()
            compile_seconds = time.perf_counter() - started
        rows = []
        for context, tokens in SHAPES:
            steps = {name: stepper(model, forward, ids, context, tokens) for name, (model, forward) in ways.items()}
            first = {name: step() for name, step in steps.items()}
            assert torch.equal(first["subclass"], first["direct"]), "direct kernels changed the logits"
            times: dict[str, list[float]] = {name: [] for name in steps}
            for _ in range(args.repeats):
                for name, step in steps.items():
                    started = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - started)
            row = {"context": context, "tokens": tokens} | {f"{n}_ms": round(min(t) * 1e3, 2) for n, t in times.items()}
            if "compiled" in first:
                row["compiled_identical"] = bool(torch.equal(first["compiled"], first["direct"]))
            rows.append(row)
            print(row)
    record = {
        "model": args.model,
        "quantize": args.quantize,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "compile_seconds": compile_seconds,
        "cpp_wrapper": args.cpp_wrapper,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
