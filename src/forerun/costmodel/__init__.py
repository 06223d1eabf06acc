"""What to feed this step: the drafters' trees merged, then cut to what pays on this device. Pure: no model.

Two budgets share one interface (`choose` the tree to feed from the drafters' proposals, `learn` from what was
committed):

- `StaticBudget(n)`: the drafters' trees grafted in order until n nodes (a single method's classic behaviour).
- `CostModel(curve)`: every proposed node carries a score, its drafter's estimate that the target accepts it once
  its parent is accepted. `Calibration` turns scores into probabilities learned online, per drafter, depth and
  score bin, from *every* proposed node, fed or not: after a step the committed tokens are the target's own choices,
  so any proposed path can be checked against them afterwards (this is what lets a drafter that was switched off
  earn its way back). With p(node) calibrated, a node's chance to be accepted is the product of p along its path,
  and feeding the k likeliest candidates (an ancestor-closed set, since a child is never likelier than its parent)
  is expected to commit 1 + E(k) tokens, E(k) their summed chances. The cost model feeds the k that maximises

        (1 + E(k)) / latency(tokens fed)

  on the device's measured latency curve (`LatencyCurve`, never assumed monotone), k = 0 (the root alone, one token
  per forward) included: when drafts are poor, decoding goes on at plain speed. Probe nodes (the Jacobi window:
  fed for their logits, never accepted) come in groups, one per drafter, fed whole or not at all; a group is worth
  the sum of its probes' scores (the drafter's estimate of the accepted tokens feeding it buys later) and costs
  its size. The nodes fed are those whose estimate came out highest, so estimates high by chance are fed more
  often than those low by chance: `FedCheck` scales each source's chances by how its fed guesses fared against
  what was predicted for them.

Example (a curve where 2 tokens cost 1.5x one token and 4 tokens 1.6x):
    >>> curve = LatencyCurve((1, 2, 4), (0.010, 0.015, 0.016))
    >>> # one sure candidate: (1 + 1) / 0.015 beats 1 / 0.010, so it is fed
    >>> # one candidate at 30%: (1 + 0.3) / 0.015 = 87 < 100 = 1 / 0.010, so the root goes alone
    >>> best_prefix([1.0], curve).nodes, best_prefix([0.3], curve).nodes
    (1, 0)
"""

from forerun.costmodel.batch import BatchPolicy, DraftSwitch, best_shared_count
from forerun.costmodel.budgets import Budget, CostModel, ForwardTimes, StaticBudget
from forerun.costmodel.calibration import Calibration, FedCheck, checked_candidates
from forerun.costmodel.choice import Choice, Ranking, Selection, best_prefix, support_keys
from forerun.costmodel.curve import FLAT_AT_16, LatencyCurve

__all__ = [
    "FLAT_AT_16",
    "BatchPolicy",
    "Budget",
    "Calibration",
    "Choice",
    "CostModel",
    "DraftSwitch",
    "FedCheck",
    "ForwardTimes",
    "LatencyCurve",
    "Ranking",
    "Selection",
    "StaticBudget",
    "best_prefix",
    "best_shared_count",
    "checked_candidates",
    "support_keys",
]
