"""Shared fixtures: the real embedded model is loaded once per session (its conversion kept: forerun.converted)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def cores_per_worker(config: pytest.Config) -> int:
    """The cores each test process may use: all of them alone, a share under pytest-xdist's workers (two
    processes each running two threads on two cores would wait on each other's spinning threads)."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    return max(1, len(os.sched_getaffinity(0)) // workers)


@pytest.fixture(autouse=True)
def torch_threads(request):
    """Tiny models run fastest on one thread (no pool spin-up); the real model uses two cores where this process
    has them."""
    real = request.node.get_closest_marker("real_model") is not None
    torch.set_num_threads(min(2, cores_per_worker(request.config)) if real else 1)


@pytest.fixture(autouse=True)
def thawed_heap():
    """A command run in-process (`forerun run` under typer's CliRunner) freezes the heap as its process would;
    the next test starts with every object collectable again."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="session")
def smollm2():
    import forerun

    return forerun.load_model("smollm2-135m")
