"""Per-generation statistics: forwards, tokens per forward, acceptance, time split between drafting and forwards.

Example:
    >>> from forerun.tree import TokenTree
    >>> tree = TokenTree.rooted_at(5)
    >>> _ = tree.add_chain(0, [7, 9, 4, 1], source="prompt_lookup")
    >>> stats = GenerationStats()
    >>> stats.record_step(tree, accepted=2, accepted_by={"prompt_lookup": 2}, draft_s=0.001, forward_s=0.02,
    ...                   expected=1.5)
    >>> stats.new_tokens = 3
    >>> stats.tokens_per_forward, stats.acceptance_rate, stats.mean_fed, stats.expected_per_step
    (3.0, 0.5, 5.0, 1.5)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from forerun.tree import TokenTree


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
    fed_hist: Counter = field(default_factory=Counter)
    """Number of steps per tree size fed (root and probes included, the prompt at the prefill not)."""
    undrafted_steps: int = 0
    """Forwards that fed no drafter's node: the root alone, or padded up to a cheaper forward size."""
    expected_accepted: float = 0.0
    """The cost model's expected accepted draft tokens, summed over the steps it chose (compare with `accepted`)."""
    expected_steps: int = 0
    """Steps the cost model chose (those `expected_accepted` sums over)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not fed again; OpenAI's `cached_tokens`)."""
    prefill_seconds: float = 0.0
    """From the request's start to its first token (in a server batch, running rows' steps between chunks
    included)."""
    prefill_chunks: int = 1
    """Forwards the prompt was fed in: more than one where a long prompt joined a running batch in chunks."""
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    total_seconds: float = 0.0
    fallback_reason: str | None = None
    """Why tree decoding was turned off for this run (the text is still exact), or None."""
    fed_again: int = 0
    """Accepted tokens fed again, in front of the next step's: a partly accepted chain's head on a model with
    recurrent states (`forerun.base.chain`), and what was fed again before it where that chain too was accepted in
    part (a token may count more than once)."""

    def record_step(
        self,
        tree: TokenTree,
        accepted: int,
        accepted_by: dict[str, int],
        draft_s: float,
        forward_s: float,
        expected: float | None = None,
    ) -> None:
        """One forward over `tree`; `draft_s` = proposing + learning, `forward_s` = forward + verify + commit."""
        self.forwards += 1
        self.fed_tokens += len(tree)
        self.fed_hist[len(tree)] += 1
        # list.count, not a generator: this runs for every row of every step, between a card's forwards
        self.undrafted_steps += tree.sources[1:].count("padding") == len(tree) - 1
        self.candidates += tree.roles.count("candidate")
        self.accepted += accepted
        if accepted_by:  # most steps accept nothing: a Counter update costs more than the rest of the record
            self.accepted_by.update(accepted_by)
        self.accepted_hist[accepted] += 1
        self.draft_seconds += draft_s
        self.forward_seconds += forward_s
        if expected is not None:
            self.expected_accepted += expected
            self.expected_steps += 1

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
    def mean_fed(self) -> float:
        """Tokens fed per forward, on average (the prefill's prompt not counted)."""
        return self.fed_tokens / self.forwards if self.forwards else 0.0

    @property
    def single_token_share(self) -> float:
        """Share of forwards that fed no drafter's node (plain decoding steps, padded or not)."""
        return self.undrafted_steps / self.forwards if self.forwards else 0.0

    @property
    def expected_per_step(self) -> float | None:
        """The cost model's expected accepted draft tokens per step it chose (None without a cost model)."""
        return self.expected_accepted / self.expected_steps if self.expected_steps else None

    @property
    def draft_share(self) -> float:
        """Share of the wall time spent proposing drafts."""
        return self.draft_seconds / self.total_seconds if self.total_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["accepted_by"] = dict(self.accepted_by)
        data["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        data["fed_hist"] = {str(k): v for k, v in sorted(self.fed_hist.items())}
        data.update(
            tokens_per_forward=self.tokens_per_forward,
            acceptance_rate=self.acceptance_rate,
            tokens_per_second=self.tokens_per_second,
            draft_share=self.draft_share,
            mean_fed=self.mean_fed,
            single_token_share=self.single_token_share,
            expected_per_step=self.expected_per_step,
        )
        return data

    def summary(self) -> str:
        """One line for terminals."""
        line = (
            f"{self.new_tokens} tokens in {self.total_seconds:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"{self.forwards} forwards, {self.tokens_per_forward:.2f} tokens/forward, "
            f"acceptance {self.acceptance_rate:.0%}, drafting {self.draft_share:.1%} of the time"
        )
        if self.expected_per_step is not None:
            actual = self.accepted / self.forwards if self.forwards else 0.0
            line += (
                f"; fed {self.mean_fed:.1f} tokens/forward, {self.single_token_share:.0%} 1-token steps, "
                f"accepted {actual:.2f}/step (expected {self.expected_per_step:.2f})"
            )
        if self.cached_prompt_tokens:
            line += f"; {self.cached_prompt_tokens} prompt tokens from the prefix cache"
        if self.fed_again:
            line += f"; {self.fed_again} accepted tokens fed again (chains accepted in part)"
        return line
