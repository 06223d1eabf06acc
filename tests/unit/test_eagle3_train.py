"""Training an EAGLE-3 head (`forerun train-head`): on a tiny model, the loss falls, and the head it writes loads
and drafts exactly."""

from __future__ import annotations

import torch

import forerun
from forerun.drafters.eagle3 import load_head
from forerun.drafters.eagle3.train import TrainConfig, train_head

from tiny_models import VOCAB, prompts, tiny_model


class DigitTokenizer:
    """Text of space-separated token ids (the tiny models have no tokenizer of their own)."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(word) % VOCAB for word in text.split()]}


def test_a_trained_head_learns_loads_and_drafts_exactly(tmp_path):
    model = tiny_model("llama")
    texts = [" ".join(str(3 + (i * 7 + j) % 40) for j in range(200)) for i in range(12)]  # repetitive text
    losses = []
    config = TrainConfig(draft_vocab=48, chunk=64, seconds=60, vocab_chunks=4, lr=3e-3)
    folder = train_head(model, DigitTokenizer(), texts * 3, tmp_path / "head", config,
                        report=lambda step, loss, seconds: losses.append(loss))  # fmt: skip
    assert len(losses) > 10 and sum(losses[-3:]) < sum(losses[:3])  # it learned something
    head = load_head(folder, model)  # its own layout reads back, checked against the target
    assert head.lm_head.weight.shape == (48, 64) and int(head.t2d.sum()) == 48
    prompt = prompts(1)[0]
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    result = forerun.Decoder(model, None, "eagle3", draft_head=head, adaptive=False).generate(
        prompt, 30, eos_token_id=[]
    )
    assert torch.equal(result.sequences, expected) and result.stats.candidates > 0
