"""Every node's sampled draw at once, on the device, in one copy to the host (an accelerator's sampled step).

Lazily (`forerun.verify.NodeScores`), a sampled walk processes and draws node by node along the walked path: on a
CPU that is cheapest (only the walked nodes are scored), but on a card each walked node costs the processors'
launches and a host sync for its token. Here every node is scored in one go instead: the processors run once over
all nodes, or once per depth level where they read the prefix (all nodes at depth d have prefixes of the same
length: the committed text and d path tokens), the noise of each node's position is added, and the argmaxes
travel to the host in one copy with the base's argmaxes (a batch: one copy for all its rows,
`forerun.host_copy`).

The draws are the lazy walk's, bit for bit: every processor here acts on each row of scores alone, so scoring
nodes as rows of one call computes each node exactly as alone (tested on hand-made logits with every kind), and
the noise and the argmax are elementwise and row-wise. A processor not known to act row by row (a
`prefix_allowed_tokens_fn`, whose rule is given the row's batch index; anything of the caller's own) leaves the
row on the lazy walk: `drawn` returns None (`grouping`).

Example (temperature and top-p, which read no prefix: one call for the whole tree):
    >>> from forerun.transcript import Transcript
    >>> tree = TokenTree.rooted_at(3); _ = tree.add(0, 5); _ = tree.add(1, 2)
    >>> processor = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)])
    >>> scores = NodeScores(torch.randn(3, 8), processor, Transcript(torch.tensor([[1, 2, 3]]), []), tree)
    >>> draws = drawn(scores, GumbelNoise(seed=4))                     # [3] on the logits' device
    >>> walked = [GumbelNoise(seed=4).draw(scores.scores(i), 3 + tree.depths[i]) for i in range(3)]
    >>> draws.tolist() == walked                                      # the lazy walk's draws, node by node
    True
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import (
    LogitNormalization,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
)

from forerun.noise import GumbelNoise
from forerun.penalties import OccurrencePenalty
from forerun.structured import Constraint
from forerun.tree import TokenTree
from forerun.verify import NodeScores

PREFIX_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitNormalization,
    InfNanRemoveLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
"""Processors that read neither the prefix nor its length, each row of scores on its own: every node in one call."""

ROW_WISE = (
    RepetitionPenaltyLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    NoBadWordsLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    ExponentialDecayLengthPenalty,
    OccurrencePenalty,
    Constraint,
)
"""Processors that read each row's own prefix (its tokens or its length) and nothing of other rows: one call per
depth level, each node's row its own prefix."""


def grouping(processor: LogitsProcessorList | None) -> Literal["tree", "levels"] | None:
    """How the nodes are scored: "tree", every node in one call; "levels", one call per depth level; None, the
    processors are not known to act row by row (the lazy walk). Exact classes only: a subclass may read more than
    its parent.

    Example:
        >>> grouping(LogitsProcessorList([TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.2)]))
        'levels'
    """
    kinds = [type(p) for p in processor or ()]
    if all(kind in PREFIX_FREE for kind in kinds):
        return "tree"
    if all(kind in PREFIX_FREE or kind in ROW_WISE for kind in kinds):
        return "levels"
    return None


def drawn(scores: NodeScores, noise: GumbelNoise) -> torch.Tensor | None:
    """Every node's draw [nodes] int64, on the logits' device (nothing copied to the host), or None where the
    processors leave the row on the lazy walk (`grouping`). Node i draws at position committed + depth[i]."""
    processed = scored(scores)
    if processed is None:
        return None
    first = scores.committed.length
    # [nodes, vocab] float64, stacked from the noise's rows where they are (an index copied to a card would wait
    # for the forward: a sync of its own)
    noise_rows = noise.rows([first + depth for depth in scores.tree.depths], processed.shape[-1], processed.device)
    return (processed.double() + noise_rows).argmax(-1)


def chosen(scores: NodeScores) -> torch.Tensor | None:
    """Every node's greedy choice [nodes] int64 (the argmax of its processed scores), on the logits' device, or
    None where the processors leave the row on the lazy walk (`grouping`): a greedy row with logits processors (a
    repetition penalty) on an accelerator, which would otherwise wait for the card at every walked node."""
    processed = scored(scores)
    return None if processed is None else processed.argmax(-1)


def choose_at_once(logits: torch.Tensor) -> bool:
    """Whether a greedy row whose logits are processed chooses at every node at once: on an accelerator (on a CPU
    the walk, which processes only the nodes it walks, costs less)."""
    return logits.device.type != "cpu"


def scored(scores: NodeScores) -> torch.Tensor | None:
    """Every node's processed scores [nodes, vocab] float32, each row what `scores.scores(node)` gives, or None
    where the processors leave the row on the lazy walk (`grouping`)."""
    group = grouping(scores.processor)
    if group is None:
        return None
    tree, logits = scores.tree, scores.logits
    n, device = len(tree), logits.device
    processed = logits[:n].float()  # [nodes, vocab]
    if scores.processor and group == "tree":  # they read no prefix: the root stands for each node's
        return scores.processor(torch.full((n, 1), tree.tokens[0], device=device), processed)
    if scores.processor:
        processed = processed.clone()  # written level by level: the base's logits stay as they are
        # [1, committed]: one copy for every level. Copies to a card here are non-blocking: a blocking one waits
        # for the forward just launched (pageable memory is staged at once: the host list may go)
        sequence = scores.committed.sequence.to(device, non_blocking=True)
        for nodes in by_depth(tree):
            index = torch.tensor(nodes).to(device, non_blocking=True)
            processed[index] = scores.processor(prefixes_of(tree, nodes, sequence), processed[index])
    return processed


def by_depth(tree: TokenTree) -> list[list[int]]:
    """The tree's nodes grouped by depth, shallowest first."""
    levels: dict[int, list[int]] = {}
    for node, depth in enumerate(tree.depths):
        levels.setdefault(depth, []).append(node)
    return [levels[depth] for depth in sorted(levels)]


def prefixes_of(tree: TokenTree, nodes: list[int], sequence: torch.Tensor) -> torch.Tensor:
    """[len(nodes), committed + d]: each node's prefix (the committed text, then its path's tokens), for nodes all
    at depth d."""
    paths = [[tree.tokens[i] for i in tree.path_to(node)[1:]] for node in nodes]
    if not paths[0]:
        return sequence.expand(len(nodes), -1)
    tail = torch.tensor(paths, dtype=sequence.dtype).to(sequence.device, non_blocking=True)
    return torch.cat([sequence.expand(len(nodes), -1), tail], dim=1)
