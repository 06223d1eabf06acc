"""Frozen configuration dataclasses, one per drafting method, validated on construction.

Every knob is explicit: the CLI, the server and the Python API all build these same objects. Which method uses
which config, and the per-device defaults, are declared by the drafter modules (`forerun.methods.REGISTRY`).

Example:
    >>> from forerun.config import PromptLookupConfig
    >>> PromptLookupConfig(max_ngram=3, draft_len=8).max_ngram
    3
    >>> PromptLookupConfig(max_ngram=0)
    Traceback (most recent call last):
    ...
    ValueError: PromptLookupConfig.max_ngram must be an integer >= 1 and <= 64, got 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def check_int(owner: object, name: str, minimum: int, maximum: int) -> None:
    """Raise a ValueError naming `owner.name` unless it is an int in [minimum, maximum] (bools are refused).

    Every knob has a ceiling: the server builds a Decoder from a request's knobs, and a Jacobi window of 100000
    columns x 999 levels (100 million probes a step) took 12 GB and minutes before the first token."""
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{type(owner).__name__}.{name} must be an integer >= {minimum} and <= {maximum}, got "
                         f"{value!r:.40}")  # fmt: skip


def check_number(owner: object, name: str, maximum: float = 1e6) -> None:
    """Raise a ValueError naming `owner.name` unless it is a number in [0, maximum] (bools are refused).

    A ceiling as for integers: a trie weight of 1e308 passed as finite, then its counts summed to infinity and the
    cost model's score bins overflowed in the middle of a shared batch."""
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value <= maximum):
        raise ValueError(f"{type(owner).__name__}.{name} must be a number >= 0 and <= {maximum:g}, got {value!r:.40}")


MAX_PROBES = 1024
"""Most Jacobi probe tokens (window x levels) a step may carry."""


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup: copy what followed an earlier occurrence of the text's last n-gram."""

    max_ngram: int = 3
    """Longest suffix n-gram to look up; longer matches are tried first."""
    min_ngram: int = 1
    """Shortest suffix n-gram to look up before giving up for this step."""
    draft_len: int = 10
    """Tokens copied after a match (depth of each branch)."""
    max_branches: int = 2
    """Distinct continuations proposed at once; they share prefixes in one tree."""

    def __post_init__(self) -> None:
        check_int(self, "max_ngram", 1, 64)
        check_int(self, "min_ngram", 1, 64)
        check_int(self, "draft_len", 1, 256)
        check_int(self, "max_branches", 1, 64)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookupConfig.min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")


@dataclass(frozen=True)
class JacobiConfig:
    """Jacobi lookahead decoding (lade): a W x (N-1) window of probe tokens plus an n-gram pool.

    lade's defaults are window=7, ngram=5, max_candidates=7 (forerun's CUDA defaults, lade's behaviour). The CPU
    defaults are small because a CPU pays for every token of a forward: a window of W=1, N=4 is a chain of 3
    probes, fed only on steps that also verify candidates (`lazy_window`, with a static budget; the cost model
    decides by the window's measured worth instead), the output's n-grams pooled too. How they were chosen, with
    figures: docs/benchmarks.md.
    """

    window: int = 1
    """W: future positions iterated in parallel (columns of the window)."""
    ngram: int = 4
    """N: n-gram size; the window keeps N-1 levels of the Jacobi trajectory."""
    max_candidates: int = 3
    """G: pool n-grams verified per step; the pool keeps at most G per key (0 = no verification branch)."""
    pool_policy: Literal["fifo", "frequency"] = "fifo"
    """fifo: the oldest n-gram of a key leaves first (lade). frequency: the least seen leaves first."""
    pool_from_prompt: bool = True
    """Seed the pool with the prompt's own n-grams (lade's POOL_FROM_PROMPT)."""
    pool_from_output: bool = True
    """Also add the n-grams of the committed output as it grows (not in lade, which pools window n-grams only)."""
    lazy_window: bool = True
    """Feed the window only on steps that also verify pool candidates; a step with none is a 1-token forward
    (cost-aware: on a CPU the window alone costs ~1.5x a plain step and yields no token that step)."""
    seed: int = 0
    """Seed of the window's initial tokens (drawn from the prompt), for reproducible step counts."""

    def __post_init__(self) -> None:
        check_int(self, "window", 1, 64)
        check_int(self, "ngram", 2, 32)
        check_int(self, "max_candidates", 0, 256)
        check_int(self, "seed", 0, 2**63 - 1)
        if self.window * (self.ngram - 1) > MAX_PROBES:
            raise ValueError(f"JacobiConfig: window x (ngram - 1) must be <= {MAX_PROBES} probe tokens, got "
                             f"{self.window} x {self.ngram - 1}")  # fmt: skip
        if self.pool_policy not in ("fifo", "frequency"):
            raise ValueError(f"JacobiConfig.pool_policy must be 'fifo' or 'frequency', got {self.pool_policy!r}")


@dataclass(frozen=True)
class TrieConfig:
    """Trie lookahead (PIA): a bounded frequency trie over prompts and outputs proposes a multi-branch tree."""

    decoding_length: int = 12
    """Most draft nodes proposed per step (the tree's size without its root)."""
    branch_length: int = 8
    """Deepest branch, and the length of the windows inserted into the trie."""
    max_query_length: int = 2
    """Longest context suffix used as the query; longer matches are tried first."""
    max_nodes: int = 200_000
    """Global node budget of the trie; low counts are decayed and pruned beyond it."""
    prompt_weight: float = 0.25
    """Count added for n-grams of the current prompt (removed when the request ends)."""
    output_weight: float = 1.0
    """Count added for n-grams of generated outputs (kept across requests)."""
    skip_anchors: tuple[int, ...] = ()
    """Token ids never used as the first token of an inserted window (PIA's stop words: spaces, punctuation...
    anchor poor drafts). The CLI and server take "13,28"."""

    def __post_init__(self) -> None:
        anchors = self.skip_anchors
        if isinstance(anchors, str):
            try:
                anchors = tuple(int(part) for part in anchors.split(",") if part.strip())
            except ValueError:
                raise ValueError(f"TrieConfig.skip_anchors must be token ids like '13,28', got {anchors!r}") from None
        if isinstance(anchors, int) and not isinstance(anchors, bool):
            anchors = (anchors,)
        if not isinstance(anchors, (tuple, list, frozenset, set)) or not all(
            isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in anchors
        ):
            raise ValueError(f"TrieConfig.skip_anchors must be token ids >= 0, got {self.skip_anchors!r}")
        object.__setattr__(self, "skip_anchors", tuple(anchors))  # frozen: normalise once, here
        check_int(self, "decoding_length", 1, 1024)
        check_int(self, "branch_length", 1, 256)
        check_int(self, "max_query_length", 1, 64)
        check_int(self, "max_nodes", 16, 10_000_000)
        check_number(self, "prompt_weight")
        check_number(self, "output_weight")


@dataclass(frozen=True)
class DraftModelConfig:
    """Speculative decoding with a draft model sharing the tokenizer (Leviathan et al. 2023; Chen et al. 2023).

    The draft model itself is not a knob: pass it to `Decoder(..., draft_model=...)` (a model or a name for
    `load_model`), or set `self_draft_layers` to draft with the target's own first layers.
    """

    gamma: int = 10
    """Draft tokens proposed per step at the start (the schedule then moves it within [1, max_gamma])."""
    max_gamma: int = 20
    """Most draft tokens per step."""
    schedule: Literal["fixed", "grow", "heuristic"] = "heuristic"
    """fixed: always gamma. grow: +1 after a step whose drafts were all accepted, -1 otherwise.
    heuristic: transformers' assisted-generation schedule, +2 / -1."""
    confidence: float = 0.4
    """Stop drafting a step early once the draft's top probability falls below this (transformers'
    assistant_confidence_threshold); 0 drafts all gamma tokens."""
    tree_width: int = 2
    """Also propose the draft's 2nd..k-th choices at the first position (leaves of a small tree; sampled runs:
    the runners-up of its noisy scores).
    gamma, max_gamma and this default follow a target whose latency is nearly flat over a few dozen tokens, where
    long drafts cost little when the confidence stop cuts the poor ones (docs/benchmarks.md)."""
    self_draft_layers: int = 0
    """> 0: no second model; the target's first K decoder layers plus its LM head draft (layer skipping)."""
    lookup: int = 8
    """> 0: speculation inside the draft: after each drafted token, prompt lookup guesses up to `lookup` more
    (what followed the same n-gram earlier in the text) and the draft checks them in that same forward of its
    own; every guess the draft's own choice confirms costs no further draft forward. The drafts are unchanged
    (the draft's choices decide), only cheaper. 0: one draft forward per drafted token, as transformers does."""
    lookup_min_hits: float = 1.5
    """Feed the guesses only while the draft has recently confirmed at least this many guessed tokens per guess
    (a running mean, also over guesses it only watched): a guess pays when the tokens it saves outweigh the cost
    of the wider draft forward (docs/benchmarks.md has the draft's latency curve). 0: always feed."""

    def __post_init__(self) -> None:
        check_int(self, "gamma", 1, 256)
        check_int(self, "max_gamma", 1, 256)
        check_int(self, "tree_width", 1, 64)
        check_int(self, "self_draft_layers", 0, 1024)
        check_int(self, "lookup", 0, 256)
        check_number(self, "lookup_min_hits")
        if self.gamma > self.max_gamma:
            raise ValueError(f"DraftModelConfig.gamma ({self.gamma}) must be <= max_gamma ({self.max_gamma})")
        if self.schedule not in ("fixed", "grow", "heuristic"):
            raise ValueError(f"DraftModelConfig.schedule must be fixed, grow or heuristic, got {self.schedule!r}")
        value = self.confidence
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"DraftModelConfig.confidence must be a number in [0, 1), got {value!r}")


@dataclass(frozen=True)
class Eagle3Config:
    """A trained EAGLE-3 head drafts a dynamic tree (EAGLE-2's expansion): level by level the `width` most
    probable nodes so far (the product of the head's probabilities along their path) get their `topk` most
    probable children, down to `depth` levels. The head itself is not a knob: `Decoder(..., draft_head=PATH)`."""

    depth: int = 5
    """Most levels of the draft tree below the root (one forward of the head each, beyond the first). A step drafts
    one level below the deepest of the head's guesses the budget fed the step before, up to this."""
    topk: int = 4
    """Children tried under each expanded node."""
    width: int = 4
    """Nodes expanded per level: the most probable ones."""
    min_prob: float = 0.1
    """Only paths at least this probable (the product of the head's probabilities) are expanded further: where the
    head is unsure, deeper guesses rarely hold, and each level costs a forward of the head."""
    catch_up: int = 64
    """Positions written while the head sat out (the cost model measured it not paying) that it reads when it
    drafts again, in one forward: the newest; past this many its cache starts over from them. 0: it starts over
    from the step it drafts in (its first step back drafts nothing)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"Eagle3Config.min_prob must be in [0, 1], got {self.min_prob}")
        check_int(self, "depth", 1, 32)
        check_int(self, "topk", 1, 32)
        check_int(self, "width", 1, 32)
        check_int(self, "catch_up", 0, 4096)


@dataclass(frozen=True)
class EngineConfig:
    """What every method shares: how many nodes a forward may carry and who decides it."""

    max_tree_nodes: int | None = None
    """Most nodes (root included) fed in one forward. None: what the method asks for (static budget), or the
    largest size the device's latency curve affords (cost model)."""
    draft_in_prefill: bool = True
    """Verify the first draft in the prefill forward (prompt + tree, as transformers' assisted generation does)
    instead of a prefill for the first token, then a first tree: one forward fewer per request."""
    adaptive: bool | None = None
    """Decide each step's tree with the cost model (expected tokens per second on the measured latency curve).
    None: on for every model-free method and for combinations; off for draft_model alone. False: the static
    budget (each method feeds what its knobs ask for, every step)."""
    static_cache: bool | None = None
    """Verify a single row's trees on a preallocated cache, padded to a few tree sizes, each size's forward
    captured once as a CUDA graph on a GPU (`forerun.base.static.StaticBase`). None: on a CUDA device, off elsewhere (a
    CPU gains nothing from fixed shapes, and keeps the prefix cache). Batches keep the growing cache."""
    compile_buckets: bool = False
    """With the static cache: compile each bucket's forward (`torch.compile`, inductor) before capturing it: tens of
    seconds per bucket once, for steps with fused kernels. Without it (a CPU's default) nothing is compiled, and a
    warning says so."""
    reproducible: bool | None = None
    """Decide what is fed from stored measurements only (the latency curve on disk, the learned acceptance), never
    from this run's timings, so that the same prompt with the same settings and a fresh Decoder writes the same text
    every run. None: on in low precision (bf16, fp16, quantized weights: each tree shape rounds differently, and a
    choice steered by timings could move a tie), off in fp32 (the text is the model's whatever is fed)."""

    def __post_init__(self) -> None:
        if self.max_tree_nodes is not None:
            check_int(self, "max_tree_nodes", 1, 4096)
        for name in ("draft_in_prefill", "adaptive", "static_cache", "compile_buckets", "reproducible"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (
                name in ("adaptive", "static_cache", "reproducible") and value is None
            ):
                raise ValueError(f"EngineConfig.{name} must be true or false, got {value!r}")
