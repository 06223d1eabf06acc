"""What one bucketed step of the static base is fed: its tree (a prefill's prompt chained in front of it) written
into the bucket's flat input buffer, which the captured graph reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from forerun.tree import TokenTree


def behind(lead: Sequence[int], tree: TokenTree) -> TokenTree:
    """`tree` hung under a chain of `lead` tokens, as one tree fed in one forward: node i < len(lead) is lead token
    i (it sees the lead before it), then `tree`'s nodes in their order (each sees the whole lead and its ancestors).

    Example: a 2-token lead before a root with one child:
        >>> tree = TokenTree.rooted_at(5); _ = tree.add(0, 9)
        >>> both = behind([3, 4], tree); both.tokens, both.parents, both.depths
        ([3, 4, 5, 9], [-1, 0, 1, 2], [0, 1, 2, 3])
    """
    if not lead:
        return tree
    k = len(lead)
    return TokenTree(
        tokens=[*lead, *tree.tokens],
        parents=[*range(-1, k - 1), *(p + k if p >= 0 else k - 1 for p in tree.parents)],
        depths=[*range(k), *(d + k for d in tree.depths)],
        roles=["root", *["candidate"] * (k - 1), *["candidate" if r == "root" else r for r in tree.roles]],
        sources=[*[""] * k, *tree.sources],
        scores=[*[1.0] * k, *tree.scores],
    )


def fill_host(host: np.ndarray, tree: TokenTree, prefix_len: int, size: int) -> None:
    """Write one step's inputs for bucket `size` into `host` [1 + 2B + B*B]: the prefix length, the tokens and
    depths (padding nodes repeat the root at depth 0), and the ancestry (a padding node sees only itself).

    Example: a root and one child, bucket 2, after 7 cached tokens:
        >>> tree = TokenTree.rooted_at(5); _ = tree.add(0, 9)
        >>> host = np.zeros(1 + 2 * 2 + 4, dtype=np.int64); fill_host(host, tree, 7, 2); host.tolist()
        [7, 5, 9, 0, 1, 1, 0, 1, 1]
    """
    n = len(tree)
    host[0] = prefix_len
    if n == 1 and size == 1:  # a lone root: an undrafted step's row, the commonest of all
        host[1:] = (tree.tokens[0], 0, 1)
        return
    host[1 : 1 + n] = tree.tokens
    host[1 + n : 1 + size] = tree.tokens[0]
    host[1 + size : 1 + size + n] = tree.depths
    host[1 + size + n : 1 + 2 * size] = 0
    ancestry = np.eye(size, dtype=np.int64)
    ancestry[:n, :n] = tree.ancestors().numpy()
    host[1 + 2 * size :] = ancestry.reshape(-1)
