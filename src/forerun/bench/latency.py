"""The forward-latency curve of a model on this device: seconds per forward vs tokens fed, with a cached context.

Draft budgets follow this curve: a drafter pays off only when the extra accepted tokens outweigh what the extra
input tokens cost. On a CPU the cost grows with every token; on a GPU it is nearly flat up to dozens of tokens.

Sizes are measured interleaved (1, 2, 4, ... then again), and the median of the repeats is kept, so a burst of
load on a shared machine does not land on one size only.

Example:
    >>> curve = latency_curve(model, sizes=(1, 2, 4, 8, 16), context=300, repeats=7)   # doctest: +SKIP
    >>> curve["relative"]                                                                # doctest: +SKIP
    {1: 1.0, 2: 1.07, 4: 1.31, 8: 1.52, 16: 2.03}
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

from forerun.bench.runner import synchronize

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@torch.inference_mode()
def latency_curve(
    model: torch.nn.Module, sizes: Sequence[int] = SIZES, context: int = 300, repeats: int = 7, seed: int = 0
) -> dict:
    """{"sizes", "seconds" (median per size), "relative" (to the smallest size), "context", "repeats"}."""
    if not sizes or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError("sizes must be >= 1, context >= 1 and repeats >= 1")
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, context + max(sizes)), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    model(ids[:, :context], past_key_values=cache, use_cache=True)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for n in sizes:
            positions = torch.arange(context, context + n, device=device).unsqueeze(0)
            synchronize(device)
            started = time.perf_counter()
            model(ids[:, context : context + n], past_key_values=cache, position_ids=positions, use_cache=True)
            synchronize(device)
            samples[n].append(time.perf_counter() - started)
            cache.crop(-n)  # back to the context (negative: drop the last n)
    seconds = {n: statistics.median(values[1:]) for n, values in samples.items()}
    base = seconds[min(sizes)]
    return {
        "sizes": list(sizes),
        "seconds": seconds,
        "relative": {n: round(s / base, 3) for n, s in seconds.items()},
        "context": context,
        "repeats": repeats,
    }


def write_curve(curve: dict, settings: dict, out: Path) -> list[Path]:
    """latency.json and latency.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "latency.json", out / "latency.png"]
    paths[0].write_text(json.dumps({"settings": settings, **curve}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = curve["sizes"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(sizes, [curve["relative"][n] for n in sizes], marker="o", label="measured")
    ax.plot(sizes, sizes, linestyle=":", color="grey", label="proportional to tokens")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, max(curve["relative"].values()) * 1.15)
    ax.set_xlabel("tokens fed in one forward")
    ax.set_ylabel("latency / latency of 1 token")
    ax.set_title(f"{settings.get('model', '')}, {curve['context']} cached tokens, {settings.get('device', '')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
