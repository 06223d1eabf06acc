"""Sampling noise: a counter-based hash of (seed, position, token), computed where the scores are; the words equal
the hash in Python integers, the uniforms are uniform and independent, and a position's noise never depends on
which other positions were asked for with it."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

import forerun.noise as noise_module
from forerun.noise import KEEP, GumbelNoise, hashed, position_seed, signed, span_seeds


def test_the_words_are_splitmix64_in_python_integers():
    """torch's int64 products wrap as unsigned ones do; its right shift keeps the sign bit, which `shifted` masks
    off (an arithmetic shift would differ from the Python hash wherever a word's top bit is set: half of them)."""
    seeds = [0, 1, 12345, (1 << 63) + 5, (1 << 64) - 1, position_seed(7, 3)]
    words = hashed(torch.tensor([signed(s) for s in seeds]), 40)
    for row, seed in enumerate(seeds):
        assert words[row].tolist() == [signed(position_seed(seed, i)) for i in range(40)], seed


def test_a_runs_seeds_are_hashed_where_the_noise_goes_from_an_arange(monkeypatch):
    """The positions' seeds are splitmix64 of the run's seed at every position (big seeds and positions too), made
    where the noise is from an arange: no list of seeds is built on the host (on a card its blocking copy would
    wait for the forward just launched)."""
    for seed in (0, 7, (1 << 63) + 5, (1 << 64) - 1):
        want = [signed(position_seed(seed, p)) for p in range(1_000_000, 1_000_040)]
        assert span_seeds(seed, 1_000_000, 1_000_039, torch.device("cpu")).tolist() == want, seed
    made = GumbelNoise(seed=11).rows([3, 4, 5, 9, 12, 11], 64)  # three runs

    def no_host_lists(*args, **kwargs):
        raise AssertionError("a tensor built from a host list")

    monkeypatch.setattr(noise_module.torch, "tensor", no_host_lists)
    assert torch.equal(GumbelNoise(seed=11).rows([3, 4, 5, 9, 12, 11], 64), made)
    monkeypatch.undo()
    for row, position in zip(made, (3, 4, 5, 9, 12, 11), strict=True):
        assert torch.equal(row, GumbelNoise(seed=11).at(position, 64))


def test_uniforms_are_uniform_and_positions_independent():
    """200 positions x 4,096 tokens: the noise's CDF values fall evenly into 64 bins (chi-square, alpha 0.001), and
    neighbouring positions are uncorrelated."""
    noise = GumbelNoise(seed=3)
    rows = noise.rows(list(range(200)), 4096)
    uniform = torch.exp(-torch.exp(-rows))  # the Gumbel CDF: back to u
    counts = torch.histc(uniform.float(), bins=64, min=0.0, max=1.0)
    assert chisquare(counts.numpy()).pvalue > 0.001
    correlation = torch.corrcoef(torch.stack([uniform[:-1].flatten(), uniform[1:].flatten()]))[0, 1]
    assert abs(float(correlation)) < 0.01
    assert torch.isfinite(rows).all()  # no u of 0 or 1: every token can be drawn


def test_a_positions_noise_is_its_own_whatever_is_asked_with_it():
    noise, fresh = GumbelNoise(seed=11), GumbelNoise(seed=11)
    together = noise.rows([5, 9, 5, 40], 300)
    for row, position in zip(together, (5, 9, 5, 40), strict=True):
        assert torch.equal(row, fresh.at(position, 300))
    assert not torch.equal(noise.at(5, 300), GumbelNoise(seed=12).at(5, 300))
    many = GumbelNoise(seed=11)
    assert torch.equal(many.rows(list(range(3 * KEEP)), 300)[5], together[0])  # more than it keeps, in one call
    assert len(many.kept) == KEEP


def test_a_draw_is_the_argmax_of_the_perturbed_scores():
    scores = torch.tensor([0.0, float("-inf"), 2.0, 1.0]).log_softmax(-1)
    noise = GumbelNoise(seed=2)
    draws = [noise.draw(scores, position) for position in range(4000)]
    assert 1 not in draws  # a filtered token is never drawn
    shares = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert torch.allclose(shares, scores.exp().double(), atol=0.03)
