"""Shared fixtures: the real embedded model is loaded once per session (its conversion kept: forerun.converted)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def torch_threads(request):
    """Tiny models run fastest on one thread (no pool spin-up); the real model uses both cores."""
    torch.set_num_threads(2 if request.node.get_closest_marker("real_model") else 1)


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
