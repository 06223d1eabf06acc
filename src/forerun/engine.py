"""The decode loop: propose -> pack -> forward -> verify -> commit, for every method.

Output bookkeeping (stopping, streaming, token sources) lives in `Transcript`; the loop only moves tokens.
Greedy output equals `model.generate(do_sample=False)` token for token: the prefill and the first token are
computed exactly as transformers does, and every later token is the target's own choice at its own prefix.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

from forerun.config import EngineConfig
from forerun.drafters.base import DraftContext, Drafter, StepOutcome
from forerun.kvcache import UnsupportedCacheError, check_tree_cache, keep_accepted
from forerun.stats import GenerationStats
from forerun.tree import TokenTree, pack
from forerun.verify import Verdict, verify_greedy, verify_sample

logger = logging.getLogger(__name__)

TREE_ATTENTION = ("eager", "sdpa")
"""Attention implementations that take an arbitrary 4-D mask (flash-attention only knows causal/padding)."""


@dataclass
class Transcript:
    """The growing sequence [1, prompt + new], checked against the stopping criteria one token at a time."""

    sequence: torch.Tensor
    stopping: StoppingCriteriaList
    streamer: object | None = None
    sources: list[str] = field(default_factory=list)
    """Per new token: 'model' (the target's own step) or the name of the drafter it was accepted from."""
    done: bool = False

    def extend(self, tokens: list[int], sources: list[str]) -> list[int]:
        """Append tokens until a criterion fires (exactly where plain generate stops); return those appended."""
        taken = []
        for token, source in zip(tokens, sources, strict=True):
            self.sequence = torch.cat([self.sequence, self.sequence.new_tensor([[token]])], dim=1)
            self.sources.append(source)
            taken.append(token)
            if bool(self.stopping(self.sequence, None).any()):
                self.done = True
                break
        if self.streamer is not None and taken:
            note_sources = getattr(self.streamer, "note_sources", None)
            if note_sources is not None:  # optional: streamers that colour tokens by origin (forerun chat)
                note_sources(self.sources[len(self.sources) - len(taken) :])
            self.streamer.put(self.sequence.new_tensor(taken))
        return taken


def tree_support(model: torch.nn.Module) -> str | None:
    """None if `model` can verify trees, else the reason it cannot (the caller falls back to plain)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION:
        return (
            f"{type(model).__name__} uses attn_implementation={impl!r}, which cannot take a tree attention mask; "
            f"load it with one of {TREE_ATTENTION}"
        )
    return None


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

    def scores(self, node: int) -> torch.Tensor:
        row = self.logits[node : node + 1].float()  # [1, vocab]
        if not self.processor:
            return row[0]
        path = [self.tree.tokens[i] for i in self.tree.path_to(node)[1:]]
        prefix = torch.cat([self.sequence, self.sequence.new_tensor([path])], dim=1) if path else self.sequence
        return self.processor(prefix, row)[0]

    def argmax(self, node: int) -> int:
        return int(self.scores(node).argmax())

    def probs(self, node: int) -> torch.Tensor:
        return torch.softmax(self.scores(node), dim=-1)


@dataclass(frozen=True)
class Sampling:
    """Sample instead of argmax: the bonus tokens and acceptances draw from `generator` (None = torch's global)."""

    generator: torch.Generator | None = None
    verifier: Callable = verify_sample
    """The lossless verifier; a parameter so tests can show that a biased one is caught."""


def verify(tree: TokenTree, scores: NodeScores, sampling: Sampling | None) -> Verdict:
    if sampling is None:
        return verify_greedy(tree, scores.argmax)
    return sampling.verifier(tree, scores.probs, sampling.generator)


def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    drafters: Sequence[Drafter],
    transcript: Transcript,
    eos_token_ids: frozenset[int],
    max_new_tokens: int,
    engine_config: EngineConfig | None = None,
    processor: LogitsProcessorList | None = None,
    sampling: Sampling | None = None,
) -> GenerationStats:
    """Greedy tree decoding of `input_ids` [1, prompt_len]; tokens land in `transcript`, stats are returned."""
    engine_config = engine_config or EngineConfig()
    stats, started = GenerationStats(), time.perf_counter()
    cache = DynamicCache(config=model.config)
    budget = engine_config.max_tree_nodes
    prompt_len = input_ids.shape[1]
    drafters = fallback_if_unsupported(model, cache, drafters, prompt_len + max_new_tokens + budget, stats)
    ctx = DraftContext(
        transcript.sequence[0].tolist(),
        prompt_len,
        budget,
        eos_token_ids,
        sampled=sampling is not None,
        processor=processor,
        generator=sampling.generator if sampling is not None else None,
    )
    # The prompt's last token is the first root. With drafters, the prompt before it rides in the first tree
    # forward (the `lead`), so the first draft is verified by the prefill itself, as transformers' assisted
    # generation does: one forward fewer per request. Without drafters, the prefill is exactly generate's.
    lead: list[int] = ctx.tokens[:-1] if drafters and engine_config.draft_in_prefill else []
    if not lead:
        logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, **last_logits(model, 1)).logits
        prompt_end = TokenTree.rooted_at(int(input_ids[0, -1]))
        first = verify(prompt_end, NodeScores(logits[:, -1, :], processor, transcript.sequence, prompt_end), sampling)
        stats.forwards, stats.prefill_seconds = 1, time.perf_counter() - started
        ctx.tokens.extend(transcript.extend([first.bonus_token], ["model"]))
    for drafter in drafters:
        drafter.start(ctx)
    prefix_len = len(ctx.tokens) - 1  # tokens before the root; all of them but the lead are in the cache
    while not transcript.done:
        # 1. propose: every drafter's tree, grafted under one root within the node budget
        t0 = time.perf_counter()
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        node_maps = [tree.graft(drafter.propose(ctx), budget) for drafter in drafters]
        # 2. pack and 3. forward: one call of the unmodified model
        t1 = time.perf_counter()
        packed = pack(tree, prefix_len, model.config._attn_implementation or "eager", model.dtype, model.device, lead)
        logits = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            past_key_values=cache,
            use_cache=True,
            **(last_logits(model, len(tree)) if lead else {}),
        ).logits[0, -len(tree) :]
        if lead:
            stats.prefill_seconds, lead = time.perf_counter() - started, []
        # 4. verify: the longest path the target agrees with, plus its own bonus token
        choices = logits.argmax(-1).tolist()  # [n] raw greedy choices, for drafters (the Jacobi window)
        verdict = verify(tree, NodeScores(logits, processor, transcript.sequence, tree), sampling)
        # 5. commit: keep the accepted path in the cache, append tokens, let drafters learn
        keep_accepted(cache, prefix_len, [0, *verdict.accepted_nodes])
        prefix_len += 1 + verdict.accepted_len
        new_tokens = [tree.tokens[i] for i in verdict.accepted_nodes] + [verdict.bonus_token]
        sources = [tree.sources[i] for i in verdict.accepted_nodes] + ["model"]
        new_tokens = transcript.extend(new_tokens, sources)
        ctx.tokens.extend(new_tokens)
        for drafter, node_map in zip(drafters, node_maps, strict=True):
            drafter.observe(ctx, StepOutcome(tree, verdict, choices, new_tokens, node_map))
        candidates = sum(role == "candidate" for role in tree.roles)
        stats.record_step(
            len(tree),
            candidates,
            verdict.accepted_len,
            Counter(sources[:-1]),
            t1 - t0,
            time.perf_counter() - t1,
        )
    for drafter in drafters:
        drafter.finish(ctx)
    stats.new_tokens = len(transcript.sources)
    stats.total_seconds = time.perf_counter() - started
    return stats


def last_logits(model: torch.nn.Module, n: int) -> dict[str, int]:
    """{'logits_to_keep': n} when `model.forward` takes it: a prefill then skips the LM head on every prompt
    position but the last n (with a 150k vocabulary that is most of a short prompt's prefill), as generate does."""
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def fallback_if_unsupported(
    model: torch.nn.Module,
    cache: DynamicCache,
    drafters: Sequence[Drafter],
    max_len: int,
    stats: GenerationStats,
) -> Sequence[Drafter]:
    """Drop the drafters (plain decoding: still exact) when this model or cache cannot verify trees."""
    if not drafters:
        return drafters
    reason = tree_support(model)
    if reason is None:
        try:
            check_tree_cache(cache, max_len, type(model).__name__)
        except UnsupportedCacheError as error:
            reason = str(error)
    if reason is None:
        return drafters
    logger.warning("forerun: falling back to plain decoding: %s", reason)
    stats.fallback_reason = reason
    return []
