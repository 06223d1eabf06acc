"""Guesses verified as one chain on a model with recurrent states (Qwen3.5, Qwen3-Next, Granite 4, Nemotron-H,
Bamba, Jamba, LFM2, OLMo hybrid).

Such a model's cache holds, beside per-token keys and values, recurrent or convolution states that a forward
advances through every token it is fed: a tree's side branches would all flow into one state, and a rejected
guess cannot be taken out of it. A chain can be verified all the same. Before a step that feeds a guess, the states
are copied; where the target rejects part of the chain, they are put back, the attention layers are cut back to
the text before the step, and the accepted tokens are fed again in front of the next step's tokens (as a prompt's
are at the prefill; their logits are not computed). Where the whole chain is accepted the states are already
right. The cost model prices those tokens (`CostModel.chain`), so a chain is fed only where it pays with them.

    step:         [p0 .. p{L-1} | r g1 g2 g3]      states copied before it
    g2 rejected:  states put back, keys cut to L   [p0 .. p{L-1}]        r g1 pending, t (the target's) the root
    next step:    [p0 .. p{L-1} | r g1 t h1 h2]    r g1 fed again before the next chain

A model whose states are convolution windows only (LFM2: the last few inputs of each short convolution, no
recurrent state) needs neither: transformers records a layer's inputs during a step (`activate_past_recording`)
and cuts the window back to end at the last accepted token (`crop`), as keys and values are cut, so nothing is
fed again (`croppable`; `CostModel.refeeds` is then off). So does a model whose forward, asked to, writes the
recurrent state after each of a step's last tokens into its cache (transformers 5.25: Qwen3.5, Qwen3-Next,
Nemotron-H, Granite 4, Bamba, Falcon-H1, Zamba 2, OLMo hybrid, Jamba, Mamba, Mamba2, Falcon-Mamba; not Zamba;
`records_states` finds out): `crop` puts back the state after the last accepted token.

Example:
    >>> base = ChainBase(model)                                            # doctest: +SKIP
    >>> base.begin(max_len=512)                                            # doctest: +SKIP
    >>> out = base.forward(chain, prefix_len=11, lead=())                  # root and 3 guesses   # doctest: +SKIP
    >>> base.commit(11, [0, 1])                                            # root and guess 1 kept  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from forerun.base.dynamic import TreeLogits, device_argmax
from forerun.head import LogitsHead
from forerun.kvcache import cut, keep_everything, roomy_cache
from forerun.prefixcache import MIN_REUSE, Prefixes
from forerun.tree import TokenTree, is_chain

StateCopy = list[tuple[dict, dict, dict, torch.Tensor] | None]
"""Per cache layer: copies of its convolution and recurrent states, their flags and the count of tokens it has read
(None: a layer without any)."""


def copy_states(cache: DynamicCache) -> StateCopy:
    """Copies of every recurrent and convolution state in `cache` (they are updated in place by the next forward)."""
    copies: StateCopy = []
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            copies.append(None)
            continue
        flags = {
            name: dict(getattr(layer, name))
            for name in ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized")
        }
        conv = {i: None if t is None else t.clone() for i, t in layer.conv_states.items()}
        recurrent = {i: None if t is None else t.clone() for i, t in layer.recurrent_states.items()}
        copies.append((conv, recurrent, flags, layer.cumulative_length_linear.clone()))
    return copies


def put_back(cache: DynamicCache, copies: StateCopy, length: int) -> None:
    """Restore the states `copy_states` took (handing `copies` over: the model writes into them next) and cut every
    attention layer back to its first `length` entries."""
    for layer, copied in zip(cache.layers, copies, strict=True):
        if copied is not None:
            conv, recurrent, flags, count = copied
            layer.conv_states.update(conv)  # the copies themselves: they are not used again
            layer.recurrent_states.update(recurrent)
            for name, values in flags.items():
                getattr(layer, name).update(values)
            layer.cumulative_length_linear.copy_(count)  # the cache's length where its first layer has states
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            cut(layer, length)


def state_layers(cache: DynamicCache) -> list[LinearAttentionCacheLayerMixin]:
    """The layers of `cache` that hold recurrent or convolution states (not per-token keys and values)."""
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def croppable(cache: DynamicCache) -> bool:
    """Whether every state of `cache` is a convolution window that transformers can record and cut back (LFM2),
    its layers set up by a first forward: then no rejected guess needs the states copied and put back."""
    layers = state_layers(cache)
    return bool(layers) and all(windows_only(layer) for layer in layers)


def windows_only(layer: LinearAttentionCacheLayerMixin) -> bool:
    """Whether `layer`'s states, set up by a first forward, are convolution windows and no recurrent state: its
    recorded inputs cut back (`crop`) without anything else to restore. (transformers 5.25 calls every such layer
    croppable: it restores a recurrent state from a history that only some models' forwards write.)"""
    if any(layer.is_recurrent_states_initialized.values()):
        return False
    return any(layer.is_conv_states_initialized.values())


def before_guesses(cache: DynamicCache, nodes: int, records: bool = False) -> tuple[bool, StateCopy | None]:
    """What lets a step of `nodes` tokens (a root, then guesses) be rolled back: its states recorded through the
    forward (convolution windows, `croppable`; or, `records`, the model writes each of the last `nodes` tokens'
    recurrent states too: `records_states`), `cut_back` dropping what was rejected: (True, None); else every state
    copied (`put_back`): (False, copies). A root alone needs neither: (False, None)."""
    if nodes <= 1:
        return False, None
    if croppable(cache) or (records and bool(state_layers(cache))):
        for layer in state_layers(cache):
            layer.activate_past_recording(recurrent_states_to_keep=nodes)
        return True, None
    return False, copy_states(cache)


def recorded(cache: DynamicCache, nodes: int) -> bool:
    """Whether the last forward wrote the recurrent states after each of its last `nodes` tokens into every layer
    of `cache` that has them (`crop` can then put any of them back), and some layer has them."""
    counts = [
        len(layer.recurrent_states_history[i])
        for layer in state_layers(cache)
        for i, initialized in layer.is_recurrent_states_initialized.items()
        if initialized
    ]
    return bool(counts) and all(count == nodes for count in counts)


def cut_back(cache: DynamicCache, rejected: int, length: int) -> None:
    """After a forward whose states were recorded (`before_guesses`): every convolution window to end at the last
    token kept (`rejected` fed tokens dropped, the window back to its kernel's width) and every recorded recurrent
    state to the one after it, recording off (a 1-token step then updates the states in place, as plain decoding's
    does); every attention layer to its first `length` entries."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.crop(-rejected)
            layer.record_past = False
        elif isinstance(layer, DynamicLayer) and layer.is_initialized:
            cut(layer, length)


def chain_cache_reason(cache: DynamicCache, max_len: int, model_name: str) -> str | None:
    """None where every layer of `cache` is per-token keys and values that can be cut (a sliding window only while
    the text stays inside it) or recurrent and convolution states that can be copied; else why not."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) and max_len >= layer.sliding_window - 1:
            return f"{model_name}: layer {index} has a sliding window shorter than the text ({max_len} tokens)"
        if not isinstance(layer, (DynamicLayer, LinearAttentionCacheLayerMixin)):
            return f"{model_name}: cache layer {index} is {type(layer).__name__}, which forerun cannot roll back"
    return None


class ChainBase:
    """The growing cache of a model with recurrent states; each step feeds the root and at most one chain of
    guesses (`forerun.tree.is_chain`), causally (no tree mask)."""

    features: tuple[int, ...] = ()  # hooks read them: every forward here runs the model's modules
    chains = True
    """Trees must be chains (the engine and the budget read this)."""

    def __init__(self, model: torch.nn.Module, records: bool = False) -> None:
        self.model = model
        self.records = records
        """Whether the model's forward writes each guess's recurrent state, asked to (`records_states`): a chain
        accepted in part then has its states cut back, nothing fed again."""
        self.head = LogitsHead(model)
        self.cache = roomy_cache(model.config)
        self.copies: StateCopy | None = None
        self.recorded = False
        """Whether the last forward's convolution windows were recorded (`croppable`), to be cut back at commit."""
        self.fed: list[int] = []
        self.start = 0
        """Where the last forward's tokens (`fed`) began: the text the copied states had read."""
        self.pending: list[int] = []
        """Accepted tokens the cache does not hold (a partly accepted chain's head), fed before the next step's."""
        self.held = 0
        """Tokens the cache has read and keeps (a state-space model's cache has no keys to count them by)."""
        self.shared: list[int] | None = None
        """A head of the prompt that an earlier text began with too, longer than what seeded it: the prefill reads
        it alone first and keeps a copy of the cache after it (`snapshot`)."""
        self.snapshot: tuple[list[int], DynamicCache] | None = None

    def begin(self, max_len: int) -> str | None:
        self.cache = roomy_cache(self.model.config)
        self.copies, self.pending, self.held, self.shared, self.snapshot = None, [], 0, None, None
        self.recorded = False
        return chain_cache_reason(self.cache, max_len, type(self.model).__name__)

    def seed(self, prefixes: Prefixes | None, tokens: list[int]) -> int:
        """Start from a copy of a stored cache whose whole text heads `tokens` (a conversation's earlier turn); mark
        a longer head `tokens` shares with a stored text (a system prompt) to be read alone and kept."""
        if prefixes is None:
            return 0
        seeded, self.held = prefixes.whole_copy(tokens)
        self.cache = self.cache if seeded is None else seeded
        head = prefixes.states_head(tokens)
        if head >= self.held + MIN_REUSE:
            self.shared = tokens[:head]
        return self.held

    def forward(self, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        if not is_chain(tree):
            raise ValueError(f"a model with recurrent states verifies chains only; got a tree of {len(tree)} nodes")
        self.fed, self.pending = [*self.pending, *lead, *tree.tokens], []
        self.start = prefix_len + len(tree) - len(self.fed)
        if self.shared is not None:
            self.read_shared_head()
        self.recorded, self.copies = before_guesses(self.cache, len(tree), self.records)
        device = next(self.model.parameters()).device
        logits = self.head(
            len(tree),
            input_ids=torch.tensor([self.fed], device=device),
            position_ids=torch.arange(self.start, prefix_len + len(tree), device=device)[None],
            cache=self.cache,
            use_cache=True,
        )[0, -len(tree) :]
        return TreeLogits(logits, device_argmax(logits))

    def read_shared_head(self) -> None:
        """Feed the tokens of the shared head that the prefill's are the first of, alone (only the last position's
        logits computed), and keep a copy of the cache after them; the forward then feeds the rest."""
        head, self.shared = self.shared, None
        count = len(head) - self.start
        if not 0 < count < len(self.fed):
            return
        device = next(self.model.parameters()).device
        self.head(
            1,
            input_ids=torch.tensor([self.fed[:count]], device=device),
            position_ids=torch.arange(self.start, len(head), device=device)[None],
            cache=self.cache,
            use_cache=True,
        )
        self.snapshot = (head, copy.deepcopy(self.cache))
        self.fed, self.start = self.fed[count:], len(head)

    def commit(self, prefix_len: int, kept_nodes: list[int]) -> int:
        """Keep the root and the accepted guesses (`kept_nodes`: [0, 1, .., j], a chain's head); returns how many
        tokens wait to be fed again with the next step's (0: the chain was accepted whole, or none was fed)."""
        kept = prefix_len - self.start + len(kept_nodes)  # tokens of this forward that stay
        if self.recorded:
            cut_back(self.cache, len(self.fed) - kept, prefix_len + len(kept_nodes))
            self.recorded, self.held = False, prefix_len + len(kept_nodes)
            return 0
        if self.copies is None or kept == len(self.fed):
            keep_everything(self.cache, prefix_len + len(kept_nodes))
            self.held = prefix_len + len(kept_nodes)
            return 0
        put_back(self.cache, self.copies, self.start)
        self.copies, self.pending, self.held = None, self.fed[:kept], self.start
        return kept

    def store(self, prefixes: Prefixes | None, tokens: list[int], length: int) -> None:
        """Leave a copy of the cache, states included, for prompts that begin with all the text it read (of the
        `length` tokens committed, those not waiting to be fed again). Not where the cache read past `tokens` (a
        last chain accepted beyond the answer's end): its states hold tokens the text does not."""
        held = length - len(self.pending)
        if prefixes is not None and self.snapshot is not None:
            prefixes.keep_whole(*self.snapshot, shared=True)  # first: the whole text kept next would drop it
        self.snapshot = None
        if prefixes is not None and prefixes.max_tokens and held == self.held <= len(tokens):
            prefixes.keep_whole(tokens[:held], copy.deepcopy(self.cache))


def chain_support(model: torch.nn.Module, records: bool = False) -> str | None:
    """None where `model` (with recurrent states) verifies chains exactly on a `ChainBase`, else why not: its cache
    holds something that cannot be copied or cut, or a chain's logits there differ from the model's own forward over
    the same tokens (beyond `feed_probe.allowed_share`; a state-space model whose multi-token forward is another
    computation than its one-token step). The probe, over 12 tokens: a prefill of 5, a chain of 4 with its last
    guess rejected (the states put back, or cut back where `records`), a chain of 2 after the 3 accepted (fed again
    where put back), accepted whole, and a chain of 2 after it, each against one plain forward over the text."""
    from forerun.feed_probe import allowed_share, own_logits, probe_ids, share_of_spread  # noqa: PLC0415 - where it runs

    name = type(model).__name__
    ids = probe_ids(model)
    ids = [*ids, *ids[:2]]
    base = ChainBase(model, records)
    if (reason := base.begin(len(ids))) is not None:
        return reason
    try:
        with torch.inference_mode():
            base.forward(TokenTree.rooted_at(ids[4]), 4, ids[:4])
            base.commit(4, [0])
            first = base.forward(chain_of([*ids[5:8], ids[9]]), 5, ()).logits[:3]
            base.commit(5, [0, 1, 2])
            second = base.forward(chain_of(ids[8:10]), 8, ()).logits
            base.commit(8, [0, 1])
            third = base.forward(chain_of(ids[10:12]), 10, ()).logits
            want = own_logits(model, ids)
    except Exception as error:  # noqa: BLE001 - any failure means: not this way
        return f"{name} failed a chain forward ({type(error).__name__}: {error})"
    share = max(share_of_spread(got, want[at : at + len(got)]) for got, at in ((first, 5), (second, 8), (third, 10)))
    allowed = allowed_share(model, states=True)
    if share > allowed:
        return (
            f"{name} gives a chain of guesses after its states other logits than one forward over the same text "
            f"({share:.2g} of their spread): one token per forward"
        )
    return None


def crops_states(model: torch.nn.Module) -> bool:
    """Whether `model`'s chains cut their states back (`croppable`: convolution windows only) rather than copy and
    put them back and feed the accepted tokens again; read off a 2-token prefill (the layers are set up by it)."""
    from forerun.feed_probe import probe_ids  # noqa: PLC0415 - as in chain_support

    ids = probe_ids(model)[:3]
    base = ChainBase(model)
    if base.begin(len(ids)) is not None:
        return False
    with torch.inference_mode():
        base.forward(TokenTree.rooted_at(ids[2]), 2, ids[:2])
    return croppable(base.cache)


def records_states(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward over several tokens, its cache recording (`activate_past_recording`), writes the
    recurrent state after each of the last tokens asked for (transformers 5.25 does for the families its assisted
    generation serves), so that `crop` can put back the state after any of them; read off a 3-token step after a
    2-token prefill. False for a model without recurrent states (LFM2's windows: `croppable`)."""
    from forerun.feed_probe import probe_ids  # noqa: PLC0415 - as in chain_support

    ids = probe_ids(model)[:5]
    cache = roomy_cache(model.config)
    if chain_cache_reason(cache, len(ids), type(model).__name__) is not None:
        return False
    device, head = next(model.parameters()).device, LogitsHead(model)
    try:
        with torch.inference_mode():
            for start, end in ((0, 2), (2, 5)):
                for layer in state_layers(cache) if start else ():  # the prefill set them up
                    layer.activate_past_recording(recurrent_states_to_keep=end - start)
                fed = {"input_ids": torch.tensor([ids[start:end]], device=device), "cache": cache, "use_cache": True}
                head(1, position_ids=torch.arange(start, end, device=device)[None], **fed)
    except Exception:  # noqa: BLE001 - any failure means: not this way
        return False
    return recorded(cache, 3)


def reads_on(model: torch.nn.Module) -> bool:
    """Whether `model` (with recurrent states), fed several tokens after its cache, gives the logits of one forward
    over the whole text: a prompt then reads on from a stored cache (the prefix cache), in chunks (a server's
    prefill, a scored prompt) or after a chain's head. Not where its scan over several tokens starts from no state
    (transformers' Jamba, Zamba, Mamba, Falcon-Mamba and RecurrentGemma lose what they had read: 3e-4 to 0.7 of the
    logits' spread, measured on tiny models); their prompts are then read whole. A prefill of 5 probe tokens, then 5
    more, against one forward over the 10 (beyond `feed_probe.allowed_share`)."""
    from forerun.feed_probe import allowed_share, own_logits, probe_ids, share_of_spread  # noqa: PLC0415 - as above

    ids = probe_ids(model)[:10]
    cache = roomy_cache(model.config)
    device, head = next(model.parameters()).device, LogitsHead(model)
    try:
        with torch.inference_mode():
            for start, end in ((0, 5), (5, 10)):
                fed = {"input_ids": torch.tensor([ids[start:end]], device=device), "cache": cache, "use_cache": True}
                got = head(5, position_ids=torch.arange(start, end, device=device)[None], **fed)[0]
            want = own_logits(model, ids)[5:]
    except Exception:  # noqa: BLE001 - any failure means: not this way
        return False
    return share_of_spread(got, want) <= allowed_share(model, states=True)


def chain_of(tokens: Sequence[int]) -> TokenTree:
    """The tree of `tokens[0]` and the rest as one line of candidates."""
    tree = TokenTree.rooted_at(tokens[0])
    tree.add_chain(0, list(tokens[1:]))
    return tree
