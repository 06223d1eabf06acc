"""A batch's recurrent and convolution states: the per-row half of a hybrid's shared cache (`forerun.rowcache`).

A hybrid (Qwen3.5, Granite 4, Nemotron-H, Jamba, ...) keeps, beside each attention layer's keys and values, states
that a forward advances through every token it is fed: `[rows, ...]` tensors with no slot axis. In a batch they
need none of the slot bookkeeping the keys need (padding, holes, compaction): a row's states are its row of each
tensor. A joining row's own cache is appended (or written into a vacant place), a leaving row's row is dropped,
and a row's own states are sliced out for the prefix cache. A rejected guess cannot be taken out of a state: the
rows' chains are fed side by side with the states recorded through the step (LFM2's convolution windows, and the
recurrent state after each token where the model's forward writes it: `forerun.base.chain.records_states`), then
each row's are cut back to its own last kept token (`cut_states`). Where the states cannot be recorded, rows
beside others feed one token each (a row alone in its batch verifies chains: `forerun.base.lone_chain`).

    layer with states, 3 rows          conv_states[0] [3, channels, kernel]   recurrent_states[0] [3, heads, dk, dv]
    row 1 leaves, a row joins there    conv_states[0][1] = the new row's      recurrent_states[0][1] = the new row's

Example:
    >>> append_states(batch_layer, joining_layer)           # one more row          # doctest: +SKIP
    >>> write_states(batch_layer, joining_layer, place=1)   # into a vacant place  # doctest: +SKIP
    >>> one = row_cache(batch.cache, row=0, slots=visible)  # a row's own cache    # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

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


def cut_windows(layer: LinearAttentionCacheLayerMixin, rejected: Sequence[int]) -> None:
    """After a forward whose convolution windows were recorded (`activate_past_recording`: each row's window, then
    every token fed, [rows, ..., width + fed]): row b's window ends at its last kept token, its last `rejected[b]`
    fed tokens dropped, back to the kernel's width; recording off. transformers' `crop` cuts every row alike.

    Example (one channel, width 2, three tokens fed after a window [1, 2]; row 0 keeps 1 of them, row 1 all 3):
        >>> from transformers.cache_utils import LinearAttentionLayer
        >>> layer = LinearAttentionLayer(); layer.conv_kernel_size[0] = 2; layer.record_past = True
        >>> layer.conv_states[0] = torch.tensor([[[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]]])
        >>> cut_windows(layer, [2, 0]); layer.conv_states[0].tolist(), layer.record_past
        ([[[2, 3]], [[4, 5]]], False)
    """
    for index, window in layer.conv_states.items():
        if window is None:
            continue
        width = layer.conv_kernel_size[index]
        ends = window.shape[-1] - torch.tensor(rejected, device=window.device)  # [rows]: one past the last kept
        columns = ends[:, None] - width + torch.arange(width, device=window.device)  # [rows, width]
        columns = columns.view(len(rejected), *[1] * (window.dim() - 2), width).expand(*window.shape[:-1], width)
        layer.conv_states[index] = window.gather(-1, columns)
    layer.record_past = False


def cut_states(layer: LinearAttentionCacheLayerMixin, rejected: Sequence[int]) -> None:
    """After a forward whose states were recorded (`activate_past_recording`, each of the fed tokens' recurrent
    state kept: `forerun.base.chain.records_states`): row b's recurrent state becomes the one after its last kept
    token (its last `rejected[b]` fed tokens dropped), its convolution window ends there (`cut_windows`); the
    history dropped, recording off. transformers' `crop` puts every row back alike.

    The history holds the state before the step, then after each fed token but the last (which the state is):
    [before, after 1, .., after n-1], each [rows, ...]; row b takes entry n - rejected[b] of them and the state.

    Example (one state of 2 rows, 3 tokens fed; row 0 keeps 1 of them, row 1 all 3):
        >>> from transformers.cache_utils import LinearAttentionLayer
        >>> layer = LinearAttentionLayer(); layer.is_recurrent_states_initialized[0] = True
        >>> layer.recurrent_states[0] = torch.tensor([[3.0], [13.0]])
        >>> layer.recurrent_states_history = {0: [torch.tensor([[0.0], [10.0]]), torch.tensor([[1.0], [11.0]]),
        ...                                       torch.tensor([[2.0], [12.0]])]}
        >>> cut_states(layer, [2, 0]); layer.recurrent_states[0].tolist(), layer.recurrent_states_history[0]
        ([[1.0], [13.0]], [])
    """
    for index, initialized in layer.is_recurrent_states_initialized.items():
        if not initialized:
            continue
        state, history = layer.recurrent_states[index], layer.recurrent_states_history[index]
        for row, dropped in enumerate(rejected):  # row by row: no [n + 1, rows, ...] copy of the whole history
            if dropped:
                state[row].copy_(history[len(history) - dropped][row])  # in place: the state's address stays
        layer.recurrent_states_history[index] = []
    cut_windows(layer, rejected)


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


def state_rows_support(model: torch.nn.Module, records: bool = False) -> str | None:
    """None where a batch of `model`'s rows (a model with recurrent states) gives each row the logits of its own
    forward, else why not. The probe, as a batch runs: three prompts of 6, 10 and 8 tokens prefilled alone and
    spliced in (attention layers left-padded, states appended), one step of every row; the second row leaves, a
    fourth joins into its place, and a second step; where the rows feed chains together (`chains_together`), a
    step of chains of 3, 1 and 2 tokens of which 2, 1 and 2 are kept, and a step after it; each row's logits
    against one plain forward over its text (beyond `feed_probe.allowed_share`: a layer that reads a 4-D mask its
    own way, a state kept outside the cache, a window cut back to another token)."""
    from forerun.base.chain import chain_of  # noqa: PLC0415 - the probe's parts, only where it runs
    from forerun.base.rows import DynamicRows  # noqa: PLC0415
    from forerun.feed_probe import allowed_share, own_logits, probe_ids, share_of_spread  # noqa: PLC0415
    from forerun.tree import TokenTree  # noqa: PLC0415

    ids = probe_ids(model)
    texts = [ids[:6], ids[2:], ids[1:9], ids[3:8]]
    rows, shares = DynamicRows(model, records), []

    def join(text: list[int]) -> None:
        own, _ = rows.open(None, text, len(text) + 4)
        rows.feed(own, TokenTree.rooted_at(text[-1]), len(text) - 1, text[:-1])
        rows.admit(own, len(text) - 1, [0], None, text)

    def step(held: list[list[int]], token: int, chains: Sequence[Sequence[int]] = (), kept: Sequence[int] = ()) -> None:
        rows.settle()
        fed = [[token, *chain] for chain in chains] or [[token]] * len(held)
        nodes, lengths = max(map(len, fed)), [len(text) for text in held]
        out = rows.forward(lengths, [chain_of(tokens) for tokens in fed], nodes)
        paths = [list(range(k)) for k in kept] or [[0]] * len(held)
        rows.keep(lengths, paths, nodes)
        for b, (text, tokens) in enumerate(zip(held, fed, strict=True)):
            n = len(tokens)
            shares.append(share_of_spread(out.row(b, n), own_logits(model, [*text, *tokens])[-n:]))
            text.extend(tokens[: len(paths[b])])

    try:
        with torch.inference_mode():
            for text in texts[:3]:
                join(text)
            step(texts[:3], ids[9])
            rows.remove([(1, None, texts[1], len(texts[1]))])
            join(texts[3])
            step([texts[0], texts[3], texts[2]], ids[0])
            if rows.chains_together:
                step([texts[0], texts[3], texts[2]], ids[1], [ids[2:4], [], ids[4:5]], kept=[2, 1, 2])
                step([texts[0], texts[3], texts[2]], ids[5])
    except Exception as error:  # noqa: BLE001 - any failure means: not this way
        return f"{type(model).__name__} failed a batch's forward ({type(error).__name__}: {error})"
    allowed = allowed_share(model, states=True)
    if max(shares) > allowed:
        share = max(shares)
        return f"{type(model).__name__} gives a batch's rows other logits than their own ({share:.2g} of their spread)"
    return None
