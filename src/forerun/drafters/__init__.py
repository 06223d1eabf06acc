"""Drafters: each proposes a token tree from the committed text; none of them calls the target model."""

from forerun.drafters.base import DraftContext, Drafter, StepOutcome

__all__ = ["DraftContext", "Drafter", "StepOutcome"]
