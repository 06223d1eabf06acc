"""What a decode step costs as the text grows: transformers' concatenating cache against forerun's in-place one.

transformers' `DynamicLayer` concatenates every forward's new keys and values onto the whole layer (a copy of the
cache, every layer, every step); forerun's `RoomyLayer` (the growing cache of every row, `DynamicBase` and
`RowCache`) writes them into spare slots. The half-precision configs (bf16, int4) attend in fp32 here, as
`load_model` has them where a CPU measured that faster; forerun then keeps their entries in fp32 too
(`RoomyLayer`'s `upcast`), where the attention would cast the whole cache up every forward; `in_place_own_dtype` is
the in-place cache without that. Each cell is the fastest of --repeats 1-token forwards after `context` cached
tokens, the caches interleaved in one process; their logits must be identical (asserted).

    python benchmarks/cache_growth.py --configs fp32,int4 --threads 1 \
        --out benchmarks/results/cache-growth-epyc-avx512.json
    python benchmarks/cache_growth.py --configs bf16,int4 --threads 1 \
        --out benchmarks/results/cache-growth-fp32-entries-xeon-amx.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from forerun.kvcache import roomy_cache
from forerun.models import load_model

CONTEXTS = (200, 1000, 2000, 4000)
FP32_ATTENTION = {"attn_implementation": "forerun_sdpa_fp32"}  # the half configs attend in fp32 on any CPU
CONFIGS = {
    "fp32": {"dtype": "fp32"},
    "bf16": {"dtype": "bf16"} | FP32_ATTENTION,
    "int4": {"dtype": "bf16", "quantize": "int4"} | FP32_ATTENTION,
}


def stepper(model: torch.nn.Module, cache: DynamicCache, ids: torch.Tensor, context: int, tokens: int = 1):
    """A function running one forward of `tokens` tokens after `context` cached ones (the text read into `cache` in
    chunks first; the step's entries dropped after it); returns its logits."""
    for start in range(0, context, 256):
        model(ids[:, start : min(start + 256, context)], past_key_values=cache, use_cache=True)
    fed, positions = ids[:, context : context + tokens], torch.arange(context, context + tokens)[None]

    def step() -> torch.Tensor:
        logits = model(input_ids=fed, past_key_values=cache, use_cache=True, position_ids=positions).logits
        for layer in cache.layers:  # a view of the leading slots: the in-place cache writes there again
            layer.keys, layer.values = layer.keys[..., :context, :], layer.values[..., :context, :]
        return logits

    return step


def own_dtype(cache: DynamicCache) -> DynamicCache:
    """`cache` with its in-place layers keeping entries in the model's dtype (as before fp32 entries)."""
    for layer in cache.layers:
        layer.upcast = False
    return cache


def measure(model: torch.nn.Module, repeats: int) -> list[dict]:
    """One row per context: the fastest step of each cache (ms) and their ratio."""
    ids = torch.randint(100, 1000, (1, max(CONTEXTS) + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for context in CONTEXTS:
        caches = {"concatenating": DynamicCache(config=model.config), "in_place": roomy_cache(model.config)}
        if any(getattr(layer, "upcast", False) for layer in caches["in_place"].layers):
            caches["in_place_own_dtype"] = own_dtype(roomy_cache(model.config))
        steps = {name: stepper(model, cache, ids, context) for name, cache in caches.items()}
        first = {name: step() for name, step in steps.items()}
        for name, logits in first.items():
            assert torch.equal(first["concatenating"], logits), f"the {name} cache changed the logits"
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
        best = {name: min(t) * 1e3 for name, t in times.items()}
        own = best.get("in_place_own_dtype")
        rows.append(
            {"context": context}
            | {f"{name}_ms": round(ms, 2) for name, ms in best.items()}
            | {"speedup": round(best["concatenating"] / best["in_place"], 3)}
            | ({} if own is None else {"fp32_entries_speedup": round(own / best["in_place"], 3)})
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", default="fp32,int4", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = {
        "model": args.model,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    with torch.inference_mode():
        for name in args.configs.split(","):
            print(name)
            model, _ = load_model(args.model, **CONFIGS[name])
            record[name] = measure(model, args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
