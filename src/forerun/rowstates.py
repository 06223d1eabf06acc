"""A batch's recurrent and convolution states: the per-row half of a hybrid's shared cache (`forerun.rowcache`).

A hybrid (Qwen3.5, Granite 4, Nemotron-H, Jamba, ...) keeps, beside each attention layer's keys and values, states
that a forward advances through every token it is fed: `[rows, ...]` tensors with no slot axis. In a batch they
need none of the slot bookkeeping the keys need (padding, holes, compaction): a row's states are its row of each
tensor. A joining row's own cache is appended (or written into a vacant place), a leaving row's row is dropped,
and a row's own states are sliced out for the prefix cache. A batch of such rows feeds one token per row a step:
a rejected guess cannot be taken out of a state, and the rows' chains would have to be put back row by row (a row
alone in its batch verifies chains: `forerun.base.lone_chain`).

    layer with states, 3 rows          conv_states[0] [3, channels, kernel]   recurrent_states[0] [3, heads, dk, dv]
    row 1 leaves, a row joins there    conv_states[0][1] = the new row's      recurrent_states[0][1] = the new row's

Example:
    >>> append_states(batch_layer, joining_layer)           # one more row          # doctest: +SKIP
    >>> write_states(batch_layer, joining_layer, place=1)   # into a vacant place  # doctest: +SKIP
    >>> one = row_cache(batch.cache, row=0, slots=visible)  # a row's own cache    # doctest: +SKIP
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

STATES = ("conv_states", "recurrent_states")
"""The per-row tensors of a layer with states, each a dict by state index (a layer may hold several)."""

FLAGS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size")
"""A layer's per-state-index flags: a batch layer takes them from the first row that joins (every row has read
its prompt: the same flags)."""


def has_states(layer: object) -> bool:
    """Whether a cache layer holds recurrent or convolution states."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def append_states(mine: LinearAttentionCacheLayerMixin, theirs: LinearAttentionCacheLayerMixin) -> None:
    """`theirs`' states (a joining row's own cache layer, [1, ...]) after `mine`'s rows ([rows, ...] -> [rows + 1,
    ...]); `mine` takes its flags where it held no row yet."""
    for name in STATES:
        held, new = getattr(mine, name), getattr(theirs, name)
        for index, tensor in new.items():
            if tensor is not None:
                held[index] = tensor if held.get(index) is None else torch.cat([held[index], tensor], dim=0)
    take_flags(mine, theirs)


def write_states(mine: LinearAttentionCacheLayerMixin, theirs: LinearAttentionCacheLayerMixin, place: int) -> None:
    """`theirs`' states ([1, ...]) written into row `place` of `mine`'s, in place (a vacant row's)."""
    for name in STATES:
        held = getattr(mine, name)
        for index, tensor in getattr(theirs, name).items():
            if tensor is not None:
                held[index][place] = tensor[0]


def take_flags(mine: LinearAttentionCacheLayerMixin, theirs: LinearAttentionCacheLayerMixin) -> None:
    """`theirs`' flags and device where `mine` has none yet (an empty batch's layer)."""
    if mine.device is None:
        mine.device, mine.dtype = theirs.device, theirs.dtype
    for name in FLAGS:
        held = getattr(mine, name)
        for index, value in getattr(theirs, name).items():
            if not held.get(index):
                held[index] = value


def keep_state_rows(layer: LinearAttentionCacheLayerMixin, rows: torch.Tensor) -> None:
    """Keep only `rows` (indices [n], in order) of the layer's states."""
    for name in STATES:
        held = getattr(layer, name)
        for index, tensor in held.items():
            if tensor is not None:
                held[index] = tensor.index_select(0, rows.to(tensor.device))


def row_cache(cache: DynamicCache, row: int, slots: torch.Tensor) -> DynamicCache:
    """Row `row` of a batch's hybrid cache as a one-row cache of the same layer kinds: each attention layer's keys
    and values at `slots` (that row's visible ones, in order: [1, heads, len(slots), dim]), each state its row
    ([1, ...]); copies, which the batch's next forwards do not touch (the prefix cache keeps it as it is)."""
    single = copy.copy(cache)
    single.layers = [one_row(layer, row, slots) for layer in cache.layers]
    return single


def one_row(layer: object, row: int, slots: torch.Tensor) -> object:
    """A copy of cache layer `layer` holding row `row` alone (`row_cache`)."""
    mine = copy.copy(layer)
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:
        at = slots.to(keys.device)
        mine.keys, mine.values = keys[row : row + 1, :, at], layer.values[row : row + 1, :, at]  # gathered: copies
        if hasattr(mine, "buffers"):
            mine.buffers = [None, None]  # a roomy layer's next update re-buffers instead of writing into the batch's
    if has_states(layer):
        for name in STATES:
            held = getattr(layer, name).items()
            setattr(mine, name, {i: None if t is None else t[row : row + 1].clone() for i, t in held})
        for name in FLAGS:
            setattr(mine, name, dict(getattr(layer, name)))
    return mine


def state_rows_support(model: torch.nn.Module) -> str | None:
    """None where a batch of `model`'s rows (a model with recurrent states) gives each row the logits of its own
    forward, else why not. The probe, as a batch runs: three prompts of 6, 10 and 8 tokens prefilled alone and
    spliced in (attention layers left-padded, states appended), one step of every row; the second row leaves, a
    fourth joins into its place, and a second step; each row's logits against one plain forward over its text
    (beyond `feed_probe.allowed_share`: a layer that reads a 4-D mask its own way, a state kept outside the cache)."""
    from forerun.base.rows import DynamicRows  # noqa: PLC0415 - the probe's parts, only where it runs
    from forerun.feed_probe import allowed_share, own_logits, probe_ids, share_of_spread  # noqa: PLC0415
    from forerun.tree import TokenTree  # noqa: PLC0415

    ids = probe_ids(model)
    texts = [ids[:6], ids[2:], ids[1:9], ids[3:8]]
    rows, shares = DynamicRows(model), []

    def join(text: list[int]) -> None:
        own, _ = rows.open(None, text, len(text) + 4)
        rows.feed(own, TokenTree.rooted_at(text[-1]), len(text) - 1, text[:-1])
        rows.admit(own, len(text) - 1, [0], None, text)

    def step(held: list[list[int]], token: int) -> None:
        rows.settle()
        out = rows.forward([len(text) for text in held], [TokenTree.rooted_at(token)] * len(held), nodes=1)
        rows.keep([len(text) for text in held], [[0]] * len(held), 1)
        for b, text in enumerate(held):
            text.append(token)
            shares.append(share_of_spread(out.row(b, 1), own_logits(model, text)[-1:]))

    try:
        with torch.inference_mode():
            for text in texts[:3]:
                join(text)
            step(texts[:3], ids[9])
            rows.remove([(1, None, texts[1], len(texts[1]))])
            join(texts[3])
            step([texts[0], texts[3], texts[2]], ids[0])
    except Exception as error:  # noqa: BLE001 - any failure means: not this way
        return f"{type(model).__name__} failed a batch's forward ({type(error).__name__}: {error})"
    allowed = allowed_share(model, states=True)
    if max(shares) > allowed:
        share = max(shares)
        return f"{type(model).__name__} gives a batch's rows other logits than their own ({share:.2g} of their spread)"
    return None
