"""`model.generate(custom_generate=forerun.hf_generate, ...)`: same output, stopping and streaming as plain generate."""

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import forerun
from forerun.penalties import OccurrencePenalty

from tiny_models import VOCAB, prompts, tiny_model


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


def left_padded(model, ends=((0, 3), (1, 9))):
    """A left-padded batch of 3 rows (2, 0 and 4 pads) and EOS ids: for each (row, i) of `ends`, the token plain
    greedy writes there at new position i (unprocessed)."""
    rows = prompts(3)
    rows = [rows[0][:, :-2], rows[1], rows[2][:, :-4]]
    width = max(p.shape[1] for p in rows)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    free = model.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return ids, mask, [int(free[row, width + i]) for row, i in ends]


@pytest.mark.parametrize(
    "processing, ends",
    [
        # lengths count from the padded prompt: the padded rows 0 and 2 end where they may first end
        (dict(min_new_tokens=6), ((0, 6), (2, 6))),
        (dict(exponential_decay_length_penalty=(6, 3.0)), ((0, 8), (2, 8))),
        # transformers skips each row's own padding (a tensor over the batch's rows)
        (dict(repetition_penalty=1.4), ((0, 3), (1, 9))),
        (dict(no_repeat_ngram_size=2), ((0, 3), (1, 9))),
    ],
)
def test_a_padded_batchs_processors_act_on_each_row_as_in_plain_batched_generate(model, processing, ends):
    ids, mask, eos = left_padded(model, ends)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = model.generate(ids, **common, **processing)
    got = model.generate(
        ids, **common, **processing, custom_generate=forerun.hf_generate, forerun_method="prompt_lookup"
    )
    assert torch.equal(got, expected)


def test_a_padded_batchs_prefix_rule_is_told_each_rows_index(model):
    ids, mask, eos = left_padded(model)

    def allowed(batch_id, tokens):  # row r writes only tokens t with t % 3 == r, unless it repeats its last token
        return [t for t in range(VOCAB) if t % 3 == batch_id or t == int(tokens[-1])]

    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = model.generate(ids, **common, prefix_allowed_tokens_fn=allowed)
    got = model.generate(
        ids, **common, prefix_allowed_tokens_fn=allowed, custom_generate=forerun.hf_generate, forerun_method="auto"
    )
    assert torch.equal(got, expected)


def test_a_padded_batch_with_openais_penalties_decodes_as_plain_batched_generate(model):
    """forerun's `OccurrencePenalty` given to the drop-in as a caller's processor: each row counts its answer
    after the padded prompt, as in plain batched generate; drafts are accepted under it (a negative frequency
    penalty favours repeats), and it changes the text (the control)."""
    ids, mask, _ = left_padded(model)
    penalty = LogitsProcessorList([OccurrencePenalty(-1.0, 0.3, prompt_length=ids.shape[1])])
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(ids, **common, logits_processor=penalty)
    assert not torch.equal(expected, model.generate(ids, **common))
    for method in ("prompt_lookup", "auto"):
        got = model.generate(
            ids, **common, logits_processor=penalty, custom_generate=forerun.hf_generate, forerun_method=method
        )
        assert torch.equal(got, expected), method


@pytest.mark.parametrize("batched", [False, True])
def test_dropin_returns_scores_and_logits_as_generate_does(model, batched):
    ids, mask, eos = left_padded(model)
    if not batched:
        ids, mask = ids[1:2], None
    asked = dict(output_scores=True, output_logits=True, return_dict_in_generate=True)
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=eos, **asked)
    common["repetition_penalty"] = 1.3  # scores are the processed logits: they differ from the raw ones
    expected = model.generate(ids, **common)
    got = model.generate(ids, **common, custom_generate=forerun.hf_generate, forerun_method="prompt_lookup")
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(got.logits) == len(expected.scores) == got.sequences.shape[1] - ids.shape[1]
    new = got.sequences[:, ids.shape[1] :]
    ended = torch.zeros(new.shape[0], dtype=torch.bool)
    for step, (scores, logits) in enumerate(zip(got.scores, got.logits, strict=True)):
        writing = ~ended
        assert torch.allclose(scores[writing], expected.scores[step][writing], atol=1e-5)
        assert torch.allclose(logits[writing], expected.logits[step][writing], atol=1e-5)
        assert not torch.allclose(scores[writing], logits[writing])
        for row in torch.nonzero(ended).flatten().tolist():  # an ended row writes the pad token, certainly
            assert scores[row, 0] == 0 and bool((scores[row, 1:] == -torch.inf).all())
        ended |= torch.isin(new[:, step], torch.tensor(eos))
    assert bool(ended[: 2 if batched else 1].all())  # rows 0 and 1 end early: the pad rows above were checked
    transition = model.compute_transition_scores(got.sequences, got.scores, normalize_logits=True)
    assert bool((transition <= 0).all()) and bool(torch.isfinite(transition).all())


@pytest.mark.parametrize(
    "config, named",
    [
        (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
        (dict(dola_layers="low"), "dola"),
        (dict(num_beams=2, num_beam_groups=2, diversity_penalty=1.0), "beam search"),
        (dict(num_beams=2), "beam search"),
        (dict(output_attentions=True, return_dict_in_generate=True), "attentions"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "hidden states"),
        (dict(guidance_scale=2.0, output_scores=True, return_dict_in_generate=True), "guidance_scale"),
    ],
)
def test_dropin_refuses_what_it_would_not_do_naming_it(model, config, named):
    with pytest.raises(ValueError, match=named):
        model.generate(prompts(1)[0], max_new_tokens=4, pad_token_id=0, custom_generate=forerun.hf_generate, **config)


def test_dropin_refuses_a_prompt_given_as_embeddings(model):
    prompt = prompts(1)[0]
    embeds = model.get_input_embeddings()(prompt)  # a soft prompt need not be any ids' embeddings: never ignored
    for given in (dict(inputs_embeds=embeds), dict(input_ids=prompt, inputs_embeds=embeds)):
        with pytest.raises(ValueError, match="inputs_embeds is not supported"):
            model.generate(**given, max_new_tokens=4, pad_token_id=0, custom_generate=forerun.hf_generate)
