"""forerun: faster, token-for-token identical generation for Hugging Face causal language models.

>>> import forerun                                                    # doctest: +SKIP
>>> model, tokenizer = forerun.load_model("smollm2-135m")                   # doctest: +SKIP
>>> result = forerun.Decoder(model, tokenizer, method="auto").generate("def add(a, b):")  # doctest: +SKIP

The names below are imported at their first use (`forerun.Decoder`, `from forerun import load_model`): importing
`forerun` alone, or `forerun.cli` for `forerun --help`, does not import torch or transformers (seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from forerun.notices import drop_import_notices

drop_import_notices()  # transformers imports torchao: forerun.notices says which lines and why

EXPORTS = {
    "pack_weights": "forerun.base.packed",
    "DraftModelConfig": "forerun.config",
    "Eagle3Config": "forerun.config",
    "EngineConfig": "forerun.config",
    "JacobiConfig": "forerun.config",
    "PromptLookupConfig": "forerun.config",
    "TrieConfig": "forerun.config",
    "LatencyCurve": "forerun.costmodel",
    "Decoder": "forerun.decoder",
    "GenerationResult": "forerun.decoder",
    "generate": "forerun.oneshot",
    "hf_generate": "forerun.hf",
    "METHODS": "forerun.methods",
    "REGISTRY": "forerun.methods",
    "load_model": "forerun.models",
    "GenerationRequest": "forerun.request",
    "GenerationStats": "forerun.stats",
}
"""Public name -> the module that defines it."""

if TYPE_CHECKING:  # what type checkers and editors see (the same names, imported eagerly)
    from forerun.base.packed import pack_weights
    from forerun.config import (
        DraftModelConfig,
        Eagle3Config,
        EngineConfig,
        JacobiConfig,
        PromptLookupConfig,
        TrieConfig,
    )
    from forerun.costmodel import LatencyCurve
    from forerun.decoder import Decoder, GenerationResult
    from forerun.hf import hf_generate
    from forerun.methods import METHODS, REGISTRY
    from forerun.models import load_model
    from forerun.oneshot import generate
    from forerun.request import GenerationRequest
    from forerun.stats import GenerationStats


def __getattr__(name: str) -> object:
    """Import a public name's module at the name's first use and keep the name here."""
    if name not in EXPORTS:
        raise AttributeError(f"module 'forerun' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})


__all__ = [
    "METHODS",
    "REGISTRY",
    "Decoder",
    "DraftModelConfig",
    "Eagle3Config",
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "JacobiConfig",
    "LatencyCurve",
    "PromptLookupConfig",
    "TrieConfig",
    "generate",
    "hf_generate",
    "load_model",
    "pack_weights",
]
__version__ = "0.1.0"
