"""Speculative decoding with a draft model: a small model sharing the tokenizer guesses, the target verifies.

Each step the draft model, which keeps its own KV cache, catches up with the committed text (rolling its cache
back to the longest prefix it still shares with it: rejected guesses are dropped, nothing is recomputed) and
proposes up to `gamma` tokens, one 1-token forward each. Greedy runs draft the argmax (and, with `tree_width`
k > 1, the 2nd..k-th choices at the first position as extra leaves); sampled runs draft the argmax of the draft's
scores (after the target's own logits processors) plus the run's Gumbel noise at the token's position: the very
noise the target draws with (`forerun.noise`), so where the two models' distributions are close their draws
coincide, and the verifier accepts a token exactly when it is the target's own draw.

Example (greedy, gamma 3): committed "... def", draft says " add ( a": tree root(def) -> add -> ( -> a.
The target accepts "add (" and gives "self" as its bonus; next step the draft cache is cropped back to
"... def add (" and fed "self" before drafting again.

With `lookup` L > 0 the draft speculates too: after drafting token t it also feeds the up to L tokens that
followed the same n-gram earlier in the text (prompt lookup), in the same forward of its own. While its own
choices confirm those guesses, their logits are already there and no draft forward is needed; at the first
disagreement the guessed keys/values are cropped. The drafted tokens are those of plain drafting; fewer draft
forwards produce them.
Guesses are fed only while they pay (`lookup_min_hits`); otherwise they are only watched, to learn when to resume.

Example (lookup 4): drafted "return", the text before had "return a + b", so the draft is fed
"return a + b" at once; it chooses "a", "+", "b" from the rows it already has, then feeds its next choice.

Where the draft's keys and values live is `forerun.drafters.draft_cache`'s: a growing cache with eager forwards on
a CPU, a static base of the draft's own on a card (each forward a captured graph, as the target's are).

`self_draft(model, k)` builds the no-second-model variant: the target's first k decoder layers and its own LM
head, sharing the target's weights (no copy).
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from forerun.base.weights import vocabulary_rows
from forerun.config import DraftModelConfig, PromptLookupConfig
from forerun.drafters.base import DraftContext, MethodSpec, StepOutcome, cut_at_eos
from forerun.drafters.draft_cache import SLOTS_AHEAD, DraftCache, GrowingDraftCache, SlotDraftCache, slot_pool
from forerun.drafters.prompt_lookup import PromptLookupDrafter
from forerun.head import LogitsHead
from forerun.tree import TokenTree


class DraftModelDrafter:
    """Drafts with `draft` (a causal LM sharing the target's token ids); `vocab` = the target's output rows.
    `slots`: the draft's forwards on a static base of its own, captured graphs on a card (None: where the draft
    sits on a CUDA card; `forerun.drafters.draft_cache`)."""

    name = "draft_model"

    def __init__(self, config: DraftModelConfig, draft: nn.Module, vocab: int, slots: bool | None = None) -> None:
        self.config, self.draft, self.vocab = config, draft, vocab
        self.gamma = config.gamma
        """The current draft length; the schedule moves it and it carries over to the next request."""
        self.pool = slot_pool(draft, slots)
        """Static bases the requests' draft caches take (shared by the drafters forked for a batch's rows); None:
        each request's draft cache grows."""
        self.store: DraftCache | None = None
        """This request's draft keys and values, and the forwards over them."""
        self.cached: list[int] = []
        """The token ids whose keys/values `store` holds, in order."""
        self.drafted = 0
        self.head = LogitsHead(draft)
        """The growing cache's logits (its first forward decides how the logits of a few positions are computed:
        guesses checked in one draft forward need several)."""
        self.lookup = (
            PromptLookupDrafter(PromptLookupConfig(draft_len=config.lookup, max_branches=1)) if config.lookup else None
        )
        """Guesses for the draft's own next tokens (prompt lookup), checked in one draft forward."""
        self.guess_rate = float(config.lookup_min_hits)
        """Running mean of guessed tokens the draft confirmed per guess; guesses are fed while it is high enough
        (it starts at the bar: guessing starts on, and carries over to the next request)."""

    def __copy__(self) -> DraftModelDrafter:
        """A view for one more concurrent request (`forerun.batch.fork`): the draft model, its pool of slot caches
        and the schedule's state are shared; the draft cache and the guesses' index are its own (a shared index
        was read and extended with every row's text, and guessed from other rows' text)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.store, twin.cached = None, []
        twin.lookup = copy.copy(self.lookup)
        return twin

    def start(self, ctx: DraftContext) -> None:
        self.release()
        self.store = SlotDraftCache(self.pool.take()) if self.pool is not None else self.growing()
        self.cached = []
        self.make_room(len(ctx.tokens))
        if self.lookup is not None:
            self.lookup.start(ctx)

    def growing(self) -> GrowingDraftCache:
        return GrowingDraftCache(self.draft, self.head)

    def make_room(self, length: int) -> None:
        """Room in the draft cache for `length` tokens; where making it dropped what was held, it is fed again (a
        slot cache that grew), and where slots cannot hold such a text, the rest of the request grows a cache."""
        try:
            kept = self.store.reserve(length)
        except ValueError:  # e.g. a draft whose sliding window is shorter than the text: exact in a growing cache
            self.release()
            self.store, kept = self.growing(), False
        if not kept:
            self.cached = []

    def release(self) -> None:
        """Hand a slot cache back to the pool (its graphs serve the next request)."""
        if isinstance(self.store, SlotDraftCache):
            self.pool.give(self.store.base)
        self.store = None

    def warm(self, max_len: int, rows: int = 1) -> float:
        """Capture the slot caches' graphs now for texts of up to `max_len` tokens (`Decoder.warm_up`): `rows`
        of them, one for each row of a batch drafting at once (each row drafts on a base of its own); returns the
        seconds spent (0.0 where the draft's cache grows)."""
        if self.pool is None:
            return 0.0
        started = time.perf_counter()
        bases = [self.pool.take() for _ in range(rows)]  # held together: each take is another base
        try:
            for base in bases:
                base.warm(max_len + SLOTS_AHEAD)
        finally:
            for base in bases:
                self.pool.give(base)
        return time.perf_counter() - started

    def propose(self, ctx: DraftContext) -> TokenTree:
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        room = min(self.gamma, ctx.budget - self.config.tree_width)
        if ctx.left is not None:  # a guess past the answer's end would be cut: its schedule would read a rejection
            room = min(room, ctx.left - 1)
        if room < 1:
            self.drafted = 0
            return tree
        self.make_room(len(ctx.tokens) + room + self.config.lookup + 1)
        # rows[i]: the draft's logits after `sequence` + guess[:i], already computed (no forward needed).
        rows = [self.catch_up(ctx.tokens)]
        # guess: the prompt-lookup guess not yet confirmed by the draft's choices; fed: its tokens were fed to the
        # draft beyond `sequence` (else it is only watched, to learn whether guesses pay).
        guess: list[int] = []
        fed, watching, hits = False, False, 0
        sequence = list(ctx.tokens)
        parent, drafted = 0, []
        for step in range(room):
            scores = self.scores(rows.pop(0), sequence, ctx)
            probs = torch.softmax(scores, dim=-1)
            if ctx.noise is not None:  # sampled: guess the target's draw at this position (the same noise)
                scores = ctx.noise.perturbed(scores, len(sequence))
            token, chance, best = choice_of(scores, probs)
            node = tree.add(parent, token, source=self.name, score=chance)
            if step == 0 and self.config.tree_width > 1:  # leaves: the draft's next choices, verified for free
                for alternative in scores.topk(self.config.tree_width).indices[1:].tolist():
                    tree.add(0, alternative, source=self.name, score=float(probs[alternative]))
            parent = node
            drafted.append(token)
            sequence.append(token)
            if token in ctx.eos_token_ids or step == room - 1 or best < self.config.confidence:
                break
            if guess and guess[0] == token:  # the draft's own choice confirms the guess
                guess.pop(0)
                hits += 1
                if not fed:  # a guess only watched: the draft still needs this token's forward
                    rows = self.forward([token])
                continue  # a fed guess: the next logits are already in rows
            if fed and guess:  # the draft chose otherwise: drop the guessed keys/values before feeding anew
                self.drop_last(len(guess))
            if watching:
                self.learn(hits)
            guess = self.guess_after(sequence, ctx, room - step - 2)
            hits, watching = 0, bool(guess)
            fed = watching and self.guess_rate >= self.config.lookup_min_hits
            rows = self.forward([token, *guess] if fed else [token])
        if watching:
            self.learn(hits)
        self.drafted = len(cut_at_eos(drafted, ctx.eos_token_ids))
        return tree

    def learn(self, hits: int) -> None:
        """Fold how many tokens of a settled guess the draft confirmed into the running rate (fed or not)."""
        self.guess_rate = 0.8 * self.guess_rate + 0.2 * hits

    def guess_after(self, sequence: list[int], ctx: DraftContext, room: int) -> list[int]:
        """What followed the last n-gram of `sequence` earlier in the text (at most `room` tokens), or []."""
        if self.lookup is None or room < 1:
            return []
        found = next(self.lookup.continuations(sequence, ctx.eos_token_ids), None)
        return found[1][:room] if found else []

    def catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Crop the cache to what it shares with `tokens` (never the last token), feed the rest; last logits."""
        shared = 0
        limit = min(len(self.cached), len(tokens) - 1)
        while shared < limit and self.cached[shared] == tokens[shared]:
            shared += 1
        self.drop_last(len(self.cached) - shared)
        return self.forward(tokens[shared:], keep=1)[0]

    def drop_last(self, count: int) -> None:
        """Forget the last `count` cached tokens (rejected guesses: nothing else is recomputed)."""
        if count > 0:
            self.store.crop(len(self.cached) - count)
            del self.cached[-count:]

    @torch.inference_mode()
    def forward(self, tokens: list[int], keep: int | None = None) -> list[torch.Tensor]:
        """Feed `tokens` after the cached ones; the logits [vocab of the target] at the last `keep` of them
        (all of them by default), in order."""
        keep = len(tokens) if keep is None else keep
        logits = self.store.feed(tokens, len(self.cached), keep)
        self.cached.extend(tokens)
        return [fit_rows(row.float(), self.vocab) for row in logits]

    def scores(self, logits: torch.Tensor, sequence: list[int], ctx: DraftContext) -> torch.Tensor:
        """The draft's next-token scores after the target's processors, applied with the draft's own prefix."""
        if not ctx.processor:
            return logits
        prefix = torch.tensor([sequence], dtype=torch.long, device=logits.device)
        return ctx.processor(prefix, logits[None])[0]

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if self.lookup is not None:
            self.lookup.observe(ctx, outcome)
        if self.drafted == 0:
            return
        all_taken = outcome.verdict.accepted_len >= self.drafted
        schedule = self.config.schedule
        if schedule == "grow":
            self.gamma += 1 if all_taken else -1
        elif schedule == "heuristic":  # transformers' num_assistant_tokens_schedule="heuristic"
            self.gamma += 2 if all_taken else -1
        self.gamma = max(1, min(self.gamma, self.config.max_gamma))

    def finish(self, ctx: DraftContext) -> None:
        self.release()  # the draft's cache is per request: freed, or its slots handed back
        self.cached = []
        if self.lookup is not None:
            self.lookup.finish(ctx)


def choice_of(scores: torch.Tensor, probs: torch.Tensor) -> tuple[int, float, float]:
    """The draft's choice at one position: argmax of `scores` [vocab], its probability and the largest one under
    `probs` [vocab], read in one copy to the host (on a card, three reads would each wait for it).

    Example:
        >>> choice_of(torch.tensor([0.0, 2.0, 1.0]), torch.tensor([0.2, 0.5, 0.3]))
        (1, 0.5, 0.5)
    """
    token = scores.argmax()
    got = torch.stack([token.to(probs.dtype), probs[token], probs.max()]).tolist()
    return int(got[0]), got[1], got[2]


def fit_rows(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's `vocab` rows: extra rows cut, missing rows -inf (never drafted)."""
    if logits.shape[0] >= vocab:
        return logits[:vocab]
    return torch.cat([logits, logits.new_full((vocab - logits.shape[0],), float("-inf"))])


def output_rows(model: nn.Module) -> int:
    return vocabulary_rows(model)


def model_name(model: nn.Module) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def check_same_vocabulary(target: nn.Module, draft: nn.Module, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise a ValueError naming both models unless the draft's token ids mean the target's.

    With both tokenizers, their vocabularies (token -> id) must be equal. The output rows may differ only beyond
    the tokenizer's length (a target padded larger than its tokenizer is fine).
    """
    names = f"draft model {model_name(draft)!r} and target {model_name(target)!r}"
    used = None
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError(f"{names} use different tokenizers; a draft model must share the target's tokenizer")
        used = len(target_tokenizer)
    elif target_tokenizer is not None:
        used = len(target_tokenizer)
    rows_target, rows_draft = output_rows(target), output_rows(draft)
    if rows_target != rows_draft and (used is None or used > min(rows_target, rows_draft)):
        raise ValueError(
            f"{names} have different vocabularies ({rows_draft} vs {rows_target} output rows); "
            "a draft model must share the target's tokenizer"
        )


def load_draft(name: str, target: nn.Module, tokenizer=None) -> nn.Module:
    """Load draft model `name` next to `target` (same device, dtype, attention); refuse another tokenizer."""
    from forerun.models import load_model

    attn = target.config._attn_implementation or "sdpa"
    draft, draft_tokenizer = load_model(name, attn, target.dtype, str(next(target.parameters()).device))
    check_same_vocabulary(target, draft, tokenizer, draft_tokenizer)
    return draft


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s parameters and children, with its own table of children."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def self_draft(model: nn.Module, layers: int) -> nn.Module:
    """The target's first `layers` decoder layers + final norm + LM head, as a model of its own (shared weights).

    Works for the families whose decoder layers sit in `model.<base>.layers` (llama, qwen2, mistral, gemma,
    phi3, ...). The target is left untouched.
    """
    base = getattr(model, model.base_model_prefix, None)
    stack = getattr(base, "layers", None)
    if not isinstance(stack, nn.ModuleList):
        raise ValueError(
            f"self-drafting needs decoder layers at model.{model.base_model_prefix}.layers; "
            f"{type(model).__name__} has none"
        )
    if not 1 <= layers < len(stack):
        raise ValueError(f"self_draft_layers must be in [1, {len(stack) - 1}] for {type(model).__name__}, got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    draft_base = shallow_copy(base)
    draft_base.layers = nn.ModuleList(list(stack)[:layers])
    draft_base.config = config
    draft = shallow_copy(model)
    setattr(draft, model.base_model_prefix, draft_base)
    draft.config = config
    return draft


METHOD = MethodSpec(
    name="draft_model",
    config=DraftModelConfig,
    build=lambda config, draft, vocab: DraftModelDrafter(config, draft, vocab),
    budget=lambda config: 1 + config.max_gamma + config.tree_width - 1,
    about="a small model sharing the tokenizer drafts (speculative sampling, Leviathan et al. / Chen et al.)",
    style="bold yellow",
    model_free=False,
    needs_draft=lambda config: not config.self_draft_layers,
    adaptive=False,  # its draft forwards are paid whatever is fed; its schedule and confidence stop size the draft
)
