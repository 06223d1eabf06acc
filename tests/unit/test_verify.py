from forerun.tree import TokenTree
from forerun.verify import verify_greedy


def test_docstring_example():
    tree = TokenTree.rooted_at(5)
    a = tree.add(0, 7)
    tree.add(a, 9)
    tree.add(0, 8)
    choices = {0: 7, 1: 3}
    verdict = verify_greedy(tree, choices.__getitem__)
    assert verdict.accepted_nodes == [1] and verdict.bonus_token == 3


def test_second_branch_wins_and_probes_are_never_accepted():
    tree = TokenTree.rooted_at(5)
    tree.add_chain(0, [1, 2])  # nodes 1, 2
    tree.add_chain(0, [3, 4])  # nodes 3, 4
    probe = tree.add(4, 6, role="probe")  # node 5
    choices = [3, 9, 9, 4, 6, 0]  # argmax per node
    verdict = verify_greedy(tree, choices.__getitem__)
    assert verdict.accepted_nodes == [3, 4]  # the probe 6 matches the choice at node 4 but is not a candidate
    assert verdict.bonus_token == 6
    assert probe not in verdict.accepted_nodes


def test_nothing_accepted_gives_the_bonus_only():
    tree = TokenTree.rooted_at(5)
    tree.add_chain(0, [1, 2])
    verdict = verify_greedy(tree, [8, 0, 0].__getitem__)
    assert verdict.accepted_nodes == [] and verdict.bonus_token == 8
