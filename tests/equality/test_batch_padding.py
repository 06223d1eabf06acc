"""A batch whose rows differ much in length attends row by row from each row's first visible key
(`forerun.attention.by_rows`), and each row still equals plain greedy `model.generate` of its prompt alone (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun import attention
from forerun.costmodel import LatencyCurve

from tiny_models import prompts, register_grouped, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.1, 1.3, 1.7, 2.6))
NEW = 24


@functools.lru_cache(maxsize=4)
def model_of(family: str) -> torch.nn.Module:
    return tiny_model(family, register_grouped(), max_position_embeddings=2048)


def lengths_apart() -> list[list[int]]:
    """One 1200-token prompt and three of 9-30 tokens (repeats in them: prompt lookup finds matches)."""
    long = torch.cat(prompts(50, length=24, seed=5), dim=1)[0, :1200].tolist()
    return [long] + [p[0, :n].tolist() for p, n in zip(prompts(3, seed=6), (30, 9, 17), strict=True)]


def spied(monkeypatch, shift: int = 0) -> list:
    """Record every `row_starts` answer (each start moved by `shift` where rows are attended one by one)."""
    seen, measured = [], attention.row_starts

    def starts(mask, batch):
        found = measured(mask, batch)
        seen.append(found)
        return None if found is None else [start + shift if start else 0 for start in found]

    monkeypatch.setattr(attention, "row_starts", starts)
    return seen


@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rows_of_very_different_lengths_equal_generate_alone(family, method, monkeypatch):
    model, rows = model_of(family), lengths_apart()
    expected = [
        model.generate(torch.tensor([row]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        for row in rows
    ]
    seen = spied(monkeypatch)
    results = forerun.Decoder(model, None, method, latency=CURVE).generate(rows, NEW, eos_token_id=[])
    for index, (result, reference) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result.sequences, reference), (family, method, index)
    by_rows = [found for found in seen if found is not None]
    assert by_rows and max(max(found) for found in by_rows) >= 1150  # the short rows skipped the long one's keys


def test_short_rows_that_skip_visible_keys_change_their_text(monkeypatch):
    """The control: where a short row's attention starts matters (starts a few keys late drop keys it sees)."""
    model, rows = model_of("llama"), lengths_apart()
    expected = [
        model.generate(torch.tensor([row]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        for row in rows[1:]
    ]
    spied(monkeypatch, shift=5)
    results = forerun.Decoder(model, None, "plain", latency=CURVE).generate(rows, NEW, eos_token_id=[])[1:]
    assert any(not torch.equal(r.sequences, e) for r, e in zip(results, expected, strict=True))
