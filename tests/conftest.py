"""Shared fixtures: the real embedded model is loaded once per session (about 25 s on this CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    import forerun

    torch.set_num_threads(2)
    return forerun.load_model("smollm2-135m")
