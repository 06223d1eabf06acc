"""One Decoder shared by threads (a web app's handlers, a thread pool): calls take turns, each answer exact."""

from __future__ import annotations

import threading

import pytest
import torch

import forerun

from eagle3_heads import random_head
from tiny_models import prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("static", [False, True])
def test_threads_sharing_one_decoder_each_get_generates_answer(model, static):
    texts = prompts(6, length=40)
    expected = [model.generate(p, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None) for p in texts]
    decoder = forerun.Decoder(model, None, "auto", static_cache=static)
    got: dict[int, object] = {}

    def single(i: int) -> None:
        got[i] = decoder.generate(texts[i], 40, eos_token_id=[]).sequences

    def batch(i: int) -> None:  # two rows through generate_each, one after the other finishing
        for j, result in decoder.generate_each(texts[i : i + 2], 40, batch_size=2, eos_token_id=[]):
            got[i + j] = result.sequences

    def dropin(i: int) -> None:
        got[i] = model.generate(
            texts[i],
            max_new_tokens=40,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            custom_generate=forerun.hf_generate,
            forerun_decoder=decoder,
        )

    def run(work, i: int) -> None:
        try:
            work(i)
        except Exception as error:  # noqa: BLE001 - reported below, by row
            got[i] = error

    for _ in range(2):
        got.clear()
        threads = [threading.Thread(target=run, args=args) for args in ((single, 0), (batch, 1), (dropin, 3))]
        threads += [threading.Thread(target=run, args=(single, i)) for i in (4, 5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i, want in enumerate(expected):
            assert isinstance(got[i], torch.Tensor), (i, got[i])
            assert torch.equal(got[i], want), i


def test_a_heads_features_come_from_its_own_forwards_while_another_thread_runs_the_model(model):
    """An EAGLE-3 head reads three layers' outputs through hooks on the target's layers. Another thread running
    the same model meanwhile (another Decoder, plain model.generate) ran those hooks too: the head drafted from the
    other thread's hidden states (other drafts, or a shape error where they had another length). Each request's
    hooks keep only its own thread's forwards: the drafts and their acceptance are those of the request alone."""
    texts = prompts(2, length=40)

    def decoded() -> list[tuple[torch.Tensor, int, int]]:
        decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), adaptive=False)
        results = [decoder.generate(text, 40, eos_token_id=[]) for text in texts]
        return [(r.sequences, r.stats.forwards, r.stats.accepted) for r in results]

    alone = decoded()
    assert sum(accepted for _, _, accepted in alone) > 0
    done = threading.Event()

    def other_work() -> None:
        other = prompts(1, length=7, seed=5)[0]
        with torch.inference_mode():
            while not done.is_set():
                model(other)

    thread = threading.Thread(target=other_work)
    thread.start()
    try:
        beside = decoded()
    finally:
        done.set()
        thread.join()
    for (sequence, forwards, accepted), (want, want_forwards, want_accepted) in zip(beside, alone, strict=True):
        assert torch.equal(sequence, want)
        assert (forwards, accepted) == (want_forwards, want_accepted)
