"""One forward of a tree under a mask, transformers' sdpa against forerun's grouped sdpa (`forerun.attention`), by
cached tokens and nodes fed: the same model's two attentions interleaved in one process, the median of 11 each,
and the largest difference between their logits (0.0: the same numbers).

    python benchmarks/grouped_attention.py --threads 1 --out benchmarks/results/grouped-attention-epyc-avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import forerun
from forerun.attention import SDPA_GROUPED


def forward_ms(model, cache, ids: torch.Tensor, cached: int) -> tuple[float, torch.Tensor]:
    """(ms, logits) of one forward of `ids` [1, nodes], a causal chain under a 4-D bool mask; the cache cut back."""
    nodes = ids.shape[1]
    mask = torch.ones(1, 1, nodes, cached + nodes, dtype=torch.bool)
    mask[..., cached:] = torch.ones(nodes, nodes, dtype=torch.bool).tril()
    positions = torch.arange(cached, cached + nodes)[None]
    started = time.perf_counter()
    logits = model(ids, past_key_values=cache, attention_mask=mask, position_ids=positions).logits
    seconds = time.perf_counter() - started
    cache.crop(-nodes)
    return seconds * 1e3, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--out", default="grouped-attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {name: forerun.load_model("smollm2-135m", name, args.dtype)[0] for name in ("sdpa", SDPA_GROUPED)}
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for cached in (300, 1000, 2000):
            prompt = torch.randint(100, 40000, (1, cached), generator=generator)
            caches = {name: DynamicCache(config=model.config) for name, model in models.items()}
            for name, model in models.items():
                model(prompt, past_key_values=caches[name])
            for nodes in (1, 8, 32):
                ids = torch.randint(100, 40000, (1, nodes), generator=generator)
                times, logits = {name: [] for name in models}, {}
                for _ in range(11):
                    for name, model in models.items():
                        ms, logits[name] = forward_ms(model, caches[name], ids, cached)
                        times[name].append(ms)
                row = {"cached": cached, "nodes": nodes, **{f"{n} ms": statistics.median(t) for n, t in times.items()}}
                row["max |difference|"] = float((logits["sdpa"] - logits[SDPA_GROUPED]).abs().max())
                print(row, flush=True)
                rows.append(row)
    record = {"threads": args.threads, "dtype": args.dtype, "model": "smollm2-135m", "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
