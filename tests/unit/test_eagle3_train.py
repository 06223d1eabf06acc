"""Training an EAGLE-3 head (`forerun train-head`): on a tiny model, the loss falls, and the head it writes loads
and drafts exactly."""

from __future__ import annotations

from dataclasses import replace

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
    config = TrainConfig(draft_vocab=48, pack=256, seconds=20, lr=3e-3, unroll=2)
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
    # trained further from where it stopped: its draft vocabulary kept, it starts where the first run ended (a
    # new head's first losses are the negative control), and the target it shares an embedding with is untouched
    embedding = model.get_input_embeddings().weight.clone()
    more: list[float] = []
    start = load_head(folder, model, dtype=torch.float32)
    again = train_head(model, DigitTokenizer(), texts * 3, tmp_path / "again", replace(config, seconds=4), start=start,
                       report=lambda step, loss, seconds: more.append(loss))  # fmt: skip
    assert torch.equal(load_head(again, model).d2t, head.d2t)
    assert sum(more[:3]) < 0.8 * sum(losses[:3])
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert not any(p.requires_grad for p in model.parameters()) or all(p.requires_grad for p in model.parameters())


def test_training_time_test_steps_are_what_the_drafter_computes_at_depth():
    """Training's unrolled step s at chain j is exactly the drafter's head output for the node s-1 levels below a
    root at position j + 1 (the target's features read up to position j): training aligns with drafting. The
    same comparison one position off fails (a negative control)."""
    from forerun.config import Eagle3Config
    from forerun.drafters.base import DraftContext, StepOutcome
    from forerun.drafters.eagle3.drafter import Eagle3Drafter
    from forerun.drafters.eagle3.train import unrolled
    from forerun.tree import TokenTree
    from forerun.verify import Verdict

    from eagle3_heads import random_head

    model = tiny_model("llama")
    head = random_head(model).float()
    ids = prompts(1, 12, seed=3)[0]
    features = torch.randn(ids.shape[1], 3 * model.config.hidden_size)
    with torch.no_grad():
        steps = unrolled(head, ids, features, 3)
    assert [out.shape[0] for out in steps] == [11, 10, 9]
    tokens = ids[0].tolist()
    for j in (0, 4, 8):
        drafter = Eagle3Drafter(Eagle3Config(), head)
        ctx = DraftContext(tokens[: j + 2], j + 2, 16, frozenset())
        drafter.observe(ctx, StepOutcome(TokenTree.rooted_at(tokens[j + 1]), Verdict([], 0), torch.empty(0), [], {},
                                         features[: j + 1]))  # fmt: skip
        assert torch.allclose(drafter.last.out[0], steps[0][j], atol=1e-5)
        tree = TokenTree.rooted_at(tokens[j + 1])
        child = tree.add(0, tokens[j + 2])
        (first,) = drafter.read_level(tree, [child], [], j + 1).out
        grandchild = tree.add(child, tokens[j + 3])
        (second,) = drafter.read_level(tree, [grandchild], [child], j + 2).out
        assert torch.allclose(first, steps[1][j], atol=1e-5) and torch.allclose(second, steps[2][j], atol=1e-5)
        assert not torch.allclose(first, steps[1][j + 1], atol=1e-3)  # the neighbouring chain differs


def test_texts_packed_side_by_side_train_as_they_would_alone():
    """Two texts in one pack: every chain's output at every training-time test step equals the one the text alone
    gives (its own positions, nothing seen across the seam); without the segments the second text's chains see the
    first (a negative control)."""
    from forerun.drafters.eagle3.readings import Reading, packs
    from forerun.drafters.eagle3.train import unrolled

    from eagle3_heads import random_head

    model = tiny_model("llama")
    head = random_head(model).float()
    width = 3 * model.config.hidden_size
    texts = [
        Reading(ids[0], torch.randn(ids.shape[1], width), torch.zeros(ids.shape[1], 1), torch.ones(ids.shape[1], 1))
        for ids in (prompts(1, 10, seed=1)[0], prompts(1, 8, seed=2)[0])
    ]
    (pack,) = packs(texts, 64)
    with torch.no_grad():
        together = unrolled(head, pack.ids[None], pack.features, 3, pack.positions, pack.segments)
        alone = [unrolled(head, text.ids[None], text.features, 3) for text in texts]
        unsegmented = unrolled(head, pack.ids[None], pack.features, 3, pack.positions)
    for step in range(3):
        first = alone[0][step].shape[0]
        assert torch.allclose(together[step][:first], alone[0][step], atol=1e-5)
        second = together[step][len(texts[0]) : len(texts[0]) + alone[1][step].shape[0]]
        assert torch.allclose(second, alone[1][step], atol=1e-5)
    assert not torch.allclose(unsegmented[0][10:17], alone[1][0], atol=1e-3)


def test_a_level_of_several_branches_reads_as_each_branch_would_alone():
    """Two branches drafted side by side, two levels deep: each node's head output equals the one its own chain
    gives read alone (the level's mask shows a node its own ancestors' entries, not its cousins'). A mask that
    shows every drafted entry fails it, as does one that hides the node's own ancestors."""
    from forerun.config import Eagle3Config
    from forerun.drafters.base import DraftContext, StepOutcome
    from forerun.drafters.eagle3.drafter import Eagle3Drafter
    from forerun.tree import TokenTree
    from forerun.verify import Verdict

    from eagle3_heads import random_head

    model = tiny_model("llama")
    head = random_head(model).float()
    tokens = prompts(1, 12, seed=4)[0][0].tolist()
    features = torch.randn(len(tokens), 3 * model.config.hidden_size)
    ctx = DraftContext(tokens, len(tokens), 16, frozenset())

    def drafter() -> Eagle3Drafter:
        made = Eagle3Drafter(Eagle3Config(), head)
        made.observe(ctx, StepOutcome(TokenTree.rooted_at(tokens[-1]), Verdict([], 0), torch.empty(0), [], {},
                                      features[: len(tokens) - 1]))  # fmt: skip
        return made

    position = len(tokens) - 1
    with torch.no_grad():
        side, tree = drafter(), TokenTree.rooted_at(tokens[-1])
        a, b = tree.add(0, 5), tree.add(0, 6)
        first = side.read_level(tree, [a, b], [], position).out
        a2, b2 = tree.add(a, 7), tree.add(b, 8)
        second = side.read_level(tree, [a2, b2], [a, b], position + 1).out
        for (parent, token), outs in (((5, 7), (first[0], second[0])), ((6, 8), (first[1], second[1]))):
            alone, chain = drafter(), TokenTree.rooted_at(tokens[-1])
            one = chain.add(0, parent)
            (out_one,) = alone.read_level(chain, [one], [], position).out
            two = chain.add(one, token)
            (out_two,) = alone.read_level(chain, [two], [one], position + 1).out
            assert torch.allclose(outs[0], out_one, atol=1e-5) and torch.allclose(outs[1], out_two, atol=1e-5)
