"""Per-generation statistics: forwards, tokens per forward, acceptance, time split between drafting and forwards.

Example:
    >>> stats = GenerationStats()
    >>> stats.record_step(fed=5, candidates=4, accepted=2, accepted_by={"prompt_lookup": 2}, draft_s=0.001,
    ...                   forward_s=0.02)
    >>> stats.new_tokens = 3
    >>> stats.tokens_per_forward, stats.acceptance_rate
    (3.0, 0.5)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counters of one generation; `as_dict` gives a JSON-ready summary."""

    new_tokens: int = 0
    forwards: int = 0
    """Model forwards, the prefill included (so plain decoding of n tokens has n forwards)."""
    fed_tokens: int = 0
    """Tree nodes fed to the model after the prefill (the CPU pays for each)."""
    candidates: int = 0
    """Candidate (acceptable) draft nodes fed."""
    accepted: int = 0
    """Draft tokens accepted."""
    accepted_by: Counter = field(default_factory=Counter)
    """Accepted draft tokens per drafter name."""
    accepted_hist: Counter = field(default_factory=Counter)
    """Number of steps per accepted length (0 = only the bonus token)."""
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    total_seconds: float = 0.0
    fallback_reason: str | None = None
    """Why tree decoding was turned off for this run (the text is still exact), or None."""

    def record_step(
        self,
        fed: int,
        candidates: int,
        accepted: int,
        accepted_by: dict[str, int],
        draft_s: float,
        forward_s: float,
    ) -> None:
        self.forwards += 1
        self.fed_tokens += fed
        self.candidates += candidates
        self.accepted += accepted
        self.accepted_by.update(accepted_by)
        self.accepted_hist[accepted] += 1
        self.draft_seconds += draft_s
        self.forward_seconds += forward_s

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / candidate draft tokens fed."""
        return self.accepted / self.candidates if self.candidates else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def draft_share(self) -> float:
        """Share of the wall time spent proposing drafts."""
        return self.draft_seconds / self.total_seconds if self.total_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["accepted_by"] = dict(self.accepted_by)
        data["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        data.update(
            tokens_per_forward=self.tokens_per_forward,
            acceptance_rate=self.acceptance_rate,
            tokens_per_second=self.tokens_per_second,
            draft_share=self.draft_share,
        )
        return data

    def summary(self) -> str:
        """One line for terminals."""
        return (
            f"{self.new_tokens} tokens in {self.total_seconds:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"{self.forwards} forwards, {self.tokens_per_forward:.2f} tokens/forward, "
            f"acceptance {self.acceptance_rate:.0%}, drafting {self.draft_share:.1%} of the time"
        )
