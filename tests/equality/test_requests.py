"""What one generation may ask for: stop strings, log-probabilities, a prediction; every hostile value refused."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LogitsProcessorList

import forerun
from forerun.costmodel import LatencyCurve
from forerun.drafters.base import DraftContext, StepOutcome
from forerun.drafters.prediction import PredictionDrafter
from forerun.penalties import OccurrencePenalty
from forerun.preparation import config_processes
from forerun.verify import Verdict

from tiny_models import LetterTokenizer, prompts, tiny_model

CURVE = LatencyCurve((1, 8, 32), (1.0, 1.1, 1.5))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def plain(model, prompt, new_tokens=30, **kwargs):
    return model.generate(
        prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"do_sample": True, "temperature": 1e-300}, "temperature must be 0 \\(greedy\\) or between 0.0001 and 100"),
        ({"do_sample": True, "top_p": 5e-324, "repetition_penalty": 5e-324}, "repetition_penalty must be between"),
        ({"do_sample": True, "top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
        ({"do_sample": True, "temperature": float("nan")}, "temperature must be a finite number"),
        ({"do_sample": True, "top_k": -1}, "top_k must be an integer"),
        ({"seed": 2**64}, "seed must be an integer in \\[0, 2\\*\\*63 - 1\\]"),
        ({"stop": [""]}, "stop\\[0\\] is empty"),
        ({"stop": ["ok", "a\ud800"]}, "stop\\[1\\] contains a lone surrogate"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"logprobs": 21}, "logprobs must be an integer in \\[0, 20\\]"),
        ({"window": 3}, "unknown generation argument\\(s\\) \\['window'\\]; method knobs"),
        # ways of decoding forerun does not do, and settings of generate's return value: named, never ignored
        ({"num_beams": 2}, "these settings ask for beam search \\(num_beams=2\\)"),
        ({"dola_layers": "low"}, "these settings ask for dola generation"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences is not a setting of a forerun request"),
        ({"stop_strings": ["a"]}, "stop_strings is not a setting of a forerun request; use stop="),
        ({"return_dict_in_generate": True, "output_scores": True}, "is not a setting of a forerun request"),
    ],
)
def test_hostile_generation_values_raise_value_errors(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        forerun.Decoder(model, None, "plain").generate(prompts(1)[0], 5, **kwargs)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (torch.tensor([[3.0, 4.0]]), "input_ids must hold integer token ids, got a torch.float32 tensor"),
        (torch.ones(1, 1, 3, dtype=torch.long), "input_ids must be \\[length\\] or \\[1, length\\], got shape"),
        ([3, 4.5], "must hold integer token ids"),
        ([3, True], "must hold integer token ids"),
    ],
)
def test_bad_input_ids_are_named(model, prompt, message):
    with pytest.raises(ValueError, match=message):
        forerun.Decoder(model, None, "plain").generate(prompt, 5)


def test_one_call_form_takes_generation_arguments_and_keeps_knobs_apart(model):
    prompt = prompts(1)[0]
    sampled = forerun.generate(model, prompt, "trie", 8, do_sample=True, temperature=0.7, seed=3, eos_token_id=[])
    again = forerun.generate(model, prompt, "trie", 8, do_sample=True, temperature=0.7, seed=3, eos_token_id=[])
    assert torch.equal(sampled.sequences, again.sequences) and len(sampled.new_tokens) == 8
    greedy = forerun.generate(model, prompt, "prompt_lookup", 30, knobs={"draft_len": 4}, eos_token_id=[])
    assert torch.equal(greedy.sequences, plain(model, prompt))


@pytest.mark.parametrize("method", ["prompt_lookup", "auto"])
def test_classifier_free_guidance_equals_generate(model, method):
    """Its processor runs the model on a cache of its own, fed once per scored position: exact only while the walk
    scores the committed tokens in order (not at every node at once)."""
    prompt = prompts(1)[0]
    got = forerun.Decoder(model, None, method).generate(prompt, 30, guidance_scale=2.0, eos_token_id=[])
    assert torch.equal(got.sequences, plain(model, prompt, guidance_scale=2.0))
    assert got.stats.tokens_per_forward > 1.2  # drafts were accepted: the walk went past the root


def test_the_models_own_generation_config_is_taken_as_generate_takes_it():
    """An instruct model may ship a repetition penalty (Qwen2.5's 1.05) or an n-gram ban in its generation config:
    `model.generate(do_sample=False)` applies them, so greedy requests do too, alone, batched and sampled."""
    model = tiny_model("llama")
    assert not config_processes(model.generation_config)  # ids and `_from_model_config` build nothing
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 3
    texts = prompts(3)
    expected = [plain(model, p) for p in texts]
    assert not torch.equal(expected[0], plain(model, texts[0], repetition_penalty=1.0, no_repeat_ngram_size=0))
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    assert torch.equal(decoder.generate(texts[0], 30, eos_token_id=[]).sequences, expected[0])
    batched = decoder.generate(texts, 30, eos_token_id=[])
    assert all(torch.equal(r.sequences, want) for r, want in zip(batched, expected, strict=True))
    sampled = decoder.generate(texts[0], 30, eos_token_id=[], do_sample=True, seed=1, top_k=1)  # top-k 1: greedy
    assert torch.equal(sampled.sequences, expected[0])
    model.generation_config.num_beams = 2  # generate would beam search: refused, not decoded greedily
    with pytest.raises(ValueError, match="the model's generation config with this request's settings ask for beam"):
        decoder.generate(texts[0], 30)
    assert torch.equal(decoder.generate(texts[0], 30, eos_token_id=[], num_beams=1).sequences, expected[0])


def test_greedy_rows_with_processors_choose_at_once_as_on_a_card(model, monkeypatch):
    """On a card a greedy row whose logits are processed (a repetition penalty) takes every node's choice in one
    copy, not a host sync per walked node; forced here on the CPU, alone and batched: generate's text."""
    from forerun import draws, row

    made = []
    monkeypatch.setattr(row, "choose_at_once", lambda logits: True)
    monkeypatch.setattr(row, "chosen_at_once", lambda scores: made.append(1) or draws.chosen(scores))
    texts = prompts(3)
    expected = [plain(model, p, repetition_penalty=1.3) for p in texts]
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    alone = decoder.generate(texts[0], 30, eos_token_id=[], repetition_penalty=1.3)
    assert torch.equal(alone.sequences, expected[0]) and len(made) == alone.stats.forwards
    batched = decoder.generate(texts, 30, eos_token_id=[], repetition_penalty=1.3)
    assert all(torch.equal(r.sequences, want) for r, want in zip(batched, expected, strict=True))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_logit_bias_decodes_as_plain_generate_with_sequence_bias(family, attention):
    """The server's `logit_bias` is transformers' `sequence_bias` of single tokens: every method, alone and batched,
    writes what plain generate with it writes, and the bias changes the text (the control)."""
    biased_model = tiny_model(family, attention)
    texts = prompts(2)
    unbiased = plain(biased_model, texts[0])[0, texts[0].shape[1] :].tolist()
    bias = {(max(set(unbiased), key=unbiased.count),): -100.0, (unbiased[5],): 3.0}
    expected = [plain(biased_model, p, sequence_bias=bias) for p in texts]
    assert not torch.equal(expected[0], plain(biased_model, texts[0]))
    for method in ("prompt_lookup", "trie", "auto"):
        decoder = forerun.Decoder(biased_model, None, method, latency=CURVE)
        assert torch.equal(decoder.generate(texts[0], 30, eos_token_id=[], sequence_bias=bias).sequences, expected[0])
        batched = decoder.generate(texts, 30, eos_token_id=[], sequence_bias=bias)
        assert all(torch.equal(r.sequences, want) for r, want in zip(batched, expected, strict=True)), method


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_frequency_and_presence_penalties_decode_as_plain_generate_with_their_processor(family, attention):
    """OpenAI's penalties (`forerun.penalties`): every method, alone and batched, writes what plain generate writes
    with the processor given as its `logits_processor`; they change the text (the control), and drafts are accepted
    under them (a negative frequency penalty favours repeats: the tree's nodes are scored with their own paths)."""
    model = tiny_model(family, attention)
    texts = prompts(2)
    for frequency, presence in ((0.8, 0.0), (0.0, 1.5), (-1.0, 0.3)):
        expected = [
            plain(model, p, logits_processor=LogitsProcessorList([OccurrencePenalty(frequency, presence, p.shape[1])]))
            for p in texts
        ]
        assert not torch.equal(expected[0], plain(model, texts[0]))
        settings = dict(eos_token_id=[], frequency_penalty=frequency, presence_penalty=presence)
        for method in ("prompt_lookup", "trie", "auto"):
            decoder = forerun.Decoder(model, None, method, latency=CURVE)
            alone = decoder.generate(texts[0], 30, **settings)
            assert torch.equal(alone.sequences, expected[0]), (method, frequency, presence)
            if frequency < 0:
                assert alone.stats.forwards < 30, method  # drafts were accepted: the tree was scored
            batched = decoder.generate(texts, 30, **settings)
            assert all(torch.equal(r.sequences, want) for r, want in zip(batched, expected, strict=True)), method


def test_a_requests_own_pad_id_is_taken(model):
    prompt = prompts(1)[0]
    got = forerun.Decoder(model, None, "prompt_lookup").generate(prompt, 30, pad_token_id=3, eos_token_id=[])
    assert torch.equal(got.sequences, plain(model, prompt))


def test_stop_strings_are_cheap_and_stop_where_the_string_completes(model):
    prompt = prompts(1)[0]
    reference = plain(model, prompt)[0, prompt.shape[1] :].tolist()
    text = LetterTokenizer().decode(reference)
    stop = text[10:13]  # a string the answer reaches at its 13th token (or earlier)
    end = text.find(stop) + len(stop)
    decoder = forerun.Decoder(model, LetterTokenizer(), "prompt_lookup", latency=CURVE)
    started = time.perf_counter()
    result = decoder.generate(prompt, 30, stop=["zzzz" * 1250, stop, *[f"q{i}" for i in range(2000)]], eos_token_id=[])
    assert time.perf_counter() - started < 30  # setting up 2,002 stop strings, one of 5,000 characters: no table
    assert result.new_tokens == reference[:end]


def test_logprobs_equal_the_log_softmax_of_plain_generate_logits(model):
    prompt = prompts(1)[0]
    out = plain(model, prompt, output_logits=True, return_dict_in_generate=True)
    expected = [torch.log_softmax(row[0].float(), -1) for row in out.logits]
    accepted = 0
    for method in ("plain", "prompt_lookup", "jacobi", "auto"):  # chains, and a window whose kept nodes skip others
        result = forerun.Decoder(model, None, method, latency=CURVE).generate(prompt, 30, eos_token_id=[], logprobs=3)
        assert torch.equal(result.sequences, out.sequences)
        assert len(result.logprobs) == 30 and result.stats.forwards <= 30
        accepted += result.stats.accepted
        for entry, row, token in zip(result.logprobs, expected, result.new_tokens, strict=True):
            assert entry.token == token
            assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    assert accepted > 0  # drafted tokens were accepted: their logprobs come from the nodes they were chosen at
    sampled = forerun.Decoder(model, None, "trie").generate(
        prompt, 6, do_sample=True, seed=1, logprobs=0, eos_token_id=[]
    )  # no end of text: six tokens whatever the seed draws
    assert len(sampled.logprobs) == 6 and all(entry.top == () and entry.logprob <= 0 for entry in sampled.logprobs)
    assert forerun.Decoder(model, None, "plain").generate(prompt, 4).logprobs is None


def test_prediction_drafts_the_answer_and_changes_nothing(model):
    prompt = prompts(1)[0]
    reference = plain(model, prompt, 40)
    answer = reference[0, prompt.shape[1] :].tolist()
    edited = answer[:12] + [5, 6, 7] + answer[15:]  # the caller's guess, wrong in three places
    for method in ("plain", "auto", "trie"):
        decoder = forerun.Decoder(model, None, method, latency=CURVE)
        result = decoder.generate(prompt, 40, eos_token_id=[], prediction=edited)
        assert torch.equal(result.sequences, reference), method
        assert result.accepted_prediction_tokens >= 30  # re-synchronised after the wrong tokens
        assert result.prediction_tokens == 40
        assert result.rejected_prediction_tokens == 40 - result.accepted_prediction_tokens
        assert result.stats.forwards < 15
    without = forerun.Decoder(model, None, "plain", latency=CURVE).generate(prompt, 40, eos_token_id=[])
    assert without.accepted_prediction_tokens == 0 and without.prediction_tokens == 0


def test_prediction_drafter_resynchronises_by_ngram():
    drafter = PredictionDrafter([10, 11, 12, 13, 14, 15, 16])
    ctx = DraftContext([1, 2], 2, 64, frozenset())
    drafter.start(ctx)
    assert drafter.propose(ctx).tokens == [2, 10, 11, 12, 13, 14, 15, 16]  # nothing written yet: from the start
    ctx.tokens += [10, 11, 99, 13]  # the answer changed 12 into 99, then came back
    assert drafter.propose(ctx).tokens == [13, 14, 15, 16]
    ctx.tokens += [14, 15, 16]
    assert drafter.propose(ctx).tokens == [16]  # the prediction is used up


def test_prediction_drafter_proposes_the_text_after_a_replaced_token():
    """A renamed word: the answer writes 99 where the prediction has 12. The lookup finds 99 only further off (a
    coincidence), and had jumped there; now the text after 12 is proposed first, the lookup's beside it, and the
    branch the answer takes moves the cursor."""
    drafter = PredictionDrafter([10, 11, 12, 13, 14, 15, 16, 17, 99, 18, 19])
    ctx = DraftContext([1, 2], 2, 64, frozenset())
    drafter.start(ctx)
    tree = drafter.propose(ctx)
    fed = {node: node for node in range(len(tree))}
    ctx.tokens += [10, 11, 99]  # 10 and 11 accepted, then the answer's own 99 where 12 was proposed
    drafter.observe(ctx, StepOutcome(tree, Verdict([1, 2], 99), torch.zeros(1), [10, 11, 99], fed))
    tree = drafter.propose(ctx)
    assert tree.tokens[:2] == [99, 13] and tree.parents[1] == 0  # the text after 12 first
    lookup = [node for node in range(1, len(tree)) if tree.parents[node] == 0 and tree.tokens[node] == 18]
    assert len(lookup) == 1 and tree.scores[1] > tree.scores[lookup[0]]  # the lookup's jump beside it
    ctx.tokens += [13, 14, 7]  # the answer follows the first branch for two tokens
    fed = {node: node for node in range(len(tree))}
    drafter.observe(ctx, StepOutcome(tree, Verdict([1, 2], 7), torch.zeros(1), [13, 14, 7], fed))
    assert drafter.cursor == 5 and drafter.replaced == 5
    assert drafter.propose(ctx).tokens == [7, 16, 17, 99, 18, 19]  # 7 replaced 15 (found nowhere): what follows 15
