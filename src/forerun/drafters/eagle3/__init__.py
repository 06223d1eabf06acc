"""EAGLE-3 draft heads (SpecForge's layout): the head module and its loader."""

from forerun.drafters.eagle3.head import Eagle3Head, HeadCache, head_config
from forerun.drafters.eagle3.load import load_head

__all__ = ["Eagle3Head", "HeadCache", "head_config", "load_head"]
