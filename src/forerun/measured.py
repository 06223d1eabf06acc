"""Where forerun keeps what it measured once on this device: the forward-latency curve (`forerun.latency`) and the
faster layout of the output matrix (`forerun.head`), each a small JSON file under `~/.cache/forerun/<kind>/`.

What a measurement depends on (the device's name, the dtype, the thread count, torch's version) is part of its file
name, so another machine, dtype or thread count measures afresh instead of reading a stale file.

Example:
    >>> device_name(torch.device("cpu")) != ""
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

DEFAULT_CACHE_DIR = Path("~/.cache/forerun")
T = TypeVar("T")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (`/proc/cpuinfo`; the platform's name where there is none)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine_label(device: torch.device) -> str:
    """What a figure names its machine by: the GPU's name, or the CPU's with the vector units its kernels use
    (CPUs of one name differ: an EPYC with AVX2 only, or with AVX-512 and AVX-512 BF16; a Xeon with AMX).

    Example (the words depend on the CPU):
        >>> machine_label(torch.device("cpu"))                                                # doctest: +SKIP
        'AMD EPYC (AVX-512, AVX-512 BF16)'
    """
    if device.type != "cpu":
        return device_name(device)
    units = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability(), "")
    flags = set(cpuinfo("flags").split())
    extra = [name for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("amx_tile", "AMX")) if flag in flags]
    found = ", ".join(part for part in (units, *extra) if part)
    return f"{device_name(device)} ({found})" if found else device_name(device)


def cpuinfo(field: str) -> str:
    """The first `field` of `/proc/cpuinfo` ("model name", "flags"), or "" where there is no such file or field."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def config_shape(config) -> dict[str, object]:
    """A model config's plain values (sizes, flags, names of kinds), sorted, without names of models or files:
    what a measurement of its forwards depends on."""
    items = sorted(config.to_dict().items())
    return {k: v for k, v in items if isinstance(v, (int, float, str, bool)) and "name" not in k}


def fastest(items: Sequence[T], seconds_of: Callable[[T], float], repeats: int, what: str) -> dict[T, float]:
    """Per item, the fastest of `repeats` rounds of `seconds_of(item)` (items interleaved within each round, after a
    warm-up round that is dropped): on a shared machine load only ever slows a run down. Shown as a progress bar
    labelled "forerun: `what`", transformers' own, so what switches transformers' bars off switches it off too
    (`transformers.utils.logging.disable_progress_bar()`, `HF_HUB_DISABLE_PROGRESS_BARS=1`).

    Example:
        >>> fastest([1, 2], lambda n: 0.5 * n, repeats=2, what="timing nothing")
        {1: 0.5, 2: 1.0}
    """
    from transformers.utils.logging import tqdm

    samples: dict[T, list[float]] = {item: [] for item in items}
    with tqdm(total=(repeats + 1) * len(samples), desc=f"forerun: {what}", leave=False) as bar:
        for _ in range(repeats + 1):
            for item in samples:
                samples[item].append(seconds_of(item))
                bar.update()
    sys.stderr.flush()  # the bar's last "\r", written there at its close unflushed, would follow later output
    return {item: min(times[1:]) for item, times in samples.items()}


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer stops when the tokens exist (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settings_digest(settings: dict) -> str:
    """16 hex digits naming `settings` (a JSON-able dict) in a file name: equal settings, equal names."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def layers_measured(kind: str, weight: torch.Tensor, layers: list, version: int, cache_dir: Path | str | None
                    ) -> tuple[dict, Path | None]:  # fmt: skip
    """(settings, file) of a measurement of `kind` over some linear layers (`layers`: their shapes, as JSON), whose
    first matrix is `weight`: what it depends on (the shapes, dtype, machine, thread count, torch version, the
    measurement's `version`), and the file it is kept in under `cache_dir` (None: nowhere).

    Example:
        >>> settings, path = layers_measured("kind", torch.ones(2, 3), [[2, 3]], 1, "/tmp/c")
        >>> settings["dtype"], path.parent.name, path.name.startswith(f"float32-t{torch.get_num_threads()}-")
        ('float32', 'kind', True)
    """
    return measurement_file(kind, {"layers": layers}, weight.dtype, weight.device, version, cache_dir)


def measurement_file(kind: str, what: dict, dtype: torch.dtype, device: torch.device, version: int,
                     cache_dir: Path | str | None) -> tuple[dict, Path | None]:  # fmt: skip
    """(settings, file) of a measurement of `kind` of `what` (its shapes, as JSON) in `dtype` on `device`: `what`
    with the dtype, the machine, the thread count, torch's version and the measurement's `version`, and the file it
    is kept in under `cache_dir` (None: nowhere), named by them."""
    settings = {
        **what,
        "dtype": str(dtype).removeprefix("torch."),
        "device": machine_label(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "version": version,
    }
    name = f"{settings['dtype']}-t{settings['threads']}-{settings_digest(settings)}.json"
    return settings, None if cache_dir is None else Path(cache_dir).expanduser() / kind / name


def kept_answer(path: Path | None, settings: dict, key: str, valid: Callable[[object], bool],
                measure: Callable[[], tuple[T, dict]]) -> T:  # fmt: skip
    """The answer stored under `key` at `path` where it is `valid`; else `measure()`'s (answer, record of how it was
    measured), stored there with `settings` (a read-only home: not stored; None: nowhere). A damaged file is
    measured again.

    Example:
        >>> kept_answer(None, {}, "pack", lambda v: isinstance(v, bool), lambda: (True, {}))
        True
    """
    stored = read_json(path) if path is not None else None
    if stored is not None and valid(stored.get(key)):
        return stored[key]
    answer, record = measure()
    if path is not None:
        try:
            write_json(path, {"settings": settings, key: answer, **record})
        except OSError:
            pass  # a read-only home: the answer still serves this process
    return answer


def write_json(path: Path, data: dict) -> None:
    """Write `data` as JSON through a temporary file renamed over `path`: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data, indent=1))
    temporary.replace(path)


def read_json(path: Path) -> dict | None:
    """The JSON object stored at `path`, or None if it is missing or unreadable (then it is measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
