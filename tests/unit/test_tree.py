import pytest
import torch

from forerun.tree import TokenTree, attention_mask_4d, pack


def drawn_tree() -> TokenTree:
    """root(5) - 7 - 9 ; root - 8   (the docstring example of forerun.tree)"""
    tree = TokenTree.rooted_at(5)
    a = tree.add(0, 7)
    tree.add(a, 9)
    tree.add(0, 8)
    return tree


def test_hand_drawn_tree_nodes():
    tree = drawn_tree()
    assert tree.tokens == [5, 7, 9, 8]
    assert tree.parents == [-1, 0, 1, 0]
    assert tree.depths == [0, 1, 2, 1]


def test_a_tree_within_a_depth_keeps_the_nodes_above_it():
    tree = drawn_tree()
    shallow = tree.within_depth(1)
    assert shallow.tokens == [5, 7, 8] and shallow.parents == [-1, 0, 0] and shallow.children == {(0, 7): 1, (0, 8): 2}
    assert tree.within_depth(2) is tree and tree.within_depth(0).tokens == [5]


def test_mask_exact_matrix_and_invariants():
    tree = drawn_tree()
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestors(), expected)
    mask = attention_mask_4d(tree.ancestors(), prefix_len=3, attn_implementation="sdpa", dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    rows = mask[0, 0]
    assert rows[:, :3].all()  # every node sees the whole cached prefix
    assert rows[:, 3].all()  # root column
    assert torch.equal(rows[:, 3:].diagonal(), torch.ones(4, dtype=torch.bool))
    assert rows[:, 3:].sum(1).tolist() == [d + 1 for d in tree.depths]  # row sum = depth + 1


def test_eager_mask_is_additive_float():
    tree = drawn_tree()
    mask = attention_mask_4d(tree.ancestors(), 2, "eager", torch.float32)[0, 0]
    assert mask.dtype == torch.float32
    assert mask[0, 2] == 0 and mask[0, 3] == torch.finfo(torch.float32).min
    assert (mask[:, :2] == 0).all()


def test_pack_positions_follow_depth():
    packed = pack(drawn_tree(), 10, "sdpa", torch.float32, torch.device("cpu"))
    assert packed.input_ids.tolist() == [[5, 7, 9, 8]]
    assert packed.position_ids.tolist() == [[10, 11, 12, 11]]
    single = pack(TokenTree.rooted_at(5), 10, "sdpa", torch.float32, torch.device("cpu"))
    assert single.attention_mask is None and single.position_ids.tolist() == [[10]]


def test_lead_rows_are_causal_and_the_tree_sees_them():
    """The docstring example of attention_mask_4d: 2-token prefix, its second token fed as lead, root + child."""
    tree = TokenTree.rooted_at(5)
    tree.add(0, 7)
    mask = attention_mask_4d(tree.ancestors(), prefix_len=2, attn_implementation="sdpa", dtype=torch.float32, lead=1)
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


def test_pack_with_the_whole_prompt_as_lead():
    """The prefill forward: prompt [3, 4, 6] whose last token 6 is the root of the drawn tree (under it 7-9, 8)."""
    tree = TokenTree.rooted_at(6)
    a = tree.add(0, 7)
    tree.add(a, 9)
    tree.add(0, 8)
    packed = pack(tree, 2, "sdpa", torch.float32, torch.device("cpu"), lead=[3, 4])
    assert packed.input_ids.tolist() == [[3, 4, 6, 7, 9, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    rows = packed.attention_mask[0, 0].int().tolist()
    assert rows == [
        [1, 0, 0, 0, 0, 0],  # lead 3
        [1, 1, 0, 0, 0, 0],  # lead 4
        [1, 1, 1, 0, 0, 0],  # root 6
        [1, 1, 1, 1, 0, 0],  # 7
        [1, 1, 1, 1, 1, 0],  # 9 (under 7)
        [1, 1, 1, 0, 0, 1],  # 8 (root's other child)
    ]
    chain = pack(TokenTree.rooted_at(6), 2, "sdpa", torch.float32, torch.device("cpu"), lead=[3, 4])
    assert chain.attention_mask is None and chain.position_ids.tolist() == [[0, 1, 2]]


def test_candidates_fuse_probes_do_not():
    tree = TokenTree.rooted_at(1)
    assert tree.add_chain(0, [4, 5]) == tree.add_chain(0, [4, 5])
    probe = tree.add(0, 4, role="probe")
    assert probe == 3 and len(tree) == 4
    assert tree.candidate_children(0) == [1]
    with pytest.raises(IndexError, match="parent 4 is not a node of a tree of 4 nodes"):
        tree.add(4, 9)


def test_a_fused_candidate_keeps_the_likelier_estimate():
    """Two drafters guessing the same token: the cost model prices the node at the higher of their scores, whichever
    came first, through `add` and through `graft`."""
    tree = TokenTree.rooted_at(1)
    node = tree.add(0, 4, score=0.3)
    assert tree.add(0, 4, score=0.8) == node and tree.scores[node] == 0.8
    assert tree.add(0, 4, score=0.1) == node and tree.scores[node] == 0.8
    other = TokenTree.rooted_at(1)
    other.add_chain(0, [4, 5], scores=[0.9, 0.2])
    tree.add(node, 5, score=0.6)
    tree.graft(other)
    assert tree.scores == [1.0, 0.9, 0.6]


def test_graft_fuses_shared_prefixes_and_respects_budget():
    tree = TokenTree.rooted_at(1)
    tree.add_chain(0, [4, 5, 6])
    other = TokenTree.rooted_at(1)
    other.add_chain(0, [4, 5, 7, 8])
    tree.graft(other, budget=5)
    # 4 and 5 fused, 7 added (5 nodes), 8 dropped by the budget
    assert tree.tokens == [1, 4, 5, 6, 7]
    assert tree.parents == [-1, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="rooted at"):
        tree.graft(TokenTree.rooted_at(2), 10)
