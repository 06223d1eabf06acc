"""Measure a model's forward-latency curve on this device, once, and keep it on disk for the cost model.

The curve (seconds per forward against tokens fed, with a cached context) depends on the architecture, the dtype,
the device and the thread count, not on the weights: it is measured at first use (a few seconds) and stored under
`~/.cache/forerun/latency/<key>.json`, the key naming exactly those. `forerun curve` measures it again and
overwrites the same file.

Sizes are measured interleaved (1, 2, 3, ... then again) and the fastest of the repeats is kept: on a shared
machine a burst of load only ever slows a forward down, so the minimum is the steadiest estimate of its cost.

Example:
    >>> curve = curve_for(model)                       # measured once, then read from the cache  # doctest: +SKIP
    >>> round(curve.relative(8), 2)                                                             # doctest: +SKIP
    1.68
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

from forerun.costmodel import LatencyCurve

DEFAULT_CACHE_DIR = Path("~/.cache/forerun")
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
CONTEXT = 256
"""Cached tokens before each measured forward: a realistic mid-answer length."""


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer stops when the tokens exist (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def curve_settings(model: torch.nn.Module) -> dict[str, object]:
    """What the curve depends on: the architecture's sizes, dtype, attention, device, threads, torch."""
    config = model.config.to_dict()
    shape = {k: v for k, v in sorted(config.items()) if isinstance(v, (int, float, str, bool)) and "name" not in k}
    device = next(model.parameters()).device
    return {
        "model": type(model).__name__,
        "architecture": shape,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attention": getattr(model.config, "_attn_implementation", None) or "eager",
        "device": device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
    }


def curve_key(settings: dict[str, object]) -> str:
    """A file name for `settings`: the model class, dtype, threads and a hash of the rest."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    threads = f"-t{settings['threads']}" if settings.get("threads") else ""
    return f"{settings['model']}-{settings['dtype']}{threads}-{digest}"


@torch.inference_mode()
def measure_curve(
    model: torch.nn.Module, sizes: Sequence[int] = SIZES, context: int = CONTEXT, repeats: int = 3, seed: int = 0
) -> LatencyCurve:
    """Time forwards of each size after `context` cached tokens; the fastest of `repeats` rounds per size."""
    if not sizes or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError("sizes must be >= 1, context >= 1 and repeats >= 1")
    sizes = sorted(set(int(n) for n in sizes) | {1})
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        context = max(1, min(context, limit - max(sizes)))
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
    return LatencyCurve(tuple(sizes), tuple(min(samples[n][1:]) for n in sizes))


def curve_path(model: torch.nn.Module, cache_dir: Path | str = DEFAULT_CACHE_DIR) -> Path:
    return Path(cache_dir).expanduser() / "latency" / f"{curve_key(curve_settings(model))}.json"


def save_curve(curve: LatencyCurve, path: Path, settings: dict[str, object]) -> None:
    """Write the curve as JSON (a temporary file renamed over the target: never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"settings": settings, **curve.as_dict()}, indent=1))
    temporary.replace(path)


def load_curve(path: Path) -> LatencyCurve | None:
    """The curve stored at `path`, or None if it is missing or unreadable (then it is measured again)."""
    try:
        return LatencyCurve.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def curve_for(model: torch.nn.Module, cache_dir: Path | str | None = DEFAULT_CACHE_DIR) -> LatencyCurve:
    """The model's curve on this device: read from `cache_dir`, else measured now and stored there.

    `cache_dir=None` measures without reading or writing any file.
    """
    if cache_dir is None:
        return measure_curve(model)
    path = curve_path(model, cache_dir)
    curve = load_curve(path)
    if curve is None:
        curve = measure_curve(model)
        try:
            save_curve(curve, path, curve_settings(model))
        except OSError:
            pass  # a read-only home: the curve still serves this process
    return curve
