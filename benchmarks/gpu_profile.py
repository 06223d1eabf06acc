"""The GPU check's `profile` section: where a step's time goes on the card (`gpu_check.py profile`).

Usage (the same as `gpu_check.py bench,profile`, with its options: the profile reads the bench's warm decoders):
    python benchmarks/gpu_profile.py --model .gpu/smollm2.gguf --prompts .gpu/prompts.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling gpu_check, wherever it is run from

from gpu_check import DEVICE, Log

from forerun import Decoder


def profile(log: Log, model, tokenizer, prompts: list[dict], new_tokens: int, decoders: dict[str, Decoder]) -> None:
    """Where a step's time goes, for each decoder (the bench's, already warm), over the first 3 prompts:
    - cProfile: the forerun and transformers functions with the most cumulative time, ms per forward (a wait for
      the card shows in the call that waits: the step's one copy, `tolist`);
    - torch.profiler over one prompt: the card's kernels and the host's CUDA calls by total time, per forward (what
      the card runs per step and how often the host launches, copies or waits)."""
    import cProfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for label, decoder in decoders.items():
        if log.late(30):
            log("profile", note="deadline: stopped early")
            return
        profiler, forwards = cProfile.Profile(), 0
        for prompt in prompts[:3]:
            ids = torch.tensor([prompt["ids"]], device=DEVICE)
            profiler.enable()
            forwards += decoder.generate(ids, new_tokens).stats.forwards
            profiler.disable()
        log("profile", method=label, forwards=forwards, top=top_functions(profiler, forwards, "forward"))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
        ids = torch.tensor([prompts[0]["ids"]], device=DEVICE)
        with torch_profile(activities=activities) as traced:
            forwards = decoder.generate(ids, new_tokens).stats.forwards
        events = [e for e in traced.key_averages() if e.count > 0]
        device_us = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
        kernels = sorted((e for e in events if device_us(e) > 0), key=lambda e: -device_us(e))[:25]
        host = sorted(events, key=lambda e: -e.cpu_time_total)[:25]
        log("profile", method=label, forwards=forwards, kernels=[
            {"name": e.key[:90], "device_ms_per_forward": round(device_us(e) / 1e3 / forwards, 4),
             "calls_per_forward": round(e.count / forwards, 2)} for e in kernels
        ], host_calls=[
            {"name": e.key[:90], "cpu_ms_per_forward": round(e.cpu_time_total / 1e3 / forwards, 4),
             "calls_per_forward": round(e.count / forwards, 2)} for e in host
        ])  # fmt: skip


def top_functions(profiler, per: int, unit: str, limit: int = 40) -> list[dict]:
    """The forerun and transformers functions (and builtins) with the most cumulative time in `profiler`
    (cProfile), in ms per `unit` (`per` of them ran)."""
    import pstats

    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][3])
    return [
        {"function": f"{Path(file).name}:{line}({name})", f"ms_per_{unit}": round(1e3 * cumulative / per, 3),
         f"own_ms_per_{unit}": round(1e3 * own / per, 3), f"calls_per_{unit}": round(calls / per, 2)}
        for (file, line, name), (_, calls, own, cumulative, _) in rows
        if "forerun" in file or "transformers" in file or "{" in name
    ][:limit]  # fmt: skip


def main() -> None:
    """`gpu_check.py bench,profile ...`: the bench, then where its decoders' steps spend their time."""
    import gpu_check

    sys.argv.insert(1, "bench,profile")
    gpu_check.main()


if __name__ == "__main__":
    main()
