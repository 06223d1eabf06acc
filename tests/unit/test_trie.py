import threading
import tracemalloc

import pytest
import torch

import forerun
from forerun.config import TrieConfig
from forerun.drafters.base import DraftContext
from forerun.drafters.trie import TokenTrie, TrieDrafter

EXAMPLE = TrieConfig(max_query_length=1, branch_length=2, decoding_length=8)


def example_trie() -> TokenTrie:
    trie = TokenTrie()
    for window in ([1, 2, 3], [1, 2, 4], [1, 2, 4], [1, 5, 6]):
        trie.insert(window, 1.0)
    return trie


def test_docstring_example_exact_draft_tree():
    tree = example_trie().draft([9, 1], EXAMPLE, frozenset(), "trie")
    # best-first by path probability: 2 (3/4), 4 (3/4*2/3), 5 (1/4), 3 (1/4), 6 (1/4)
    assert tree.tokens == [1, 2, 4, 5, 3, 6]
    assert tree.parents == [-1, 0, 1, 0, 1, 3]


def test_decoding_and_branch_length_limit_the_draft():
    trie = TokenTrie()
    trie.insert([1, 2, 3, 4, 5], 1.0)
    config = TrieConfig(max_query_length=1, branch_length=2, decoding_length=8)
    assert trie.draft([1], config, frozenset(), "trie").tokens == [1, 2, 3]
    config = TrieConfig(max_query_length=1, branch_length=4, decoding_length=1)
    assert trie.draft([1], config, frozenset(), "trie").tokens == [1, 2]


def test_longer_query_first_then_shorter():
    trie = TokenTrie()
    trie.insert([7, 1, 2], 1.0)  # after "7 1" comes 2
    trie.insert([1, 3], 5.0)  # after "1" alone, 3 is more frequent
    config = TrieConfig(max_query_length=2, branch_length=1, decoding_length=4)
    assert trie.draft([7, 1], config, frozenset(), "trie").tokens == [1, 2]
    assert trie.draft([8, 1], config, frozenset(), "trie").tokens == [1, 3]


def test_draft_stops_below_eos():
    trie = TokenTrie()
    trie.insert([1, 2, 3], 1.0)
    assert trie.draft([1], EXAMPLE, frozenset({2}), "trie").tokens == [1, 2]


def test_skip_anchors_are_never_the_first_token_of_a_window():
    drafter = TrieDrafter(TrieConfig(max_query_length=1, branch_length=2, skip_anchors="13"))
    assert drafter.config.skip_anchors == (13,)
    drafter.learn([5, 13, 6, 7])
    assert drafter.trie.match([13], 1) is None  # "13" anchors nothing
    assert list(drafter.trie.kids[drafter.trie.match([5], 1)]) == [13]  # but it may follow another anchor
    assert drafter.trie.draft([9, 5], drafter.config, frozenset(), "trie").tokens == [5, 13, 6]
    with pytest.raises(ValueError, match="skip_anchors"):
        TrieConfig(skip_anchors="a,b")
    with pytest.raises(ValueError, match="skip_anchors"):
        TrieConfig(skip_anchors=(-1,))


def test_prompt_counts_are_withdrawn_output_counts_stay():
    drafter = TrieDrafter(TrieConfig(max_query_length=1, branch_length=2, prompt_weight=0.5))
    ctx = DraftContext([1, 2, 3, 4], 3, 16, frozenset())
    drafter.start(ctx)
    assert drafter.trie.weights([1, 2]) == (0.0, 0.5)
    drafter.finish(ctx)  # the output [.., 3, 4] enters: windows from position 2 on
    assert drafter.trie.match([1], 1) is None  # prompt-only path removed
    assert drafter.trie.weights([3, 4]) == (1.0, 0.0)


def test_a_finishing_request_withdraws_only_its_own_prompt():
    """Two requests at once (a batch): the first to finish leaves the other's prompt windows in place."""
    config = TrieConfig(max_query_length=1, branch_length=2, prompt_weight=0.5)
    trie = TokenTrie()
    first, second = TrieDrafter(config, trie), TrieDrafter(config, trie)
    ctx_a, ctx_b = DraftContext([1, 2, 3], 3, 16, frozenset()), DraftContext([7, 8, 9, 1, 2], 5, 16, frozenset())
    first.start(ctx_a)
    second.start(ctx_b)
    assert trie.weights([1, 2]) == (0.0, 1.0)  # both prompts hold 1 -> 2
    first.finish(ctx_a)
    assert trie.weights([1, 2]) == (0.0, 0.5) and trie.match([7], 1) is not None
    assert trie.match([2], 1) is None  # 2 -> 3 was the first prompt's alone
    second.finish(ctx_b)
    assert trie.match([1], 1) is None and trie.match([7], 1) is None and len(trie) == 0


def test_withdrawing_prompts_leaves_exactly_what_a_whole_trie_prune_would():
    """Requests start and finish interleaved, prompts overlapping: after each finish no node is left without
    weight and the node count is the trie's true size."""
    config = TrieConfig(max_query_length=2, branch_length=3, prompt_weight=0.5)
    trie = TokenTrie()
    generator = torch.Generator().manual_seed(3)
    running = []
    for request in range(300):
        tokens = torch.randint(1, 12, (10,), generator=generator).tolist()
        drafter, ctx = TrieDrafter(config, trie), DraftContext(tokens, 6, 16, frozenset())
        drafter.start(ctx)
        running.append((drafter, ctx))
        if request % 3 != 0:
            drafter, ctx = running.pop(int(torch.randint(len(running), (1,), generator=generator)))
            drafter.finish(ctx)
            assert len(trie) == trie.size() - 1  # the top is not counted
            assert trie.prune(lambda node: trie.weight(node) <= 1e-9) == 0  # nothing left to prune
            assert len(trie.free) == len(trie.kids) - trie.size()  # every removed id is free for reuse


def test_eviction_keeps_the_budget_and_the_frequent_paths():
    trie = TokenTrie(max_nodes=64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2000):
        trie.insert([1, 2, 3], 1.0)  # the frequent path
        trie.insert(torch.randint(10, 1000, (3,), generator=generator).tolist(), 1.0)
        assert len(trie) <= 64
    assert trie.draft([1], EXAMPLE, frozenset(), "trie").tokens == [1, 2, 3]


def test_memory_stays_flat_over_10000_requests():
    """Node count never exceeds the budget, and traced memory stays under a per-node bound the whole run."""
    drafter = TrieDrafter(TrieConfig(max_nodes=2000, max_query_length=1, branch_length=3))
    generator = torch.Generator().manual_seed(1)
    tracemalloc.start()
    samples = []
    for request in range(10_000):
        tokens = torch.randint(3, 5000, (12,), generator=generator).tolist()
        ctx = DraftContext(tokens, 6, 16, frozenset())
        drafter.start(ctx)
        drafter.finish(ctx)
        assert len(drafter.trie) <= 2000
        if request % 250 == 249:
            samples.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    # ~300 bytes per node measured (its dict of children, its weights); 400 B x budget is the flat ceiling
    assert max(samples) < 400 * 2000
    assert max(samples[len(samples) // 2 :]) < 1.5 * max(samples[: len(samples) // 2])


def test_save_load_round_trip_is_exact(tmp_path):
    trie = example_trie()
    trie.save(tmp_path / "t.safetensors")
    loaded = TokenTrie.load(tmp_path / "t.safetensors")
    assert len(loaded) == len(trie) == 6
    for context in ([1], [2], [5]):
        a = trie.draft(context, EXAMPLE, frozenset(), "trie")
        b = loaded.draft(context, EXAMPLE, frozenset(), "trie")
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert loaded.weights([1, 2]) == (3.0, 0.0)


def test_truncated_or_foreign_file_is_rejected_cleanly(tmp_path):
    path = tmp_path / "t.safetensors"
    example_trie().save(path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read trie file"):
        TokenTrie.load(tmp_path / "cut.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a forerun trie"):
        TokenTrie.load(tmp_path / "other.safetensors")


def test_decoder_load_failure_leaves_the_running_cache_untouched(tmp_path):
    from tiny_models import tiny_model

    decoder = forerun.Decoder(tiny_model("llama"), None, "trie")
    decoder.trie_drafter().trie.insert([1, 2, 3], 1.0)
    (tmp_path / "bad").write_bytes(b"not a trie")
    with pytest.raises(ValueError):
        decoder.load_cache(str(tmp_path / "bad"))
    assert len(decoder.trie_drafter().trie) == 3
    decoder.save_cache(str(tmp_path / "good"))
    fresh = forerun.Decoder(tiny_model("llama"), None, "trie")
    fresh.load_cache(str(tmp_path / "good"))
    assert len(fresh.trie_drafter().trie) == 3


def test_concurrent_writers_and_readers_do_not_tear():
    trie = TokenTrie(max_nodes=500)
    errors = []

    def writer(seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(300):
            trie.insert(torch.randint(0, 50, (4,), generator=generator).tolist(), 1.0)

    def reader():
        try:
            for i in range(300):
                tree = trie.draft([i % 50], TrieConfig(max_query_length=1), frozenset(), "trie")
                assert all(p < i for i, p in enumerate(tree.parents))
        except Exception as error:  # noqa: BLE001 - surfaced below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(trie) <= 500


def write_trie(path, parents, tokens, counts, max_nodes="200000", dtypes=(torch.int64, torch.int64, torch.float64)):
    """A file in the trie's own layout, with whatever values a test wants (valid metadata)."""
    from safetensors.torch import save_file

    from forerun.drafters.trie import FORMAT, VERSION

    arrays = {
        "parents": torch.tensor(parents, dtype=dtypes[0]),
        "tokens": torch.tensor(tokens, dtype=dtypes[1]),
        "counts": torch.tensor(counts, dtype=dtypes[2]),
    }
    save_file(arrays, str(path), metadata={"format": FORMAT, "version": VERSION, "max_nodes": max_nodes})


@pytest.mark.parametrize(
    ("parents", "tokens", "counts", "extra", "message"),
    [
        ([-1, 0], [5, 6], [1.0, float("inf")], {}, "counts must be finite and >= 0"),
        ([-1, 0], [5, 6], [float("nan"), 1.0], {}, "counts must be finite and >= 0"),
        ([-1, 0], [5, 6], [1.0, -2.0], {}, "counts must be finite and >= 0"),
        ([-1, 0], [5, 10**9], [1.0, 1.0], {}, "token id 1000000000 outside the model's vocabulary \\(\\[0, 96\\)\\)"),
        ([-1, 0], [5, -3], [1.0, 1.0], {}, "token id -3 outside"),
        ([-1, 5], [5, 6], [1.0, 1.0], {}, "node 1's parent 5 is not before it"),
        ([-1, -1], [5, 5], [1.0, 1.0], {}, "token 5 twice under node -1"),
        ([-1, 0], [5, 6], [1.0], {}, "inconsistent trie arrays"),
        ([-1, 0], [5, 6], [1.0, 1.0], {"max_nodes": "1e309"}, "max_nodes '1e309' is not an integer"),
        ([-1, 0], [5, 6], [1.0, 1.0], {"max_nodes": "0"}, "max_nodes '0' is not an integer"),
        (
            [-1, 0],
            [5.0, 6.0],
            [1.0, 1.0],
            {"dtypes": (torch.int64, torch.float32, torch.float64)},
            "parents and tokens must be integers",
        ),
    ],
)
def test_a_trie_file_is_checked_before_it_is_trusted(tmp_path, parents, tokens, counts, extra, message):
    """A file with valid metadata but impossible values is refused at load, naming the file and the value, and
    the running trie is untouched (an infinite count used to load, then break every request)."""
    from tiny_models import tiny_model

    path = tmp_path / "hostile.safetensors"
    write_trie(path, parents, tokens, counts, **extra)
    decoder = forerun.Decoder(tiny_model("llama"), None, "trie")
    decoder.trie_drafter().trie.insert([1, 2, 3], 1.0)
    with pytest.raises(ValueError, match=message) as caught:
        decoder.load_cache(str(path))
    assert str(path) in str(caught.value)
    assert len(decoder.trie_drafter().trie) == 3


def test_a_valid_hand_written_trie_file_loads(tmp_path):
    """The control: the same layout with sane values loads and drafts."""
    path = tmp_path / "fine.safetensors"
    write_trie(path, [-1, 0, 1], [5, 6, 7], [2.0, 2.0, 1.0])
    trie = TokenTrie.load(path, vocab=96)
    assert len(trie) == 3 and trie.weights([5, 6]) == (2.0, 0.0)


def test_a_trie_gives_the_garbage_collector_nothing_to_walk():
    """A long prompt's windows add thousands of nodes between two forwards; as objects of their own each was tracked
    by the collector, and allocating them set off full collections that walked every object of the process (a
    model's ~400,000) while no row moved. Nodes held as ids in flat lists add no tracked object, withdrawn or not."""
    import gc

    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 50_000, (2000,), generator=generator).tolist()
    config = TrieConfig(max_query_length=2, branch_length=16, prompt_weight=0.5)
    drafter = TrieDrafter(config)
    ctx = DraftContext(prompt, len(prompt), 16, frozenset())
    gc.collect()
    tracked = len(gc.get_objects())
    drafter.start(ctx)
    nodes = len(drafter.trie)
    assert nodes > 10_000
    assert len(gc.get_objects()) - tracked < 50, len(gc.get_objects()) - tracked
    drafter.finish(ctx)
    assert len(drafter.trie) < nodes and len(gc.get_objects()) - tracked < 50
