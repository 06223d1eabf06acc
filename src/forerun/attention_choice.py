"""Whether this CPU attends a half-precision model faster in the model's own dtype than in fp32: measured once, not
assumed from the CPU's kind.

PyTorch's CPU flash-attention kernel in bf16 cost a fixed ~0.14 ms a call on an AVX-512 EPYC (one query over 200
keys: 140 us, against 21 us in fp32), so `load_model` has attended bf16 and fp16 models in fp32 on the CPU
(`attention.SDPA_FP32`). On an Intel Xeon with AMX the same kernel in bf16 was the faster at every size measured,
more so as the text grows (docs/benchmarks.md). So `load_model(attn_implementation="auto")` measures: one step's
attention calls both ways, on the model's own head shapes, over as many layers' keys and values as a forward reads
(so they come from memory, as in a forward), at a few cache lengths and tree sizes; where the model's own dtype is
no slower it attends in it (`attention.SDPA_GROUPED`). The fp32 side is timed as forerun runs it: keys and values
held in fp32 by the growing cache (`kvcache.RoomyLayer`), the query cast up and the output down.

The answer is kept under `~/.cache/forerun/attention-choice/`, per head shapes, dtype, CPU, thread count and torch
version. Both ways compute what plain `generate` of the same model computes, since the choice is the model's.

Example (a model of 2 layers, 4 query heads over 2 key/value heads of 16; the answer depends on this CPU):
    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    >>> attention_shapes(config)
    {'layers': 2, 'heads': 4, 'kv_heads': 2, 'head_dim': 16, 'latent': False}
    >>> half_attention_pays(config, torch.bfloat16, cache_dir=None) in (True, False)
    True
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from forerun.attention import grouped_sdpa, sdpa_in_fp32
from forerun.kvcache import latent
from forerun.measured import DEFAULT_CACHE_DIR, fastest, kept_answer, measurement_file

SIZES = ((256, 1), (256, 8), (1024, 1), (1024, 8))
"""(cached keys, queries) of the calls timed: a step and a small tree, after a short and a longer text (the latency
curve is measured after 256 cached tokens)."""
PROBE_BYTES = 256 << 20
"""The most bytes of fp32 keys and values the probe holds, all sizes together (a share each; layers beyond a
size's share are not rotated through), beside half as many in the model's dtype."""
MAX_LAYERS = 32
REPEATS = 5
VERSION = 1
WAYS = ("fp32", "own dtype")


def attention_shapes(config) -> dict[str, object] | None:
    """What the measurement depends on of a model's config: layers, query and key/value heads, head width, and
    whether it caches latents (then its cache holds them in the model's dtype, `kvcache.latent`); None where the
    config names no heads that group evenly (nothing to measure: the model keeps the attention it was given)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", None) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if not heads or not kv_heads or heads % kv_heads:
        return None
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    layers = int(text.num_hidden_layers)
    return {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "latent": latent(config)}


def half_attention_pays(config, dtype: torch.dtype, cache_dir: Path | str | None = DEFAULT_CACHE_DIR) -> bool:
    """Whether a model of `config` in `dtype` (bf16 or fp16) attends on this CPU at least as fast in `dtype` as in
    fp32: read from `cache_dir`, else measured now (`time_attention`, well under a second for a small model) and
    stored there (None: measured, nothing read or written)."""
    settings, path = choice_file(config, dtype, cache_dir)
    if settings["shapes"] is None:
        return False

    def measure() -> tuple[bool, dict]:
        seconds = time_attention(settings["shapes"], dtype)
        return seconds["own dtype"] <= seconds["fp32"], {"ms": {w: s * 1e3 for w, s in seconds.items()}}

    return kept_answer(path, settings, "half", lambda answer: isinstance(answer, bool), measure)


def choice_file(config, dtype: torch.dtype, cache_dir: Path | str | None) -> tuple[dict, Path | None]:
    """(settings, file) of the choice for a model of `config` in `dtype` on this CPU: what it depends on, and where
    it is kept under `cache_dir` (None: nowhere)."""
    what = {"shapes": attention_shapes(config)}
    return measurement_file("attention-choice", what, dtype, torch.device("cpu"), VERSION, cache_dir)


class Heads(torch.nn.Module):
    """What the attention functions read of a model's attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@torch.inference_mode()
def time_attention(shapes: dict[str, object], dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the `SIZES` calls, each over up to `MAX_LAYERS` layers' own keys and values (`PROBE_BYTES`),
    per way: "fp32" (`sdpa_in_fp32` on keys and values held in fp32, or in `dtype` where the model caches
    latents) and "own dtype" (`grouped_sdpa` in `dtype`). The fastest of `REPEATS` interleaved rounds."""
    heads, kv_heads, width = int(shapes["heads"]), int(shapes["kv_heads"]), int(shapes["head_dim"])
    module, draws = Heads(heads // kv_heads), torch.Generator().manual_seed(0)
    calls: dict[str, list[tuple]] = {way: [] for way in WAYS}
    for cached, queries in SIZES:
        keys = cached + queries
        per_layer = 2 * kv_heads * keys * width * 4
        layers = max(1, min(int(shapes["layers"]), MAX_LAYERS, PROBE_BYTES // len(SIZES) // per_layer))
        query = torch.randn(1, heads, queries, width, generator=draws).to(dtype)
        mask = torch.ones(1, 1, queries, keys, dtype=torch.bool)
        for _ in range(layers):
            key, value = (torch.randn(1, kv_heads, keys, width, generator=draws).to(dtype) for _ in range(2))
            held = (key, value) if shapes["latent"] else (key.float(), value.float())
            calls["fp32"].append((sdpa_in_fp32, query, *held, mask))
            calls["own dtype"].append((grouped_sdpa, query, key, value, mask))

    def seconds_of(way: str) -> float:
        started = time.perf_counter()
        for attend, query, key, value, mask in calls[way]:
            attend(module, query, key, value, mask)
        return time.perf_counter() - started

    return fastest(WAYS, seconds_of, REPEATS, "timing attention in fp32 and in the model's dtype (once per machine)")
