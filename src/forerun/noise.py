"""Sampling noise keyed by position: a seeded run's draws depend on the seed and the position, never on the drafts.

A sampled token is drawn with the Gumbel-max trick: at position t the token is argmax(scores + G_t), where
`scores` are the processed logits (temperature, top-p... applied; filtered tokens at -inf) and G_t is a vector of
independent standard Gumbel variables, one per vocabulary row. P(argmax = i) = softmax(scores)_i exactly, so each
token is a draw from the target's distribution, as in `model.generate(do_sample=True)`.

G_t comes from a generator seeded by (seed, t) alone. So sampling is greedy decoding of perturbed scores, and
everything greedy decoding guarantees carries over: a drafted token is accepted exactly when it is the target's
draw at its position, what was drafted (and by whom, and how many were fed) never changes what is written, and a
seed gives the same text with every method and batch size, run after run, while the trie and the cost model
learn in between. A draft model drafts with the same G_t (its token: argmax(its scores + G_t)), so it guesses
the target's draw, not merely a draw from its own distribution.

Example:
    >>> noise = GumbelNoise(seed=7)
    >>> torch.equal(noise.at(12, 5), GumbelNoise(seed=7).at(12, 5))   # (seed, position) alone decide
    True
    >>> torch.equal(noise.at(12, 5), noise.at(13, 5))
    False
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
KEEP = 24
"""Positions whose noise a run keeps: a draft model reads up to `max_gamma` (20) positions ahead and the verifier
reads them again; model-free drafts never read a position twice. Only a cache (the noise is a function of seed and
position), so its size bounds memory (24 x vocab x 8 bytes: 9 MB for SmolLM2's 49,152 tokens) and nothing else."""


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for `position` under `seed` (splitmix64: nearby inputs give unrelated seeds)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class GumbelNoise:
    """Standard Gumbel noise per absolute token position (prompt positions included), for one sampled run.

    `at(position, size)` -> [size] float64 on the CPU, the same for the same seed, position and size on any call
    and any device (the noise is drawn on the CPU, in float64, on every device).
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & MASK64
        self.kept: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def drawn(cls, generator: torch.Generator | None = None) -> GumbelNoise:
        """Noise under a seed drawn from `generator` (None: torch's global one, so `torch.manual_seed` makes
        unseeded runs repeat, as with plain generate)."""
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device if generator else "cpu"))
        return cls(seed)

    def at(self, position: int, size: int) -> torch.Tensor:
        key = (position, size)
        noise = self.kept.get(key)
        if noise is None:
            generator = torch.Generator().manual_seed(position_seed(self.seed, position))
            uniform = torch.rand(size, generator=generator, dtype=torch.float64)
            noise = -torch.log(-torch.log(uniform))  # uniform 0 gives -inf: that token is never drawn
            if len(self.kept) >= KEEP:
                del self.kept[next(iter(self.kept))]  # the oldest: positions only move forward
            self.kept[key] = noise
        return noise

    def perturbed(self, scores: torch.Tensor, position: int) -> torch.Tensor:
        """`scores` [vocab] (processed logits) plus this position's noise, on the CPU in float64: its argmax is the
        draw, its runners-up the likeliest other draws."""
        return scores.detach().cpu().double() + self.at(position, scores.shape[-1])

    def draw(self, scores: torch.Tensor, position: int) -> int:
        """The token drawn at `position` from softmax(`scores`) [vocab] (processed logits)."""
        return int(self.perturbed(scores, position).argmax())
