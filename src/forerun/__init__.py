"""forerun: faster, token-for-token identical generation for Hugging Face causal language models.

>>> import forerun                                                    # doctest: +SKIP
>>> model, tokenizer = forerun.load_model("smollm2-135m")                   # doctest: +SKIP
>>> result = forerun.Decoder(model, tokenizer, method="auto").generate("def add(a, b):")  # doctest: +SKIP
"""

# ruff: noqa: E402 (the notices are dropped before anything imports transformers)
# isort: off
from forerun.notices import drop_import_notices

drop_import_notices()  # transformers imports torchao: forerun.notices says which lines and why
# isort: on

from forerun.base.packed import pack_weights
from forerun.config import DraftModelConfig, Eagle3Config, EngineConfig, JacobiConfig, PromptLookupConfig, TrieConfig
from forerun.costmodel import LatencyCurve
from forerun.decoder import Decoder, GenerationResult, generate
from forerun.hf import hf_generate
from forerun.methods import METHODS, REGISTRY
from forerun.models import load_model
from forerun.request import GenerationRequest
from forerun.stats import GenerationStats

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
