"""`model.generate(custom_generate=forerun.hf_generate, ...)`: same output, stopping and streaming as plain generate."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import forerun

from tiny_models import prompts, tiny_model


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "jacobi", "trie"])
def test_dropin_equals_generate_with_eos_lists(model, method):
    prompt = prompts(1)[0]
    free = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = [int(free[0, prompt.shape[1] + 12]), int(free[0, prompt.shape[1] + 20])]  # two EOS ids, one fires
    ref = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = model.generate(
        prompt,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        custom_generate=forerun.hf_generate,
        forerun_method=method,
    )
    assert torch.equal(out, ref)
    assert out.shape[1] <= prompt.shape[1] + 13


def test_dropin_with_repetition_penalty_processor(model):
    prompt = prompts(1)[0]
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0, repetition_penalty=1.3)
    ref = model.generate(prompt, **kwargs)
    out = model.generate(prompt, **kwargs, custom_generate=forerun.hf_generate, forerun_method="prompt_lookup")
    assert torch.equal(out, ref)


def test_dropin_streamer_and_return_dict(model):
    prompt = prompts(1)[0]
    ref = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    streamer = Collect()
    out = model.generate(
        prompt,
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        custom_generate=forerun.hf_generate,
        forerun_method="prompt_lookup",
        forerun_streamer=streamer,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, ref)
    assert streamer.chunks[0] == prompt[0].tolist()  # the prompt first, as transformers does
    assert sum(streamer.chunks[1:], []) == ref[0, prompt.shape[1] :].tolist()
    assert streamer.ended
    assert out.forerun_stats.new_tokens == 20


def test_dropin_takes_an_unpadded_batch_as_plain_generate_does(model):
    batch = torch.cat(prompts(2))  # [2, L], no attention mask: every position is text
    expected = model.generate(batch, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = model.generate(batch, max_new_tokens=5, do_sample=False, pad_token_id=0, custom_generate=forerun.hf_generate)
    assert torch.equal(got, expected)
