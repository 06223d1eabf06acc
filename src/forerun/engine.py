"""The decode loop: propose -> pack -> forward -> verify -> commit, for every method.

Output bookkeeping (stopping, streaming, token sources) lives in `Transcript`; what to feed each step is the
budget's business (`forerun.costmodel`); the loop only moves tokens. Greedy output equals
`model.generate(do_sample=False)` token for token: every token is the target's own choice at its own prefix.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from forerun.base import DynamicBase, TreeBase
from forerun.costmodel import CostModel, StaticBudget
from forerun.drafters.base import DraftContext, Drafter, StepOutcome
from forerun.logprobs import TokenLogprob, token_logprobs
from forerun.noise import GumbelNoise
from forerun.prefixcache import Prefixes
from forerun.stats import GenerationStats
from forerun.tree import TREE_ATTENTION, TokenTree, tree_support  # noqa: F401 - re-exported
from forerun.verify import Verdict, verify_greedy, verify_sampled

logger = logging.getLogger(__name__)

Budget = StaticBudget | CostModel
"""Decides, each step, which of the proposed nodes are fed (see forerun.costmodel)."""

PREFILL_TREE_MAX_LEAD = 256
"""Longest lead (prompt tokens fed at the prefill) that a first tree rides with. A tree needs a 4-D mask, and with
one the whole prompt loses the causal kernel, which skips the upper triangle of its attention: measured on
SmolLM2-135M (fp32, 1 CPU thread) the prefill with an 8-node tree cost +58 ms for 128 prompt tokens, +94 ms for
512, +488 ms for 1024 and +3.2 s for 2048, while the tree can win at most one step (~70 ms there). Longer leads are
read causally, exactly as generate's prefill, and drafting starts at the next step; a lead that is short because
the prefix cache holds the rest rides with its tree (it has no long triangle of its own to lose)."""


def tree_in_prefill(wanted: bool, lead: int) -> bool:
    """Whether the prefill, feeding `lead` prompt tokens, verifies a first tree too (`wanted`: the caller would)."""
    return wanted and lead <= PREFILL_TREE_MAX_LEAD


@dataclass
class Transcript:
    """The growing sequence [1, prompt + new], checked against the stopping criteria one token at a time."""

    sequence: torch.Tensor
    stopping: StoppingCriteriaList
    streamer: object | None = None
    sources: list[str] = field(default_factory=list)
    """Per new token: 'model' (the target's own step) or the name of the drafter it was accepted from."""
    done: bool = False
    logprobs_top: int | None = None
    """None: no log-probabilities; k >= 0: each new token's log-probability and the k likeliest alternatives."""
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def extend(self, tokens: list[int], sources: list[str], rows: torch.Tensor | None = None) -> list[int]:
        """Append tokens until a criterion fires (exactly where plain generate stops); return those appended.

        `rows` [len(tokens), vocab]: the raw logits each token was chosen from (for log-probabilities).
        """
        taken = []
        for token, source in zip(tokens, sources, strict=True):
            self.sequence = torch.cat([self.sequence, self.sequence.new_tensor([[token]])], dim=1)
            self.sources.append(source)
            taken.append(token)
            if bool(self.stopping(self.sequence, None).any()):
                self.done = True
                break
        if self.logprobs_top is not None and rows is not None and taken:
            self.logprobs.extend(token_logprobs(rows, taken, self.logprobs_top))
        if self.streamer is not None and taken:
            note_sources = getattr(self.streamer, "note_sources", None)
            if note_sources is not None:  # optional: streamers that colour tokens by origin (forerun chat)
                note_sources(self.sources[len(self.sources) - len(taken) :])
            self.streamer.put(self.sequence.new_tensor(taken))
        return taken


@dataclass
class NodeScores:
    """Processed scores at tree nodes, computed lazily with each node's own prefix (committed text + path).

    Logits processors (repetition penalty, temperature, top-p...) read the token ids before the position they
    score, so a node deep in a branch is scored with the branch's tokens, exactly as plain decoding would see them.
    """

    logits: torch.Tensor  # [n, vocab]
    processor: LogitsProcessorList | None
    sequence: torch.Tensor  # [1, committed]; its last token is the root
    tree: TokenTree
    choices: list[int] | None = None
    """Each node's raw argmax, where the base copied them to the host at once (used when nothing processes the
    logits: one transfer per step instead of one sync per walked node on an accelerator)."""

    def scores(self, node: int) -> torch.Tensor:
        row = self.logits[node : node + 1].float()  # [1, vocab]
        if not self.processor:
            return row[0]
        path = [self.tree.tokens[i] for i in self.tree.path_to(node)[1:]]
        prefix = torch.cat([self.sequence, self.sequence.new_tensor([path])], dim=1) if path else self.sequence
        return self.processor(prefix.to(row.device), row)[0]

    def argmax(self, node: int) -> int:
        if self.choices is not None and not self.processor:
            return self.choices[node]
        return int(self.scores(node).argmax())


@dataclass(frozen=True)
class Sampling:
    """Sample instead of argmax: each token is the target's Gumbel-max draw under `noise` at its position."""

    noise: GumbelNoise
    verifier: Callable = verify_sampled
    """The lossless verifier; a parameter so tests can show that a biased one is caught."""


def verify(tree: TokenTree, scores: NodeScores, sampling: Sampling | None) -> Verdict:
    if sampling is None:
        return verify_greedy(tree, scores.argmax)
    return sampling.verifier(tree, scores.scores, sampling.noise, scores.sequence.shape[1])


def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    drafters: Sequence[Drafter],
    transcript: Transcript,
    eos_token_ids: frozenset[int],
    max_new_tokens: int,
    budget: Budget,
    draft_in_prefill: bool = True,
    processor: LogitsProcessorList | None = None,
    sampling: Sampling | None = None,
    prefixes: Prefixes | None = None,
    base: TreeBase | None = None,
) -> GenerationStats:
    """Tree decoding of `input_ids` [1, prompt_len]; tokens land in `transcript`, stats are returned.

    The first step is the prefill: the prompt before its last token rides in front of the first tree (the
    `lead`, a causal chain), so the first draft is verified by the prefill itself, as transformers' assisted
    generation does. With the root alone (no drafters, `draft_in_prefill=False`, or a lead longer than
    PREFILL_TREE_MAX_LEAD) that forward is exactly generate's prefill. `prefixes`: the KV of a head this prompt
    shares with earlier text is taken from there and not fed again; the text read here (prompt and answer) is left
    there for later prompts. `base`: the cache and forward trees are verified on (`forerun.base`; None: a
    `DynamicBase`, the CPU's).
    """
    stats, started = GenerationStats(), time.perf_counter()
    prompt_len = input_ids.shape[1]
    max_len = prompt_len + max_new_tokens + budget.max_nodes
    base, drafters = fallback_if_unsupported(model, base, drafters, max_len, stats)
    ctx = DraftContext(
        transcript.sequence[0].tolist(),
        prompt_len,
        budget.max_nodes,
        eos_token_ids,
        processor=processor,
        noise=sampling.noise if sampling is not None else None,
        selective=budget.selective,
        salt=prefixes.salt if prefixes is not None else "",
    )
    for drafter in drafters:
        drafter.start(ctx)
    budget.new_request()
    stats.cached_prompt_tokens = base.seed(prefixes, ctx.tokens)
    lead, prefix_len = ctx.tokens[stats.cached_prompt_tokens : -1], prompt_len - 1  # prefix_len: tokens before the root
    while not transcript.done:
        # 1. propose: every drafter's tree; the budget merges them and keeps what pays on this device
        t0 = time.perf_counter()
        drafts = stats.forwards > 0 or tree_in_prefill(draft_in_prefill, len(lead))
        # a prefill that verifies no tree needs no proposals (as for a batch row's)
        proposals = [drafter.propose(ctx) if drafts else TokenTree.rooted_at(ctx.tokens[-1]) for drafter in drafters]
        selection = budget.choose(ctx.tokens[-1], proposals, len(lead), drafts)
        tree = selection.tree
        # 2. pack and 3. forward: one call of the unmodified model
        t1 = time.perf_counter()
        fed = base.forward(tree, prefix_len, lead)
        logits = fed.logits  # [n, vocab]
        # 4. verify: the longest path the target agrees with, plus its own bonus token
        verdict = verify(tree, NodeScores(logits, processor, transcript.sequence, tree, fed.choices), sampling)
        if not lead:  # what this forward cost against the curve (a prefill is not on it)
            budget.timed(len(tree), time.perf_counter() - t1)
        # 5. commit: keep the accepted path in the cache, append tokens, let drafters and the budget learn
        base.commit(prefix_len, [0, *verdict.accepted_nodes])
        prefix_len, lead = prefix_len + 1 + verdict.accepted_len, []
        path = [0, *verdict.accepted_nodes]  # the node each new token was chosen at
        sources = [tree.sources[i] for i in verdict.accepted_nodes] + ["model"]
        tokens = [tree.tokens[i] for i in verdict.accepted_nodes] + [verdict.bonus_token]
        new_tokens = transcript.extend(tokens, sources, logits[path] if transcript.logprobs_top is not None else None)
        ctx.tokens.extend(new_tokens)
        t2 = time.perf_counter()
        for drafter, node_map in zip(drafters, selection.node_maps, strict=True):
            drafter.observe(ctx, StepOutcome(tree, verdict, logits, new_tokens, node_map))
        budget.learn(selection, new_tokens)
        t3 = time.perf_counter()
        stats.record_step(
            tree, verdict.accepted_len, Counter(sources[:-1]), t1 - t0 + t3 - t2, t2 - t1, selection.expected_accepted
        )
        if stats.forwards == 1:
            stats.prefill_seconds = t3 - started
    for drafter in drafters:
        drafter.finish(ctx)
    base.store(prefixes, ctx.tokens, prefix_len)  # the cache holds prompt + accepted; ctx.tokens the committed
    stats.new_tokens = len(transcript.sources)
    stats.total_seconds = time.perf_counter() - started
    return stats


def fallback_if_unsupported(
    model: torch.nn.Module,
    base: TreeBase | None,
    drafters: Sequence[Drafter],
    max_len: int,
    stats: GenerationStats,
) -> tuple[TreeBase, Sequence[Drafter]]:
    """A base ready for `max_len` tokens (the growing cache where the given one cannot hold this request, e.g. a
    text longer than a sliding window), and the drafters, dropped (plain decoding: still exact) when this model
    or its cache cannot verify trees."""
    reason = base.begin(max_len) if base is not None else None
    if base is None or reason is not None:
        if base is not None:
            logger.info("forerun: the growing cache for this request: %s", reason)
        base = DynamicBase(model)
        reason = base.begin(max_len)
    if not drafters:
        return base, drafters
    reason = tree_support(model) or reason
    if reason is None:
        return base, drafters
    logger.warning("forerun: falling back to plain decoding: %s", reason)
    stats.fallback_reason = reason
    return base, []
