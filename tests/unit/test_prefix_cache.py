"""The prefix cache: a prompt's head read before is not fed again, and the text stays plain generate's (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import forerun
from forerun.assembly import kv_bytes_per_token, prefix_tokens
from forerun.cli.serve import prefix_told
from forerun.costmodel import LatencyCurve
from forerun.prefixcache import MIN_REUSE, PrefixCache
from forerun.request import GenerationRequest

from tiny_models import VOCAB, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
NEW = 24


def filled(length: int, layers: int = 2, mark: float = 1.0) -> DynamicCache:
    """A cache of `layers` layers whose entry at position i holds mark * (i + 1): shapes [1, 2, length, 4]."""
    cache = DynamicCache()
    ramp = torch.arange(1, length + 1, dtype=torch.float32)[None, None, :, None].expand(1, 2, length, 4) * mark
    for index in range(layers):
        cache.update(ramp.clone(), -ramp.clone(), index)
    return cache


def test_shared_head_is_the_first_difference_at_every_length():
    """Spans of 32, 64, 128... tokens compared whole, halved where they differ: the count equals a token-by-token
    walk's, around every span's edges and at every length (a few tokens, a long conversation)."""
    from forerun.prefixcache import shared_head

    generator = torch.Generator().manual_seed(0)
    for length in (*range(0, 70), 95, 96, 97, 223, 224, 225, 480, 2100):
        text = tuple(torch.randint(0, 3, (length + 5,), generator=generator).tolist())
        for cut in {0, 1, length // 2, max(0, length - 1), length}:
            other = (*text[:cut], text[cut] + 1, *text[cut + 1 :])  # differs first at `cut`
            assert shared_head(text, other) == shared_head(other, text) == cut, (length, cut)
            assert shared_head(text[:cut], text) == cut and shared_head(text, text) == len(text)


def test_seed_takes_the_longest_shared_head_and_never_the_root():
    prefixes = PrefixCache(max_tokens=100)
    prefixes.store(list(range(10, 20)), filled(10, mark=1.0), 10)
    prefixes.store([10, 11, 12, 13, 14, 15, 99, 98], filled(8, mark=2.0), 8)
    cache = DynamicCache()
    assert prefixes.seed(cache, [10, 11, 12, 13, 14, 15, 16, 17, 50]) == 8  # the first entry shares 8
    assert cache.get_seq_length() == 8
    assert cache.layers[1].keys[0, 0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.layers[1].values[0, 0, 7, 0] == -8
    # the whole stored text as the prompt: everything but the root comes from the cache
    assert prefixes.seed(DynamicCache(), list(range(10, 20))) == 9
    # the second entry wins where it shares more
    cache = DynamicCache()
    assert prefixes.seed(cache, [10, 11, 12, 13, 14, 15, 99, 98, 7]) == 8
    assert cache.layers[0].keys[0, 0, -1, 0] == 16.0  # mark 2.0 at position 8


def test_short_heads_unlike_caches_and_a_full_cache_are_left_alone():
    prefixes = PrefixCache(max_tokens=100)
    prefixes.store(list(range(10, 20)), filled(10), 10)
    assert prefixes.seed(DynamicCache(), [10, 11, 12, 40, 41, 42]) == 0  # 3 shared < MIN_REUSE
    assert MIN_REUSE == 4
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=64)]
    assert prefixes.seed(sliding, list(range(10, 20))) == 0
    started = filled(3)
    assert prefixes.seed(started, list(range(10, 20))) == 0  # a cache that holds something already
    assert started.get_seq_length() == 3
    off = PrefixCache(max_tokens=0)
    off.store(list(range(10, 20)), filled(10), 10)
    assert off.entries == [] and off.seed(DynamicCache(), list(range(10, 20))) == 0
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        PrefixCache(max_tokens=-1)
    for bad in ("4096", 1.5, True):
        with pytest.raises(ValueError, match="a whole number of tokens"):
            PrefixCache(max_tokens=bad)


def test_store_keeps_one_entry_per_conversation_and_drops_the_least_recent():
    prefixes = PrefixCache(max_tokens=25)
    prefixes.store(list(range(100, 110)), filled(10), 10)
    prefixes.store(list(range(100, 115)), filled(15), 15)  # the next turn: replaces its head
    assert [len(entry.tokens) for entry in prefixes.entries] == [15]
    prefixes.store(list(range(100, 108)), filled(8), 8)  # a head of what is held: nothing new
    assert [len(entry.tokens) for entry in prefixes.entries] == [15]
    prefixes.store(list(range(200, 208)), filled(8), 8)
    assert prefixes.held_tokens == 23
    prefixes.seed(DynamicCache(), list(range(100, 112)))  # touch the first: the second is now least recent
    prefixes.store(list(range(300, 306)), filled(6), 6)  # 29 > 25: the least recently used goes
    assert sorted(int(entry.tokens[0]) for entry in prefixes.entries) == [100, 300]
    # a store never holds more than the cache has, nor more than the tokens given
    prefixes.store(list(range(400, 450)), filled(12), 50)
    assert len(prefixes.entries[-1].tokens) == 12


@functools.lru_cache(maxsize=8)
def model_of(family: str, impl: str) -> torch.nn.Module:
    return tiny_model(family, impl)


def conversation(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared 'system prompt' of 16 tokens, then a 'user message' of 8; ids in 3..VOCAB-1."""
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(99)),
        torch.randint(3, VOCAB, (1, 8), generator=generator),
    )


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "auto"])
@pytest.mark.parametrize(
    ("family", "impl"), [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("gpt2", "eager"), ("opt", "sdpa")]
)
def test_shared_heads_and_next_turns_equal_plain_generate(family, impl, method, static):
    """On the growing cache (a CPU's) and on the static base (a GPU's buckets and slots; eager here)."""
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, latency=CURVE, static_cache=static)
    for seed in range(3):
        system, message = conversation(seed)
        prompt = torch.cat([system, message], dim=1)
        expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        result = decoder.generate(prompt, NEW, eos_token_id=[])
        assert torch.equal(result.sequences, expected), (family, impl, method, seed)
        assert result.stats.cached_prompt_tokens == (0 if seed == 0 else 16)  # the shared system prompt
        # the next turn: the whole first turn (prompt and answer), then a new message
        follow_up = torch.cat([result.sequences, torch.randint(3, VOCAB, (1, 6))], dim=1)
        expected = model.generate(follow_up, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        result = decoder.generate(follow_up, NEW, eos_token_id=[])
        assert torch.equal(result.sequences, expected), (family, impl, method, seed, "next turn")
        # everything the first turn read: its prompt and its answer, but for the last token where that was the
        # model's own (never fed; a drafted last token was fed and verified)
        assert result.stats.cached_prompt_tokens in (prompt.shape[1] + NEW - 1, prompt.shape[1] + NEW)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_a_corrupted_entry_changes_the_text(static):
    """The control: the seeded keys and values are what the model attends to (a cache nobody read would pass the
    equality test above by itself)."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "plain", latency=CURVE, static_cache=static)
    system, message = conversation(0)
    prompt = torch.cat([system, message], dim=1)
    first = decoder.generate(prompt, NEW, eos_token_id=[])
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # in place: a static base's entry keeps its layers as views of one tensor
        for entry in decoder.prefixes.entries:
            # values: a random tiny model attends almost uniformly, so its keys matter less than what they carry
            for values in entry.values:
                values.copy_(torch.randn(values.shape, generator=generator))
    again = decoder.generate(prompt, NEW, eos_token_id=[])
    assert again.stats.cached_prompt_tokens == prompt.shape[1] - 1
    assert not torch.equal(again.sequences, first.sequences)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("method", ["plain", "auto"])
def test_batch_rows_reuse_heads_and_leave_their_text(method, static):
    """Rows on the growing cache, or at places of the static base (a row seeded at place 1 reads its own)."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, method, latency=CURVE, static_cache=static)
    rows = [torch.cat(conversation(seed), dim=1) for seed in range(4)]
    expected = [
        model.generate(row, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0) for row in rows
    ]
    results = decoder.generate([row[0].tolist() for row in rows], NEW, eos_token_id=[], batch_size=2)
    for index, (result, reference) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result.sequences, reference), (method, index)
    # row 0 found nothing; every later row found the system prompt (rows 0-1 stored theirs at their prefill); on
    # the static base rows 0-1 read their prompts side by side, in the same forwards: neither finds the other's
    assert [r.stats.cached_prompt_tokens for r in results] == [0, 0 if static else 16, 16, 16]
    # each finished row left its whole text: a next turn of row 2 reuses prompt and answer
    follow_up = torch.cat([results[2].sequences, torch.tensor([[5, 6, 7, 8]])], dim=1)
    reference = model.generate(follow_up, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    again = decoder.generate([follow_up[0].tolist(), rows[3][0].tolist()], NEW, eos_token_id=[])
    assert torch.equal(again[0].sequences, reference)
    assert again[0].stats.cached_prompt_tokens in (rows[2].shape[1] + NEW - 1, rows[2].shape[1] + NEW)
    # row 3 again, second in the batch: its whole prompt but the root from what it left
    assert torch.equal(again[1].sequences, expected[3])
    assert again[1].stats.cached_prompt_tokens == rows[3].shape[1] - 1


def test_decoders_can_share_one_prefix_cache_or_have_none():
    model = model_of("llama", "sdpa")
    shared = PrefixCache()
    first = forerun.Decoder(model, None, "plain", prefix_cache=shared)
    second = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, prefix_cache=shared)
    prompt = torch.cat(conversation(0), dim=1)
    first.generate(prompt, 4, eos_token_id=[])
    assert second.generate(prompt, 4, eos_token_id=[]).stats.cached_prompt_tokens == prompt.shape[1] - 1
    with pytest.raises(ValueError, match="'auto', a number of tokens or a PrefixCache"):
        forerun.Decoder(model, None, "plain", prefix_cache="lots")
    with pytest.raises(ValueError, match="a whole number of tokens"):
        forerun.Decoder(model, None, "plain", prefix_cache=-1)
    off = forerun.Decoder(model, None, "plain", prefix_cache=0)
    off.generate(prompt, 4, eos_token_id=[])
    assert off.generate(prompt, 4, eos_token_id=[]).stats.cached_prompt_tokens == 0


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_salted_requests_share_entries_only_with_the_same_salt(static):
    """A tenant's text is reused for its own later prompts and never seeds another salt's or an unsalted prompt
    (whose first token would come sooner: a timing channel); the text stays plain generate's throughout."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)
    prompt = torch.cat(conversation(0), dim=1)
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)

    def cached(salt, batch=False):
        if batch:
            result = decoder.generate([prompt[0].tolist()], NEW, eos_token_id=[], cache_salt=salt)[0]
        else:
            result = decoder.generate(prompt, NEW, eos_token_id=[], cache_salt=salt)
        assert torch.equal(result.sequences, expected), salt
        return result.stats.cached_prompt_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt and no salt: nothing of tenant-a's
    assert cached("tenant-a") == prompt.shape[1] - 1  # its own: the whole prompt but the root
    assert cached("tenant-b", batch=True) == prompt.shape[1] - 1  # batch rows keep to their salt too
    assert cached("tenant-c", batch=True) == 0
    job = decoder.prepare(
        GenerationRequest(prompt[0].tolist(), NEW, eos_token_id=(), cache_salt="tenant-d")
    ).job  # the server's rows
    assert job.prefixes.salt == "tenant-d"
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        decoder.generate(prompt, NEW, cache_salt=7)


def test_a_hybrids_whole_caches_keep_to_their_salt():
    """A hybrid's kept caches (states included) under one salt are never found, measured against or dropped by
    another salt's prompts: tenant b's conversation that begins with tenant a's text neither reads a's head
    apart (a timing channel) nor evicts a's entry (one tenant slowing another)."""
    prefixes = PrefixCache(max_tokens=100)
    text = list(range(10, 20))
    prefixes.keep_whole(text, filled(10), salt="a")
    longer = [*text, 30, 31, 32]
    assert prefixes.states_head(longer, salt="a") == len(text)
    assert prefixes.states_head(longer, salt="b") == 0 and prefixes.states_head(longer) == 0
    assert prefixes.find_whole(longer, salt="b") is None and prefixes.whole_copy(longer, salt="b") == (None, 0)
    prefixes.keep_whole(longer, filled(13), salt="b")  # b's next turn, beginning with a's whole text
    assert [(entry.salt, len(entry.tokens)) for entry in prefixes.entries] == [("a", 10), ("b", 13)]
    prefixes.keep_whole(longer, filled(13), salt="a")  # a's own next turn replaces a's earlier one
    assert [(entry.salt, len(entry.tokens)) for entry in prefixes.entries] == [("b", 13), ("a", 13)]
    assert prefixes.find_whole([*longer, 40], salt="a").salt == "a"


def test_a_static_base_keeps_every_layer_in_one_tensor_and_seeds_from_it_as_layer_by_layer():
    """A static base's entry holds every layer's keys and values in one tensor (`Entry.block`, its `keys` and
    `values` views of it), and a place seeded from it in one copy holds what seeding layer by layer writes."""
    from dataclasses import replace

    from forerun.base.place_prefixes import seed_place

    decoder = forerun.Decoder(model_of("llama", "sdpa"), None, "plain", latency=CURVE, static_cache=True)
    decoder.generate(torch.cat(conversation(0), dim=1), 4, eos_token_id=[])
    (entry,) = decoder.prefixes.entries
    assert entry.block is not None and entry.values[1].data_ptr() == entry.block[1, 1].data_ptr()
    base, written = decoder.base, []
    for stored in (entry, replace(entry, block=None)):
        decoder.prefixes.entries = [stored]
        with torch.inference_mode():
            base.slots.kv.zero_()
        assert seed_place(base, decoder.prefixes, [*entry.tokens, 0], place=0) == len(entry.tokens)
        written.append(base.slots.kv.clone())
    assert torch.equal(*written) and written[0].abs().sum() > 0


def test_the_static_base_seeds_only_entries_of_its_own_shape():
    """An entry whose keys and values differ in width, or in heads or dtype from the cache's layers (another
    model's, sharing a prefix cache by mistake), is not copied into a place: the prompt is read in full."""
    from forerun.base.place_prefixes import fits
    from forerun.prefixcache import Entry

    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "plain", latency=CURVE, static_cache=True)
    prompt = torch.cat(conversation(0), dim=1)
    decoder.generate(prompt, 4, eos_token_id=[])  # its layers are allocated now
    layers, (entry,) = decoder.base.cache.layers, decoder.prefixes.entries
    assert fits(layers, entry)
    tokens = entry.tokens
    for keys, values in (
        ([k[..., :2] for k in entry.keys], [v[..., :2] for v in entry.values]),  # another head width
        ([k.double() for k in entry.keys], [v.double() for v in entry.values]),  # another dtype
        (entry.keys, [v[..., :2] for v in entry.values]),  # keys and values of separate widths
    ):
        assert not fits(layers, Entry(tokens, keys, values))
    decoder.prefixes.entries = [Entry(tokens, entry.keys, [v[..., :2] for v in entry.values])]
    again = decoder.generate(prompt, 4, eos_token_id=[])
    assert again.stats.cached_prompt_tokens == 0


def test_scores_go_with_the_text_they_score_whichever_entry_keeps_it():
    """A scored prompt's entries (`forerun.scoring`) stay with its text: a longer text it heads (the answer a
    generation then wrote) takes them over, a text it heads takes them on; a prompt scored later finds the
    longest head they cover, under its own salt, with as many alternatives as it asks."""
    from forerun.logprobs import TokenLogprob

    scores = (None, *(TokenLogprob(t, -0.5, ((t, -0.5), (0, -1.0))) for t in range(2, 7)))
    prefixes = PrefixCache(max_tokens=100)
    prefixes.store([1, 2, 3, 4, 5, 6], filled(6), 6, scores=scores)
    prefixes.store([1, 2, 3, 4, 5, 6, 7, 8], filled(8), 8)  # its generation: the prompt and its answer
    (entry,) = prefixes.entries
    assert len(entry.tokens) == 8 and entry.scores == scores
    assert prefixes.find_scored([1, 2, 3, 4, 5, 6, 7, 8, 9], top=2) == (entry, 6)  # scores cover 6 tokens
    assert prefixes.find_scored([1, 2, 3, 4, 9, 9], top=2) == (entry, 4)
    assert prefixes.find_scored([1, 2, 3, 4, 5, 6, 7], top=3) == (None, 0)  # kept with two alternatives
    assert prefixes.scoped("other").find_scored([1, 2, 3, 4, 5, 6, 7], top=1) == (None, 0)
    assert prefixes.find_scored([1, 2, 3, 9, 9], top=0) == (None, 0)  # under MIN_REUSE shared
    held = PrefixCache(max_tokens=100)
    held.store([1, 2, 3, 4, 5, 6, 7, 8], filled(8), 8)
    held.store([1, 2, 3, 4, 5, 6], filled(6), 6, scores=scores)  # a head of a held text: it takes them on
    (entry,) = held.entries
    assert len(entry.tokens) == 8 and entry.scores == scores


def test_by_default_a_decoder_keeps_four_contexts_within_a_gib_and_a_long_prompt_is_read_again():
    """`prefix_cache="auto"` (the default): four of the model's contexts where their keys and values fit in
    1 GiB, else as many as fit, never fewer than 4096 tokens; a prompt past the old 4096-token default is kept,
    and the next turn that begins with it (an agent's long prompt) prefills only what is new, plain generate's."""
    small = tiny_model("llama", "sdpa", max_position_embeddings=8192)  # 2 layers, 2 key/value heads of 16
    assert prefix_tokens(small) == 4 * 8192 and forerun.Decoder(small, None, "plain").prefixes.max_tokens == 32768
    assert kv_bytes_per_token(small) == 2 * 2 * 2 * 16 * 4 == 512  # and what `forerun serve` says at start:
    assert prefix_told(32768, small) == "32,768 tokens (at most 17 MB of keys and values)"
    assert prefix_told(0, small) == "off"
    wide = tiny_model("llama", "sdpa", max_position_embeddings=8192, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=128)  # fmt: skip
    assert prefix_tokens(wide) == 2**30 // (4 * 2 * 32 * 128 * 4) == 8192  # 128 KiB a token: 1 GiB holds one context
    assert prefix_tokens(tiny_model("llama", "sdpa")) == 4096  # a 512-token context: at least 4096
    decoder = forerun.Decoder(small, None, "plain")
    prompt = torch.randint(3, VOCAB, (1, 5000), generator=torch.Generator().manual_seed(5))
    first = decoder.generate(prompt, NEW, eos_token_id=[])
    follow_up = torch.cat([first.sequences, torch.randint(3, VOCAB, (1, 6))], dim=1)
    expected = small.generate(follow_up, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    result = decoder.generate(follow_up, NEW, eos_token_id=[])
    assert torch.equal(result.sequences, expected) and result.stats.cached_prompt_tokens >= 5000 + NEW - 1
