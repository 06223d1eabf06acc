"""Hybrids whose scan over several tokens starts from no state (transformers' Jamba, Zamba, Mamba, Falcon-Mamba and
RecurrentGemma: "it does not take the past state", its own comment says) lose what their cache had read when a
prompt is read on from it: a next turn seeded from the prefix cache, a prompt fed in chunks, a scored prompt past
its first chunk. forerun probes each model once (`forerun.base.chain.reads_on`) and reads such prompts whole; plain
generate never reads on from a cache, so its text is the reference."""

from __future__ import annotations

import pytest
import torch
from random_case import plain_greedy
from test_hybrid_batches import state_space

import forerun
from forerun.base.chain import reads_on
from forerun.scoring import DEFAULT_CHUNK, score_prompt

from tiny_models import STATE_SPACE_FAMILIES, prompts, tiny_model

READS_ON = {"qwen3_5_text": True, "nemotron_h": True, "lfm2": True, "mamba2": True, "jamba": False, "zamba": False,
            "recurrent_gemma": False, "mamba": False, "falcon_mamba": False}  # fmt: skip
"""Whether each family's forward over several tokens after its cache reads them as one forward over the text does."""


def model_of(family: str) -> torch.nn.Module:
    return state_space(family) if family in STATE_SPACE_FAMILIES else tiny_model(family)


@pytest.mark.parametrize(("family", "reads"), sorted(READS_ON.items()))
def test_which_hybrids_lose_their_states_when_read_on(family, reads):
    assert reads_on(model_of(family)) is reads


def turns(decoder: forerun.Decoder, model: torch.nn.Module) -> tuple[forerun.GenerationResult, torch.Tensor]:
    """A first answer, then a next turn on it (the first text and 5 more tokens): the next turn's result, and its
    prompt."""
    first = decoder.generate(prompts(1, length=24)[0], 16, eos_token_id=[])
    following = torch.cat([first.sequences, torch.tensor([[5, 6, 7, 8, 9]])], dim=1)
    return decoder.generate(following, 16, eos_token_id=[], logprobs=1), following


def logprob_gap(model: torch.nn.Module, result: forerun.GenerationResult, prompt: torch.Tensor) -> float:
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(prompt, 16, eos_token_id=[], logprobs=1)
    return max(abs(a.logprob - b.logprob) for a, b in zip(result.logprobs, read.logprobs, strict=True))


@pytest.mark.parametrize("family", ["jamba", "mamba"])
def test_a_next_turn_of_a_hybrid_that_loses_its_states_is_read_whole(family):
    """Jamba's and Mamba's next turn reads its whole prompt again (no prefix cache): generate's text, logprobs within
    1e-5 of a plain run's."""
    model = model_of(family)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency_cache=None)
    assert not decoder.reads_on and decoder.prefixes.max_tokens == 0
    second, following = turns(decoder, model)
    assert second.stats.cached_prompt_tokens == 0
    assert torch.equal(second.sequences, plain_greedy(model, following, 16))
    assert logprob_gap(model, second, following) < 1e-5


def test_negative_control_a_jamba_turn_read_on_from_its_cache_reads_another_text(monkeypatch):
    """Taken for a model that reads on, Jamba's next turn is seeded from the stored cache, and its states, lost
    there, move its logprobs far past rounding."""
    monkeypatch.setattr("forerun.assembly.reads_on", lambda model: True)
    model = tiny_model("jamba")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency_cache=None)
    second, following = turns(decoder, model)
    assert second.stats.cached_prompt_tokens > 24
    assert logprob_gap(model, second, following) > 1e-3


def test_a_hybrid_that_loses_its_states_scores_a_prompt_whole():
    """A prompt longer than a scoring chunk (`DEFAULT_CHUNK`): Jamba's Decoder scores it in one forward, as its
    model's own forward over the text does; read in chunks, its entries past the first chunk drift."""
    model = tiny_model("jamba", max_position_embeddings=1024)
    ids = prompts(1, length=DEFAULT_CHUNK + 40)[0]
    decoder = forerun.Decoder(model, None, "plain", latency_cache=None)
    whole = decoder.score(ids, top=1)
    with torch.inference_mode():
        want = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    assert max(abs(entry.logprob - float(w)) for entry, w in zip(whole[1:], want, strict=True)) < 1e-5
    chunked = score_prompt(model, ids, 1)  # the control: read on past its first chunk
    assert max(abs(a.logprob - b.logprob) for a, b in zip(whole[1:], chunked[1:], strict=True)) > 1e-3
