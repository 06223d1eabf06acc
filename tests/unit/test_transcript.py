"""The transcript's stop checks: a length and EOS alone are checked in Python, exactly where transformers' own
criteria stop (the same tokens taken, the same sequence, done at the same token); anything else calls the
criteria."""

import random

import pytest
import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from forerun.stopping import StopStrings
from forerun.transcript import Transcript, simple_limits

from tiny_models import char_tokenizer


def criteria(max_length: int, eos: list[int]) -> StoppingCriteriaList:
    found = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
    if eos:
        found.append(EosTokenCriteria(eos_token_id=eos))
    return found


@pytest.mark.parametrize("seed", range(40))
def test_python_checks_stop_where_the_criteria_stop(seed):
    rng = random.Random(seed)
    prompt = torch.tensor([[rng.randrange(20) for _ in range(rng.randrange(1, 6))]])
    stopping = criteria(prompt.shape[1] + rng.randrange(1, 12), rng.sample(range(20), rng.randrange(0, 3)))
    fast, fast_checked = Transcript(prompt.clone(), stopping), Transcript(prompt.clone(), stopping)
    fast_checked.limits = None  # the criteria themselves
    assert fast.limits is not None
    while not fast.done:
        chunk = [rng.randrange(20) for _ in range(rng.randrange(1, 5))]
        taken = fast.extend(chunk, ["model"] * len(chunk))
        assert taken == fast_checked.extend(chunk, ["model"] * len(chunk))
        assert fast.done == fast_checked.done and torch.equal(fast.sequence, fast_checked.sequence)
        assert fast.sources == fast_checked.sources


def test_other_criteria_are_called():
    stopping = criteria(50, [2])
    stopping.append(StopStrings.__new__(StopStrings))  # any criterion beyond length and EOS
    assert simple_limits(stopping) is None
    assert simple_limits(criteria(9, [])) == (9, frozenset())


def test_stop_strings_find_the_longest_stop_whole_and_a_special_tokens_text():
    """The criterion decodes only the last tokens (the longest stop's length and a few): a long stop beside a short
    one is still found whole, and a special token's text stops too (decoded with the specials)."""
    tokenizer = char_tokenizer()
    long_stop = "abcdefghijklmnopq"  # 17 tokens here, one a character
    text = tokenizer("z" * 30 + long_stop, add_special_tokens=False, return_tensors="pt").input_ids
    prompt = torch.tensor([[1, 3]])
    stop = StopStrings(tokenizer, ["x", long_stop], prompt_len=2)
    assert stop(torch.cat([prompt, text], dim=1), None).tolist() == [True]
    assert stop(torch.cat([prompt, text[:, :-1]], dim=1), None).tolist() == [False]
    ended = torch.cat([prompt, text[:, :3], torch.tensor([[tokenizer.eos_token_id]])], dim=1)
    assert StopStrings(tokenizer, ["<eos>"], prompt_len=2)(ended, None).tolist() == [True]
