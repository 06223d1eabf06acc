"""Sampling noise keyed by position: a seeded run's draws depend on the seed and the position, never on the drafts.

A sampled token is drawn with the Gumbel-max trick: at position t the token is argmax(scores + G_t), where
`scores` are the processed logits (temperature, top-p... applied; filtered tokens at -inf) and G_t is a vector of
independent standard Gumbel variables, one per vocabulary row. P(argmax = i) = softmax(scores)_i exactly, so each
token is a draw from the target's distribution, as in `model.generate(do_sample=True)`.

G_t is a function of (seed, t) alone. So sampling is greedy decoding of perturbed scores, and everything greedy
decoding guarantees carries over: a drafted token is accepted exactly when it is the target's draw at its
position, what was drafted (and by whom, and how many were fed) never changes what is written, and a seed gives
the same text with every method and batch size, run after run, while the trie and the cost model learn in
between. A draft model drafts with the same G_t (its token: argmax(its scores + G_t)), so it guesses the target's
draw, not merely a draw from its own distribution.

Each G_t[i] comes from a counter-based hash, `position_seed(position_seed(seed, t), i)` (splitmix64; the top 53
bits a uniform in (0, 1)), computed elementwise in 64-bit integers where the scores are: no generator and no state,
and on a card no vocabulary of noise drawn on the host and copied over for every position a step reaches (nor
the positions' seeds: they are hashed there too, from an arange). The integer steps are exact on every device; the
two float64 logarithms after them may differ by an ulp between devices, so a draw on a card equals the CPU's
except at a float64 near-tie of two perturbed scores.

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
"""Positions whose noise a run keeps (per device): a draft model reads up to `max_gamma` (20) positions ahead and
the verifier reads them again; model-free drafts never read a position twice. Only a cache (the noise is a
function of seed and position), so its size bounds memory (24 x vocab x 8 bytes: 9 MB for SmolLM2's 49,152
tokens) and nothing else."""


def signed(value: int) -> int:
    """A 64-bit word as torch's int64 holds it (two's complement)."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


GOLDEN, MIX1, MIX2 = signed(0x9E3779B97F4A7C15), signed(0xBF58476D1CE4E5B9), signed(0x94D049BB133111EB)
"""splitmix64's increment and its finalizer's two multipliers, as int64 (products wrap modulo 2^64 alike)."""


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for `position` under `seed` (splitmix64: nearby inputs give unrelated seeds)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def shifted(words: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 `words` (torch's `>>` keeps the sign bit)."""
    return (words >> bits) & ((1 << (64 - bits)) - 1)


def mixed(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, elementwise on int64 words (products wrap modulo 2^64 as in the Python hash)."""
    z = (z ^ shifted(z, 30)) * MIX1
    z = (z ^ shifted(z, 27)) * MIX2
    return z ^ shifted(z, 31)


def hashed(seeds: torch.Tensor, size: int) -> torch.Tensor:
    """[P, size] int64: element i of row p is `position_seed(seeds[p], i)`, computed elementwise on the seeds'
    device.

    Example (the same words as the hash in Python integers):
        >>> hashed(torch.tensor([signed(12345)]), 3)[0, 2] == signed(position_seed(12345, 2))
        tensor(True)
    """
    index = torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device)
    return mixed(seeds[:, None] + index * GOLDEN)


def span_seeds(seed: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """[last - first + 1] int64: `position_seed(seed, p)` for p = first..last, made on `device` from an arange (no
    list of seeds copied over: on a card a blocking copy after a launched forward waits for it).

    Example:
        >>> span_seeds(7, 3, 4, torch.device("cpu")).tolist() == [signed(position_seed(7, p)) for p in (3, 4)]
        True
    """
    positions = torch.arange(first + 1, last + 2, dtype=torch.int64, device=device)
    return mixed(positions * GOLDEN + signed(seed))


def gumbel_rows(seeds: torch.Tensor, size: int) -> torch.Tensor:
    """Standard Gumbel noise [P, size] float64 for the positions whose `seeds` [P] int64 are given: each word's
    top 53 bits a uniform u in (0, 1) (half a step off 0 and 1: every token can be drawn), then -log(-log u)."""
    uniform = (shifted(hashed(seeds, size), 11).double() + 0.5) * 2.0**-53
    return -torch.log(-torch.log(uniform))


def runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted `positions` as runs of consecutive ones, (first, last) each.

    Example:
        >>> runs([3, 4, 5, 9, 11, 12])
        [(3, 5), (9, 9), (11, 12)]
    """
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p - 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


class GumbelNoise:
    """Standard Gumbel noise per absolute token position (prompt positions included), for one sampled run.

    `at(position, size, device)` -> [size] float64 on `device`, the same for the same seed, position and size on
    any call (on another device, up to an ulp: the module docstring).
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & MASK64
        self.kept: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    @classmethod
    def drawn(cls, generator: torch.Generator | None = None) -> GumbelNoise:
        """Noise under a seed drawn from `generator` (None: torch's global one, so `torch.manual_seed` makes
        unseeded runs repeat, as with plain generate)."""
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device if generator else "cpu"))
        return cls(seed)

    def at(self, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.rows([position], size, device)[0]

    def rows(self, positions: list[int], size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The noise of each of `positions` [P, size] (float64, on `device`), each run of consecutive positions not
        kept computed in one go, seeds and all, on `device` (nothing is copied over)."""
        device = torch.device(device)
        missing = sorted({p for p in positions if (p, size, device) not in self.kept})
        made = {}
        for first, last in runs(missing):  # hashed where the noise goes (a step's new positions: one run)
            noise = gumbel_rows(span_seeds(self.seed, first, last, device), size)
            made.update((p, noise[p - first]) for p in range(first, last + 1))
        for position, row in made.items():
            if len(self.kept) >= KEEP:
                del self.kept[next(iter(self.kept))]  # the oldest: positions only move forward
            self.kept[(position, size, device)] = row
        rows = [made[p] if p in made else self.kept[(p, size, device)] for p in positions]
        return torch.stack(rows)

    def perturbed(self, scores: torch.Tensor, position: int) -> torch.Tensor:
        """`scores` [vocab] (processed logits) plus this position's noise, in float64 where the scores are: its
        argmax is the draw, its runners-up the likeliest other draws."""
        return scores.detach().double() + self.at(position, scores.shape[-1], scores.device)

    def draw(self, scores: torch.Tensor, position: int) -> int:
        """The token drawn at `position` from softmax(`scores`) [vocab] (processed logits)."""
        return int(self.perturbed(scores, position).argmax())
