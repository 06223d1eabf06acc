"""Models outside forerun's cache contract: hybrids with recurrent states verify one chain a step, exactly, alone,
batched and through the drop-in (or decode one token per forward where a chain is another computation); models
keeping a state of their own are refused by name; a decoder that takes no position ids verifies no trees."""

from __future__ import annotations

import pytest
import torch
from random_case import plain_greedy
from transformers import AutoConfig, AutoModelForCausalLM

import forerun
from forerun.costmodel import LatencyCurve
from forerun.forward_inputs import cache_argument, forward_parameters

from helpers import without_recording
from tiny_models import COMMON, STATE_SPACE_FAMILIES, STATEFUL_FAMILIES, LetterTokenizer, prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
"""A flat curve: wherever trees can be verified, the cost model feeds them."""


def plain(model, prompt, new_tokens=24):
    """generate's greedy text, every prompt token read as text (a next turn's prompt may hold the pad id 0)."""
    return plain_greedy(model, prompt, new_tokens)


def fifth_wrong(model, want: torch.Tensor) -> list[int]:
    """generate's answer in `want` (after a 24-token prompt) with every fifth token changed: a prediction whose
    chains are accepted whole, in part and not at all."""
    vocab = model.config.vocab_size
    return [token if i % 5 != 3 else 3 + (token - 2) % (vocab - 3) for i, token in enumerate(want[0, 24:].tolist())]


def predicted_run(model, rows: int) -> tuple[list, list, forerun.Decoder, forerun.GenerationResult]:
    """`rows` prompts, generate's texts for them, an `auto` Decoder on the flat curve, and the first prompt decoded
    with its answer predicted, every fifth token wrong (`fifth_wrong`)."""
    texts = prompts(rows, length=24)
    expected = [plain(model, text) for text in texts]
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    predicted = decoder.generate(texts[0], 24, eos_token_id=[], prediction=fifth_wrong(model, expected[0]))
    return texts, expected, decoder, predicted


def assert_batched_and_dropin_equal(model, decoder, texts, expected) -> None:
    """`texts` as one batch, and the second through the drop-in, write `expected` (generate's, 24 tokens)."""
    batch = decoder.generate(texts, 24, eos_token_id=[])
    assert all(torch.equal(r.sequences, want) for r, want in zip(batch, expected, strict=True))
    dropin = model.generate(
        texts[1], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
        custom_generate=forerun.hf_generate, forerun_method="prompt_lookup",
    )  # fmt: skip
    assert torch.equal(dropin, expected[1])


PLAIN_ONLY = {"recurrent_gemma": 0.04, "zamba": 3.5e-4}
"""Hybrids whose chain of tokens after their states gives other logits than one forward over the text (this share
of the logits' spread, measured; fp32's allowance is 1e-4): their multi-token forward is another computation than
their one-token step (Zamba's scans its Mamba layers from no state: what it read before is lost). They decode one
token per forward. (Jamba's was too, 0.00027 of the spread, until its chain's tokens were fed as its steps are,
their states recorded: transformers 5.25.)"""
CHAIN_FAMILIES = sorted(set(STATEFUL_FAMILIES) - set(PLAIN_ONLY))
RECORDING = [("qwen3_next", True), ("qwen3_next", False), ("lfm2", True)]
"""Families, and whether their forward's recording of each guess's recurrent state is used: where it is not
(`helpers.without_recording`, as for a model whose forward writes none), a partly accepted chain's states are put
back from a copy and its head fed again; else cut back (LFM2's convolution windows, the others' recurrent states),
nothing fed again."""


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", CHAIN_FAMILIES)
def test_a_hybrid_with_recurrent_states_verifies_chains_exactly(family, attention):
    """Bamba, Falcon-H1, Granite 4, Jamba, LFM2, Nemotron-H, OLMo hybrid, Qwen3.5, Qwen3-Next, Zamba 2: their
    recurrent states cannot step back to a rejected guess by themselves. Each step verifies one chain: where part
    of it is rejected, the states are cut back to the last accepted token (recorded through the step: LFM2's
    convolution windows, and every recurrent state a model's forward writes where asked). Alone, batched (rows'
    chains side by side) and through the drop-in, the text is generate's, in fewer forwards; eager and sdpa."""
    model = tiny_model(family, attention)
    texts = prompts(3, length=24)
    expected = [plain(model, p) for p in texts]
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    results = [decoder.generate(text, 24, eos_token_id=[]) for text in texts]
    assert all(torch.equal(r.sequences, want) for r, want in zip(results, expected, strict=True))
    assert all(r.stats.fallback_reason is None and r.stats.fed_tokens > r.stats.forwards for r in results)
    # a prediction right but for every fifth token: chains accepted whole, in part (states cut back) and not at all
    wrong = fifth_wrong(model, expected[0])
    predicted = decoder.generate(texts[0], 24, eos_token_id=[], prediction=wrong)
    assert torch.equal(predicted.sequences, expected[0])
    stats = predicted.stats
    assert stats.accepted >= 12 and stats.forwards < 14, stats.summary()
    assert stats.fed_again == 0, stats.summary()
    assert_batched_and_dropin_equal(model, decoder, texts, expected)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_hybrid_whose_forward_does_not_record_puts_its_states_back(family, monkeypatch):
    """Where a model's forward writes no guess's recurrent state (`helpers.without_recording`), a chain accepted
    in part has every state put back from a copy taken before it, and its accepted head fed again in front of the
    next step: the text is generate's, alone and batched (rows one token each, a lone row chaining)."""
    without_recording(monkeypatch)
    model = tiny_model(family)
    texts, expected, decoder, predicted = predicted_run(model, 3)
    assert torch.equal(predicted.sequences, expected[0])
    assert predicted.stats.accepted >= 12 and predicted.stats.fed_again > 0, predicted.stats.summary()
    assert_batched_and_dropin_equal(model, decoder, texts, expected)


@pytest.mark.parametrize(("family", "records"), RECORDING)
def test_a_hybrid_samples_the_same_text_whatever_drafted_it(family, records, monkeypatch):
    """A seed fixes the text: chains draw, at every position, what `plain` draws there (the step's noise is the
    position's), so the chains put back leave no trace in what is sampled. The guesses: `plain`'s own sample as a
    prediction, every fifth token wrong, beside prompt lookup."""
    if not records:
        without_recording(monkeypatch)
    model = tiny_model(family)
    options = dict(do_sample=True, temperature=0.8, top_p=0.95, eos_token_id=[])
    drafting = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    for seed, text in enumerate(prompts(3, length=24)):
        alone = forerun.Decoder(model, None, "plain").generate(text, 24, seed=seed, **options)
        wrong = fifth_wrong(model, alone.sequences)
        guessed = drafting.generate(text, 24, seed=seed, prediction=wrong, **options)
        assert torch.equal(guessed.sequences, alone.sequences)
        assert guessed.stats.accepted >= 4, guessed.stats.summary()
        assert (guessed.stats.fed_again > 0) == (not records), guessed.stats.summary()


@pytest.mark.parametrize("family", sorted(PLAIN_ONLY))
def test_a_hybrid_whose_chains_differ_decodes_one_token_per_forward(family):
    """Zamba's and RecurrentGemma's forward over several tokens after their states is not their one-token
    step: they decode plainly, exactly, and the Decoder says why, alone and batched."""
    model = tiny_model(family)
    texts = prompts(2, length=24)
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    result = decoder.generate(texts[0], 24, eos_token_id=[])
    assert torch.equal(result.sequences, plain(model, texts[0]))
    assert f"{type(model).__name__} gives a chain of guesses after its states other logits" in (
        result.stats.fallback_reason
    )
    assert result.stats.forwards == 24 and result.stats.fed_again == 0
    batch = decoder.generate(texts, 24, eos_token_id=[])
    assert all(torch.equal(r.sequences, plain(model, t)) for r, t in zip(batch, texts, strict=True))


CHAIN_STATE_SPACE = {"mamba", "mamba2", "falcon_mamba"}
"""Whose forward over a chain after its states is its one-token step's computation: every one, now that a chain's
tokens are fed as steps, their states recorded (transformers 5.25; Mamba's and Falcon-Mamba's scan over several
tokens rounded otherwise, and they decoded one token per forward)."""


@pytest.mark.parametrize("family", sorted(STATE_SPACE_FAMILIES))
def test_a_state_space_model_decodes_exactly(family):
    """Mamba's family keeps its states in a transformers cache that it takes, from transformers 5.24 on, under the
    name every model takes it (`cache`): forerun decodes it, exactly (its cache holds no keys to count tokens by).
    Each verifies chains (a prediction wrong every fifth token: chains accepted whole, in part and not at all), the
    states of a chain's tokens recorded and cut back. Before 5.24 the state went in `cache_params`, which forerun
    cannot name: refused by name."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **COMMON, **STATE_SPACE_FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config).eval()
    if cache_argument(model) is None:
        with pytest.raises(ValueError, match=rf"{type(model).__name__}\.forward takes no transformers cache.*`cache_"):
            forerun.Decoder(model, None, "plain")
        return
    texts, expected, decoder, predicted = predicted_run(model, 2)
    assert torch.equal(predicted.sequences, expected[0])
    if family in CHAIN_STATE_SPACE:
        assert predicted.stats.fallback_reason is None and predicted.stats.fed_again == 0, predicted.stats.summary()
        assert predicted.stats.forwards < 14
    else:
        assert "one token per forward" in predicted.stats.fallback_reason and predicted.stats.forwards == 24
    assert_batched_and_dropin_equal(model, decoder, texts, expected)


def test_a_model_keeping_a_state_of_its_own_is_refused_by_name():
    """RWKV keeps its state in `state`: forerun passed its cache as the cache argument, which its forward does not
    take, so every step saw only its own tokens (other text than generate, silently). Refused, by name."""
    settings = dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, context_length=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("rwkv", **COMMON, **settings)).eval()
    for make in (
        lambda: forerun.Decoder(model, None, "plain"),
        lambda: model.generate(prompts(1)[0], max_new_tokens=4, custom_generate=forerun.hf_generate),
    ):
        with pytest.raises(ValueError, match=r"RwkvForCausalLM\.forward takes no transformers cache.*`state`"):
            make()


def test_a_stateful_draft_model_is_refused_by_name():
    target, draft = tiny_model("llama"), tiny_model("jamba")
    with pytest.raises(ValueError, match="draft model JambaForCausalLM keeps recurrent states"):
        forerun.Decoder(target, None, "draft_model", draft_model=draft)


def test_a_decoder_counting_positions_from_its_cache_verifies_no_trees():
    """TrOCR's decoder takes no position ids: it places each token fed at the cache's length, so a tree's second
    branch was placed one further than its depth (its logits off by about the spread of the logits)."""
    config = AutoConfig.for_model("trocr", **COMMON, d_model=64, decoder_layers=2, decoder_attention_heads=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    texts = prompts(2, length=24)
    decoder = forerun.Decoder(model, None, "prompt_lookup+jacobi", latency=CURVE)
    for text in texts:
        result = decoder.generate(text, 24, eos_token_id=[])
        assert torch.equal(result.sequences, plain(model, text))
        assert "TrOCRForCausalLM.forward takes no position_ids" in result.stats.fallback_reason


def test_wrappers_are_read_through_to_the_model_they_hold():
    """A PEFT model forwards `*args, **kwargs` to the model it wraps (`get_base_model`), as `torch.compile`'s
    module does to `_orig_mod`: the wrapped model's arguments are the ones read."""
    model = tiny_model("llama")

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    assert {cache_argument(model), "position_ids"} <= forward_parameters(Wrapper(model))
    assert cache_argument(Wrapper(model)) == cache_argument(model)
    assert forward_parameters(torch.compile(model)) == forward_parameters(model)
    bare = torch.nn.Module()
    bare.forward = lambda *args, **kwargs: None
    assert forward_parameters(bare) is None


def test_the_reason_is_told_once_per_decoder_not_per_request(caplog):
    """A server on a hybrid model had logged the same warning for every request."""
    model = tiny_model("recurrent_gemma")
    with caplog.at_level("WARNING", logger="forerun"):
        decoder = forerun.Decoder(model, None, "auto", latency_cache=None)
        built = [record.getMessage() for record in caplog.records if record.name.startswith("forerun")]
        caplog.clear()
        for text in prompts(3):
            decoder.generate(text, 8, eos_token_id=[])
        decoder.generate(prompts(2), 8, eos_token_id=[])
    assert len(built) == 1 and "auto decodes one token per forward" in built[0] and "RecurrentGemma" in built[0]
    assert [record.getMessage() for record in caplog.records if record.name.startswith("forerun")] == []


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_a_hybrids_next_turn_starts_from_the_cache_of_the_last(family):
    """A conversation's next turn begins with all of the last turn (prompt and answer): a hybrid's whole cache,
    recurrent states included, is kept after a request and seeds a prompt that begins with all of its text (it had
    read the whole conversation again every turn). Another salt's prompt, or one that shares only part of the text,
    is read from the start."""
    model = tiny_model(family)
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    first = decoder.generate(prompts(1, length=24)[0], 24, eos_token_id=[])
    following = torch.cat([first.sequences, torch.tensor([[5, 6, 7, 8, 9]])], dim=1)  # the next user message
    second = decoder.generate(following, 24, eos_token_id=[], logprobs=1)
    assert torch.equal(second.sequences, plain(model, following))
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(following, 24, eos_token_id=[], logprobs=1)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second.logprobs, read.logprobs, strict=True)) < 1e-5
    assert second.stats.cached_prompt_tokens >= 24 + 24 - 1 - second.stats.fed_again  # all that was cached
    assert decoder.generate(following, 24, eos_token_id=[], cache_salt="other").stats.cached_prompt_tokens == 0
    changed = following.clone()
    changed[0, 30] = 3 + (int(changed[0, 30]) - 2) % 90  # shares only 30 tokens with the stored text
    third = decoder.generate(changed, 24, eos_token_id=[])
    assert torch.equal(third.sequences, plain(model, changed)) and third.stats.cached_prompt_tokens == 0


@pytest.mark.parametrize(("family", "records"), RECORDING)
def test_a_turn_ending_on_a_chain_accepted_in_part_seeds_the_next_with_all_it_read(family, records, monkeypatch):
    """Every step a chain, every fourth guess wrong: what the cache has read when the answer ends (LFM2: its
    windows cut back after each chain, the last included; Qwen3-Next: its recurrent states cut back, or, not
    recorded, put back and accepted heads fed again) seeds the next turn, and nothing more."""
    if not records:
        without_recording(monkeypatch)
    model = tiny_model(family)
    text = prompts(1, length=24)[0]
    answer = plain(model, text, 24)[0, 24:].tolist()
    wrong = [t if i % 4 != 3 else 3 + (t - 2) % 90 for i, t in enumerate(answer)]
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    first = decoder.generate(text, 24, eos_token_id=[], prediction=wrong)
    assert torch.equal(first.sequences, plain(model, text)) and first.stats.forwards < 24
    waiting = len(decoder.base.pending)  # accepted tokens the cache had not read yet
    assert waiting == 0 if records else first.stats.fed_again > 0
    following = torch.cat([first.sequences, torch.tensor([[5, 6, 7, 8, 9]])], dim=1)
    second = decoder.generate(following, 16, eos_token_id=[])
    assert torch.equal(second.sequences, plain(model, following, 16))
    assert second.stats.cached_prompt_tokens == 24 + 24 - 1 - waiting  # the answer's last token was never fed


@pytest.mark.parametrize(("family", "records"), [("qwen3_5_text", True), ("qwen3_5_text", False), ("lfm2", True)])
def test_an_answer_ending_with_tokens_waiting_seeds_the_next_turn_with_what_was_read(family, records, monkeypatch):
    """A chain right for two tokens, then wrong, where the target writes its EOS: the answer ends there. States
    put back (not recorded) are the prompt's, the two accepted tokens waiting to be fed, so the kept cache is the
    prompt's; Qwen3.5's recorded recurrent states and LFM2's windows were cut back after them, so it is the prompt
    and the two. The next turn reads the rest."""
    if not records:
        without_recording(monkeypatch)
    model = tiny_model(family)
    text = prompts(1, length=24, seed=3)[0]
    answer = plain(model, text, 3)[0, 24:].tolist()
    assert answer[2] not in answer[:2]
    wrong = (answer[2] + 1) % model.config.vocab_size
    decoder = forerun.Decoder(model, None, "plain", latency=CURVE, latency_cache=None)
    first = decoder.generate(text, 16, eos_token_id=[answer[2]], prediction=[*answer[:2], wrong])
    assert first.new_tokens == answer and first.stats.forwards == 2
    following = torch.cat([first.sequences, torch.tensor([[5, 6, 7]])], dim=1)
    second = decoder.generate(following, 12, eos_token_id=[])
    assert torch.equal(second.sequences, plain(model, following, 12))
    assert second.stats.cached_prompt_tokens == (26 if records else 24)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_system_prompt_two_prompts_began_with_seeds_the_next(family):
    """Prompts that share a system prompt but not their user message: a hybrid's cache can seed only a prompt that
    begins with all of a stored text, so each was read from the start. The second prompt finds the head it shares
    with the first, reads it alone and keeps the cache there; a third that begins with it is seeded from it, and
    writes generate's text (logprobs within 1e-5 of reading it whole). Conversations still continue from their
    whole last turn; another salt sees none of it."""
    model = tiny_model(family)
    system = prompts(1, length=40, seed=7)[0]
    users = [torch.tensor([[5 + i, 6, 7 + i, 8, 9 + i]]) for i in range(4)]
    texts = [torch.cat([system, user], dim=1) for user in users]
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    first, second = (decoder.generate(text, 16, eos_token_id=[]) for text in texts[:2])
    assert first.stats.cached_prompt_tokens == second.stats.cached_prompt_tokens == 0
    assert torch.equal(second.sequences, plain(model, texts[1], 16))
    third = decoder.generate(texts[2], 16, eos_token_id=[], logprobs=1)
    assert third.stats.cached_prompt_tokens == 40  # the system prompt
    assert torch.equal(third.sequences, plain(model, texts[2], 16))
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(texts[2], 16, eos_token_id=[], logprobs=1)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(third.logprobs, read.logprobs, strict=True)) < 1e-5
    following = torch.cat([third.sequences, torch.tensor([[11, 12, 13, 14, 15]])], dim=1)
    assert decoder.generate(following, 16, eos_token_id=[]).stats.cached_prompt_tokens > 45 + 8
    assert decoder.generate(texts[3], 16, eos_token_id=[], cache_salt="other").stats.cached_prompt_tokens == 0
    assert decoder.generate(texts[3], 16, eos_token_id=[]).stats.cached_prompt_tokens == 40


@pytest.mark.parametrize("cut_by", ["max_new_tokens", "stop"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "lfm2"])
def test_an_answer_cut_inside_a_chain_leaves_no_states_behind(family, cut_by):
    """The last chain of an answer can be accepted past its end (a stop string completes inside it; a chain of
    more than `max_new_tokens` is capped before it is fed): the cache then read tokens the text does not hold,
    and kept as the whole of that text its states would seed a next turn with words nobody wrote (other logits,
    or a cache longer than the text). Such a cache is not kept; the next turn writes generate's text."""
    model = tiny_model(family)
    text = prompts(1, length=24)[0]
    answer = plain(model, text, 24)[0, 24:].tolist()
    decoder = forerun.Decoder(model, LetterTokenizer(), "prompt_lookup", latency=CURVE, latency_cache=None)
    if cut_by == "stop":  # a chain of the whole answer; the stop string completes at its 9th token or before
        words = LetterTokenizer().decode(answer)
        stop, new_tokens = words[6:9], words.find(words[6:9]) + 3
        cut = decoder.generate(text, 24, eos_token_id=[], prediction=answer, stop=stop)
        assert decoder.base.held > text.shape[1] + new_tokens  # the cache read past the answer's end
    else:
        new_tokens = 10
        cut = decoder.generate(text, new_tokens, eos_token_id=[], prediction=answer)
    assert torch.equal(cut.sequences, plain(model, text, new_tokens)) and cut.stats.forwards == 2
    following = torch.cat([cut.sequences, torch.tensor([[5, 6, 7, 8, 9]])], dim=1)
    second = decoder.generate(following, 16, eos_token_id=[], logprobs=1)
    assert torch.equal(second.sequences, plain(model, following, 16))
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(following, 16, eos_token_id=[], logprobs=1)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second.logprobs, read.logprobs, strict=True)) < 1e-5
