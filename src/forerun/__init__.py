"""forerun: faster, token-for-token identical generation for Hugging Face causal language models.

>>> import forerun                                                    # doctest: +SKIP
>>> model, tokenizer = forerun.load_model("smollm2-135m")
>>> result = forerun.Decoder(model, tokenizer, method="prompt_lookup").generate("def add(a, b):")
"""

from forerun.config import METHODS, EngineConfig, JacobiConfig, PromptLookupConfig, TrieConfig
from forerun.decoder import Decoder, GenerationResult, generate
from forerun.hf import hf_generate
from forerun.models import load_model
from forerun.stats import GenerationStats

__all__ = [
    "METHODS",
    "Decoder",
    "EngineConfig",
    "GenerationResult",
    "GenerationStats",
    "JacobiConfig",
    "PromptLookupConfig",
    "TrieConfig",
    "generate",
    "hf_generate",
    "load_model",
]
__version__ = "0.1.0"
