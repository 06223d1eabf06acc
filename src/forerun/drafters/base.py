"""The drafter protocol: `propose` a tree from the committed text, `observe` what verification decided.

A drafter knows nothing of the model forward; the engine knows nothing of how drafts are made. Per-request state
is reset in `start`; state that outlives requests (pools, tries) stays in the drafter object, which the caller's
`Decoder` owns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import LogitsProcessorList

from forerun.noise import GumbelNoise
from forerun.tree import TokenTree
from forerun.verify import Verdict


@dataclass
class DraftContext:
    """What a drafter may read: the committed tokens (prompt + output; the last one is the tree's root)."""

    tokens: list[int]
    prompt_len: int
    budget: int
    """Most nodes, root included, a proposal may have (the engine's budget may feed fewer)."""
    eos_token_ids: frozenset[int]
    processor: LogitsProcessorList | None = None
    """The target's logits processors (temperature, top-p, penalties...), for drafters that score tokens."""
    noise: GumbelNoise | None = None
    """The run's sampling noise (None: greedy); drafters that score tokens guess the target's draws with it."""
    selective: bool = False
    """A cost model picks which proposed nodes are fed: propose whatever might pay, with honest scores (the
    Jacobi window even on a step without candidates); with a static budget, propose only what should be fed."""
    salt: str = ""
    """The request's tenant (`cache_salt`): state learned from requests (the trie, the n-gram pool) is read and
    written only under it (`forerun.drafters.tenants`); "" is the shared, unsalted state."""
    left: int | None = None
    """Tokens the answer may still take (None: not bounded): a guess deeper than `left - 1` could not be kept, and
    is cut from a proposal in any case (`TokenTree.within_depth`)."""


@dataclass(frozen=True)
class StepOutcome:
    """What one verified forward decided, shown to every drafter."""

    tree: TokenTree
    verdict: Verdict
    logits: torch.Tensor
    """[len(tree), vocab]: the target's raw logits at every node fed (probe nodes included)."""
    new_tokens: list[int]
    """Tokens committed by this step (accepted + bonus), already appended to the context."""
    node_map: dict[int, int]
    """This drafter's proposed node -> node of `tree` (nodes the budget did not feed are absent)."""
    features: torch.Tensor | None = None
    """[m, features]: the target's hidden states at the layers drafters asked for (`feature_layers`), at the last
    m committed positions before the new last token (every position this step's forward read and kept: the lead
    at a prefill, then the root and the accepted nodes); None when no drafter asked or the base cannot tap them."""

    choices: list[int] | None = None
    """Every node's raw argmax, where the base already copied them to the host with the step (a card's base):
    reading one then costs no device round trip (a Jacobi window asks for one per probe)."""

    def choice(self, node: int) -> int:
        """The target's greedy (raw argmax) choice at node `node` of `tree`; computed only when asked."""
        if self.choices is not None:
            return self.choices[node]
        return int(self.logits[node].argmax())


class Drafter(Protocol):
    """Every method is one of these; `plain` is the empty list of drafters."""

    name: str

    def start(self, ctx: DraftContext) -> None:
        """A new request begins: `ctx.tokens` is the prompt (the first root is its last token), or the prompt plus
        its first token when the prefill ran alone (`EngineConfig.draft_in_prefill=False`, or no drafters)."""

    def propose(self, ctx: DraftContext) -> TokenTree:
        """Return a tree rooted at ctx.tokens[-1], of at most ctx.budget nodes."""
        ...

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """Learn from a verified step; ctx.tokens already includes outcome.new_tokens. A batch's step that fed its
        rows' roots alone is learnt a step late, while the next forward runs (`forerun.batch.Batch.learn`): ctx is
        as it was then; read the outcome's host fields (`choices`), not its logits (on a card the next forward has
        rewritten them)."""

    def finish(self, ctx: DraftContext) -> None:
        """The request ended (EOS, length or stop string)."""


def cut_at_eos(tokens: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """Keep tokens up to and including the first EOS: nothing after an end of text can be accepted.

    Example:
        >>> cut_at_eos([4, 2, 9], frozenset({2}))
        [4, 2]
    """
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens


@dataclass(frozen=True)
class MethodSpec:
    """How a drafting method plugs into forerun: each drafter module declares one (`METHOD = MethodSpec(...)`)
    and `forerun.methods.REGISTRY` lists them; the Decoder, CLI, chat, server and bench read only the registry.

    Example (prompt lookup's own spec, abridged):
        MethodSpec("prompt_lookup", PromptLookupConfig, build=lambda config, draft, vocab: PromptLookupDrafter(config),
                   budget=lambda config: 1 + min(config.draft_len * config.max_branches, 15), style="bold green")
    """

    name: str
    config: type
    """The frozen config dataclass; its fields are the method's knobs."""
    build: Callable[[Any, Any, int], Drafter]
    """(config, draft model or None, the target's output rows) -> a fresh drafter."""
    budget: Callable[[Any], int]
    """Nodes per forward, root included, the method asks for when it drafts alone with a static budget."""
    about: str = ""
    """One line for help texts."""
    min_budget: Callable[[Any], int] = lambda config: 1
    """Fewest nodes per forward the method can work with (the Jacobi window needs all its probes)."""
    device_defaults: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """Knob defaults per device kind ("cuda", ...) that differ from the config's own (CPU) defaults, and under
    "flat" those for a cost model on a flat latency curve (`LatencyCurve.flat`: extra tokens nearly free, so the
    method proposes wider and the cost model cuts what does not pay); a device kind's own entry wins."""
    style: str = "bold yellow"
    """How the CLI and chat colour the tokens this method's drafts got accepted for (rich style)."""
    model_free: bool = True
    """Drafts without a second model: part of method 'auto'."""
    reads_head: bool = False
    """Drafts with a trained head (`Decoder(..., draft_head=...)`), built with the head in place of a draft model."""
    needs_draft: Callable[[Any], bool] = lambda config: False
    """Whether this config drafts with a second model that the caller must supply."""
    saves_state: bool = False
    """Keeps what it learns across requests in state a Decoder can save and load (`Decoder.save_cache`)."""
    adaptive: bool = True
    """Alone, let the cost model choose each step's tree by default (else its static budget)."""
