"""The static base (slots, buckets; graphs on a GPU) gives the tokens the growing cache gives: plain generate's.

On a CPU the bucketed forward runs eagerly; what a captured graph replays is that same function, checked on a GPU
by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import forerun
from forerun.base.dynamic import DynamicBase
from forerun.base.static import StaticBase
from forerun.costmodel import LatencyCurve
from forerun.tree import TokenTree
from forerun.verify import Sampling

from helpers import OracleDrafter, RandomDrafter
from tiny_models import FAMILIES, NO_SDPA, VOCAB, prompts, tiny_model

CASES = [(f, impl) for f in FAMILIES for impl in ("eager", "sdpa") if not (impl == "sdpa" and f in NO_SDPA)]
SLIDING = {"mistral", "gemma2"}
"""Families whose layers keep a sliding window (larger than these texts: the slots serve them as full attention)."""
NEW_TOKENS = 40
METHODS = {
    "plain": {},
    "prompt_lookup": {"max_ngram": 2, "draft_len": 5, "max_branches": 2},
    "jacobi": {"window": 3, "ngram": 3, "max_candidates": 3},
    "auto": {},
}
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3))
"""A GPU's shape: wide trees are nearly free, so the cost model feeds many nodes and buckets get padded."""


@functools.lru_cache(maxsize=4)
def model_of(family: str, impl: str) -> torch.nn.Module:
    return tiny_model(family, impl)


@functools.lru_cache(maxsize=64)
def reference(family: str, impl: str, index: int) -> torch.Tensor:
    prompt = prompts(3)[index]
    return model_of(family, impl).generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)  # fmt: skip


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(("family", "impl"), CASES)
def test_static_base_equals_generate(family, impl, method):
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, latency=CURVE, static_cache=True, **METHODS[method])
    assert decoder.base is not None
    for index, prompt in enumerate(prompts(3)):  # one decoder, three requests: the slots are reused
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        expected = reference(family, impl, index)
        assert torch.equal(result.sequences, expected[:, : result.sequences.shape[1]]), (family, impl, method, index)
        assert result.sequences.shape[1] == expected.shape[1] or result.stats.fallback_reason
    if method != "plain":
        assert len(decoder.base.steps) > 1  # several buckets were fed: padding was exercised


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "opt"])
def test_oracle_and_random_drafts_on_slots(family):
    """An oracle after a decoy branch is accepted off node 1 (the commit gathers a non-contiguous path); a random
    drafter is never accepted; both leave generate's output."""
    model = model_of(family, "sdpa")
    for index, prompt in enumerate(prompts(3)):
        expected = reference(family, "sdpa", index)
        truth = expected[0].tolist()
        for drafter in (OracleDrafter(truth, 6, VOCAB), RandomDrafter(truth, VOCAB, width=3, depth=4, seed=index)):
            decoder = forerun.Decoder(model, None, "plain", drafters=[drafter], max_tree_nodes=16, static_cache=True)
            result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
            assert torch.equal(result.sequences, expected), (family, drafter.name, index)
            if drafter.name == "oracle":
                assert result.stats.tokens_per_forward > 4
            else:
                assert result.stats.accepted == 0


class ForgetfulBase(StaticBase):
    """A broken base that never gathers the accepted path: the negative control."""

    def commit(self, prefix_len: int, kept_nodes: list[int]) -> None:
        pass


def test_negative_control_a_base_that_skips_the_gather_is_caught():
    model = model_of("llama", "sdpa")
    prompt = prompts(3)[0]
    truth = reference("llama", "sdpa", 0)[0].tolist()
    decoder = forerun.Decoder(model, None, "plain", drafters=[OracleDrafter(truth, 6, VOCAB)], max_tree_nodes=16)
    decoder.base = ForgetfulBase(model)
    result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
    assert not torch.equal(result.sequences, reference("llama", "sdpa", 0))


@torch.inference_mode()
def test_a_padded_bucket_gives_the_tree_its_own_logits():
    """A 3-node tree fed as bucket 4, then a commit of the root and node 2 (a second branch), then a 2-node tree:
    the logits at real nodes match the growing cache's, and `argmax` holds their argmaxes."""
    model = model_of("llama", "eager")
    prompt = prompts(1)[0][0].tolist()
    static, dynamic = StaticBase(model, graphs=False), DynamicBase(model)
    outputs = {}
    for base in (static, dynamic):
        assert base.begin(len(prompt) + 16) is None
        base.forward(TokenTree.rooted_at(prompt[-1]), len(prompt) - 1, prompt[:-1])
        base.commit(len(prompt) - 1, [0])
        tree = TokenTree.rooted_at(7)
        tree.add(0, 11), tree.add(0, 12)  # two branches: nodes 1 and 2
        first = base.forward(tree, len(prompt), ())
        base.commit(len(prompt), [0, 2])
        follow = TokenTree.rooted_at(13)
        follow.add(0, 14)
        outputs[type(base).__name__] = (first, base.forward(follow, len(prompt) + 2, ()))
    assert {2, 4} <= {size for _, size, _ in static.steps}  # beside the prefill's bucket
    for got, want in zip(outputs["StaticBase"], outputs["DynamicBase"], strict=True):
        assert got.logits.shape == want.logits.shape
        assert torch.allclose(got.logits, want.logits, atol=1e-5)
        assert got.argmax.tolist() == got.logits.argmax(-1).tolist()


class NoEagerPrefill(StaticBase):
    """A static base whose eager prefill is refused: the prompt must go through the buckets."""

    def prefill(self, tree: TokenTree, prefix_len: int, lead) -> None:
        raise AssertionError(f"an eager forward of {len(lead)} prompt tokens and {len(tree)} nodes")


@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("qwen3", "eager"), ("gpt2", "sdpa")])
def test_a_prompt_longer_than_every_bucket_is_fed_in_chunks_through_them(family, impl):
    """Buckets of at most 4 nodes: each prompt (longer) is read in chunks of 4 and its rest rides with the first
    tree; the output is generate's, and no eager forward ran."""
    model = model_of(family, impl)
    for method, knobs in (("plain", {}), ("prompt_lookup", {"max_ngram": 2, "draft_len": 3, "max_branches": 1})):
        decoder = forerun.Decoder(model, None, method, max_tree_nodes=4, adaptive=False, **knobs)
        decoder.base = NoEagerPrefill(model, buckets=(1, 2, 4))
        for index, prompt in enumerate(prompts(3)):
            assert prompt.shape[1] > 8
            result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
            assert torch.equal(result.sequences, reference(family, impl, index)), (family, impl, method, index)


@torch.inference_mode()
def test_chunked_prefill_gives_the_growing_cache_logits():
    """A 13-token prompt through buckets of 4 (three chunks, then one lead token with a 2-node tree): the tree's
    logits equal the growing cache's one-forward prefill; a negative control shifts the lead by one slot."""
    model = model_of("llama", "eager")
    prompt = list(range(3, 16))
    tree = TokenTree.rooted_at(prompt[-1])
    tree.add(0, 20)
    static, dynamic = StaticBase(model, buckets=(1, 2, 4)), DynamicBase(model)
    got, want = (base.begin(32) or base.forward(tree, 12, prompt[:-1]) for base in (static, dynamic))
    assert got.logits.shape == want.logits.shape == (2, VOCAB)
    assert torch.allclose(got.logits, want.logits, atol=1e-5)
    assert got.argmax.tolist() == want.logits.argmax(-1).tolist()
    shifted = StaticBase(model, buckets=(1, 2, 4))
    assert shifted.begin(32) is None
    wrong = shifted.forward(tree, 13, [0, *prompt[:-1]])  # one more token in front: other positions, other logits
    assert not torch.allclose(wrong.logits, want.logits, atol=1e-3)


@torch.inference_mode()
def test_prompts_fed_side_by_side_give_each_its_own_logits():
    """Three places' prompts (10, 3 and 6 tokens; buckets of 4) fed in the same forwards: 3 forwards (the longest
    prompt's), not 6 one by one, and each place's tree gets the logits its own growing-cache prefill gives."""
    model = model_of("llama", "eager")
    texts = [list(range(3, 13)), [40, 41, 42], list(range(50, 56))]
    trees = [TokenTree.rooted_at(text[-1]) for text in texts]
    trees[2].add(0, 20)
    base = StaticBase(model, buckets=(1, 2, 4), places=3)
    assert base.begin(32) is None
    forwards = []
    run = base.run
    base.run = lambda fed, placed: forwards.append((sorted(fed), placed)) or run(fed, placed)
    got = base.forward_places({p: (trees[p], len(text) - 1, text[:-1]) for p, text in enumerate(texts)})
    assert forwards == [([0, 1, 2], False), ([0, 2], False), ([0], False)]
    for place, text in enumerate(texts):
        dynamic = DynamicBase(model)
        assert dynamic.begin(32) is None
        want = dynamic.forward(trees[place], len(text) - 1, text[:-1])
        assert got[place].logits.shape == want.logits.shape
        assert torch.allclose(got[place].logits, want.logits, atol=1e-5), place
        assert got[place].argmax.tolist() == want.logits.argmax(-1).tolist()


@pytest.mark.parametrize("at_once", [False, True])
def test_sampling_with_a_seed_repeats_and_matches_the_growing_cache(at_once, monkeypatch):
    """`at_once`: the static base's rows draw at every node at once, as on a card (`Sampling.at_once`); the
    growing cache's walk writes the same text."""
    model = model_of("qwen2", "sdpa")
    prompt = prompts(1)[0]
    texts = []
    for static in (True, True, False):
        with monkeypatch.context() as patch:
            if at_once and static:
                patch.setattr(Sampling, "draws_at_once", lambda self, logits: True)
            decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)
            out = decoder.generate(prompt, 24, do_sample=True, seed=3, temperature=1.2, eos_token_id=[])
        texts.append(out.sequences)
    assert torch.equal(texts[0], texts[1]) and torch.equal(texts[0], texts[2])


def test_static_base_refuses_what_it_cannot_serve():
    model = model_of("llama", "sdpa")
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device"):
        StaticBase(model, graphs=True)
    with pytest.raises(ValueError, match="buckets must include 1"):
        StaticBase(model, buckets=(4, 8))
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        StaticBase(model, buckets=(1, 2)).bucket(3)
    with pytest.raises(ValueError, match="static_cache must be true or false"):
        forerun.Decoder(model, None, "plain", static_cache="yes")
    assert forerun.Decoder(model, None, "plain").base is None  # a CPU keeps the growing cache by default


def test_compiled_buckets_give_the_eager_buckets_tokens():
    """A bucket's forward through torch.compile (inductor on this CPU) writes what the eager one writes: plain
    generate's tokens, single and drafted steps (two buckets, so two compilations: about half a minute)."""
    model = model_of("llama", "sdpa")
    expected = reference("llama", "sdpa", 0)
    decoder = forerun.Decoder(model, None, "prompt_lookup", max_tree_nodes=4, adaptive=False, draft_len=3,
                              max_branches=1)  # fmt: skip
    decoder.base = StaticBase(model, buckets=(1, 4), compiled=True)
    result = decoder.generate(prompts(3)[0], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(result.sequences, expected)
    assert decoder.base.steps.keys() == {(1, 1, False), (1, 4, False)} and decoder.base.settings()["compiled"] is True
    assert result.stats.tokens_per_forward > 1


@torch.inference_mode()
def test_compiled_buckets_first_fed_wide_still_compile_two_programs():
    """A compiled base first fed a wide tree (a prompt's chunk of 64 before any one-node step, as a request that
    comes before `warm_up`) prepares its one-node bucket first: dynamo then takes every later node count as
    symbolic, two programs in all, where the wide count first had compiled a third, for that count alone (inside a
    request: ~40 s on a CPU for SmolLM2-135M)."""
    from torch._dynamo.utils import counters

    base = StaticBase(model_of("llama", "sdpa"), buckets=(1, 2, 4, 8), compiled=True)
    base.begin(64)
    before = counters["stats"]["unique_graphs"]
    for n in (8, 2, 1, 4):
        tree = TokenTree.rooted_at(3)
        tree.add_chain(0, list(range(5, 4 + n)))
        base.forward(tree, 0, ())
    assert counters["stats"]["unique_graphs"] - before == 2
    assert set(base.steps) == {(1, n, False) for n in (1, 2, 4, 8)}


def test_compile_buckets_without_the_static_cache_says_so(caplog):
    """The static cache is off by default on a CPU: `compile_buckets` alone compiles nothing there, and a warning
    says so and how to turn it on, where it had been ignored in silence; without the option, no warning."""
    model = model_of("llama", "sdpa")
    with caplog.at_level(logging.WARNING):
        asked = forerun.Decoder(model, None, "plain", compile_buckets=True, latency=CURVE)
        plain = forerun.Decoder(model, None, "plain", latency=CURVE)
    assert asked.base is None and plain.base is None
    warned = [r.getMessage() for r in caplog.records if "compile_buckets" in r.getMessage()]
    assert len(warned) == 1 and "static_cache=True turns them on" in warned[0]


def test_a_longer_text_on_compiled_buckets_compiles_once_more_and_stays_exact():
    """A text longer than the cache holds makes a larger one: its programs compile once more (the slot count is a
    static size until a second one is seen: marked symbolic from the start, every program compiled 2-3x slower),
    and the tokens are plain generate's."""
    from torch._dynamo.utils import counters

    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", max_tree_nodes=4, adaptive=False, draft_len=3,
                              max_branches=1)  # fmt: skip
    decoder.base = StaticBase(model, buckets=(1, 4), compiled=True)
    decoder.generate(prompts(3)[0], NEW_TOKENS, eos_token_id=[])
    short, before = decoder.base.length, counters["stats"]["unique_graphs"]
    long = prompts(1, length=470)[0]  # with its answer past 512 slots, inside the context (512)
    result = decoder.generate(long, NEW_TOKENS, eos_token_id=[])
    expected = model.generate(long, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert decoder.base.length > short and 0 < counters["stats"]["unique_graphs"] - before <= 2
    assert torch.equal(result.sequences, expected)


def test_one_row_of_a_list_takes_the_static_base():
    """generate([prompt]) and batch_size=1 decode on the single row's static base (a batch takes its sibling):
    the same tokens as generate(prompt)."""
    model = model_of("qwen2", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True)
    single = decoder.generate(prompts(3)[1], NEW_TOKENS, eos_token_id=[])
    decoder.base.steps.clear()
    (listed,) = decoder.generate([prompts(3)[1]], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(listed.sequences, single.sequences) and decoder.base.steps  # its buckets were used again
    one_by_one = decoder.generate(prompts(3)[:2], NEW_TOKENS, eos_token_id=[], batch_size=1)
    assert torch.equal(one_by_one[1].sequences, single.sequences)
    assert torch.equal(one_by_one[0].sequences, reference("qwen2", "sdpa", 0))


def test_a_text_longer_than_a_sliding_window_takes_the_growing_cache():
    """Within its window a sliding layer holds every token (slots serve it); where prompt + answer + a tree (24 +
    40 + the cost model's 64 nodes) reach the window of 128, the request decodes on the growing cache, which
    decodes it plainly: still generate's tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_models import COMMON, LLAMA_LIKE

    config = AutoConfig.for_model("mistral", **COMMON, **{**LLAMA_LIKE, "sliding_window": 128})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True)
    prompt = prompts(1)[0]
    for new, on_slots in ((8, True), (40, False)):
        decoder.base.steps.clear()
        expected = model.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        result = decoder.generate(prompt, new, eos_token_id=[])
        assert torch.equal(result.sequences, expected), new
        assert bool(decoder.base.steps) == on_slots, new


def test_warm_up_makes_every_bucket_before_the_first_request():
    """warm_up prepares every bucket for texts up to its length (a request that fits uses them, same tokens as
    plain generate); without a static cache it does nothing."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True)
    assert decoder.base.steps == {}
    decoder.warm_up(200)
    assert set(decoder.base.steps) == {(1, size, False) for size in decoder.base.buckets}
    steps, length = dict(decoder.base.steps), decoder.base.length
    result = decoder.generate(prompts(3)[0], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(result.sequences, reference("llama", "sdpa", 0))
    assert decoder.base.length == length and all(decoder.base.steps[s] is steps[s] for s in steps)  # reused
    assert forerun.Decoder(model, None, "plain").warm_up(200) == 0.0  # a CPU's default: the growing cache
    for bad in (0, -5, 2.5, True, "200", 10**12):  # refused before anything is allocated
        with pytest.raises(ValueError, match="warm_up's max_len"):
            decoder.warm_up(bad)


def test_warm_up_for_a_batch_size_makes_every_step_its_rows_take():
    """warm_up(..., batch_size=3): the 3-place sibling's steps for 1, 2 and 3 rows and its joining rows' placed
    steps, every bucket; three prompts decoded together then make no step of their own (and write generate's)."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True)
    decoder.warm_up(200, batch_size=3)
    rows, buckets = decoder.base.siblings[3], decoder.base.buckets
    made = {(r, s, False) for r in (1, 2, 3) for s in buckets} | {(1, s, True) for s in buckets}
    assert set(rows.steps) == made
    steps = dict(rows.steps)
    results = decoder.generate([prompt[0].tolist() for prompt in prompts(3)], NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, reference("llama", "sdpa", index)), index
    assert set(rows.steps) == made and all(rows.steps[key] is steps[key] for key in made)  # reused, none new
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="warm_up's batch_size"):
            decoder.warm_up(200, batch_size=bad)
    assert set(decoder.base.steps) == {(1, s, False) for s in buckets}  # a lone request's own, beside


def test_a_batch_only_warm_up_leaves_a_lone_requests_graphs_to_their_first_use():
    """warm_up(..., batch_size=3, single=False), as a batched server's: only the rows' steps; batch_size 1 warms
    a lone request's whatever `single` says."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True)
    decoder.warm_up(200, batch_size=3, single=False)
    assert decoder.base.steps == {} and len(decoder.base.siblings[3].steps) == 4 * len(decoder.base.buckets)
    decoder.warm_up(200, batch_size=1, single=False)
    assert set(decoder.base.steps) == {(1, s, False) for s in decoder.base.buckets}
    for bad in ("no", 0, None):
        with pytest.raises(ValueError, match="warm_up's single must be true or false"):
            decoder.warm_up(200, batch_size=3, single=bad)


@torch.inference_mode()
def test_compiled_buckets_of_two_models_are_never_shared():
    """Compiled bases of three models in one process (fp32 linear layers, then bf16, then 4-bit kernels in place
    of the linear layers): each bucket's logits are its own model's. The compiled program skips guards on the
    model's modules (their checks would cost every CPU step), so a program shared between bases would run the
    first model's layers on the next one's weights."""
    from forerun.base.weights import quantize_weights

    fp32 = model_of("llama", "sdpa")
    prompt = prompts(3)[1][0].tolist()
    tree = TokenTree.rooted_at(prompt[-1])
    tree.add_chain(0, [5, 6, 7])
    for model in (fp32, tiny_model("llama", "sdpa").to(torch.bfloat16), quantize_weights(
            tiny_model("llama", "sdpa").to(torch.bfloat16), "int4")):  # fmt: skip
        eager, compiled = StaticBase(model, buckets=(1, 8)), StaticBase(model, buckets=(1, 8), compiled=True)
        want, got = (base.begin(64) or base.forward(tree, len(prompt) - 1, prompt[:-1]) for base in (eager, compiled))
        tolerance = 1e-4 if model.dtype == torch.float32 else 0.1  # inductor rounds bf16 otherwise than eager
        assert torch.allclose(got.logits.float(), want.logits.float(), atol=tolerance), model.dtype


class HostReads(TorchDispatchMode):
    """Counts what a decode reads back to the host: `tolist` calls by caller, and scalar reads (`int(t)`,
    `t.item()`: `aten._local_scalar_dense`) made inside the step loop (`decode`, `Batch.step`, a row's join)."""

    def __init__(self) -> None:
        super().__init__()
        self.tolist: Counter = Counter()
        self.scalars_in_steps = 0

    def __enter__(self):
        original = self.original = torch.Tensor.tolist

        def counted(tensor: torch.Tensor):
            self.tolist[traceback.extract_stack(limit=2)[0].name] += 1
            return original(tensor)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.original
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = {frame.name for frame in traceback.extract_stack()}
            self.scalars_in_steps += bool(frames & {"decode", "step", "feed_apart"})
        return func(*args, **(kwargs or {}))


def test_a_sampled_step_reads_the_host_once_argmaxes_and_draws_together(monkeypatch):
    """On the static base, drawing at once (a card's way), each forward's argmaxes and every row's draws come back
    in one copy (`forerun.host_copy.to_host`), and nothing else in the step loop reads a tensor on the host: one
    wait for the card a step, alone and in a batch (a copy of the argmaxes, then of the draws, was two)."""
    model = model_of("qwen2", "sdpa")
    monkeypatch.setattr(Sampling, "draws_at_once", lambda self, logits: True)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True)
    one, two = prompts(1)[0][0].tolist(), prompts(2, length=17)[1][0].tolist()
    options = {"do_sample": True, "seed": 3, "temperature": 1.2, "top_k": 5, "eos_token_id": []}
    decoder.generate([one, two], 24, **options)  # its graphs' shapes, once
    for batch in ([one], [one, two]):
        with HostReads() as reads:
            results = decoder.generate(batch, 24, **options)
        # each row's first forward copies at its join, then every step of the batch once for all rows
        copies = len(batch) + max(result.stats.forwards for result in results) - 1
        in_loop = {caller: n for caller, n in reads.tolist.items() if caller not in ("begin", "finished_result")}
        assert in_loop == {"to_host": copies}, (len(batch), reads.tolist)
        assert reads.scalars_in_steps == 0
