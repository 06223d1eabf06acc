"""Keep only the accepted path of a verified tree in a transformers KV cache.

After a tree forward the cache holds [prefix | all tree nodes]. The accepted path (root, then accepted candidates)
need not be contiguous among the nodes (a second branch may win), so its entries are gathered to the front of the
tree region, then the cache is truncated:

    before: [p0 .. p{L-1} | n0 n1 n2 n3 n4]     kept nodes [0, 3, 4]
    after:  [p0 .. p{L-1} | n0 n3 n4]

Only per-token-addressable caches can do this: `DynamicCache` with full-attention layers, and sliding-window
layers while the text stays shorter than the window (then they hold every token). Anything else (static, quantized,
linear-attention or recurrent state) raises `UnsupportedCacheError`, and the caller falls back to plain decoding.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from forerun.attention import SDPA_FP32


class UnsupportedCacheError(ValueError):
    """The model's cache cannot drop rejected tree nodes, so tree decoding would give wrong text."""


def check_tree_cache(cache: object, max_len: int, model_name: str) -> None:
    """Raise UnsupportedCacheError unless `cache` can hold `max_len` tokens and keep any accepted path."""
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"{model_name}: cache type {type(cache).__name__} cannot keep a non-contiguous accepted path; "
            "forerun needs a DynamicCache"
        )
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            # Past the window the layer drops old tokens and its mask offsets move: not addressable per token.
            if max_len >= layer.sliding_window - 1:
                raise UnsupportedCacheError(
                    f"{model_name}: layer {index} has a sliding window of {layer.sliding_window} tokens, shorter "
                    f"than prompt + new tokens + tree ({max_len}); tree decoding would drop context"
                )
        elif type(layer) not in FULL_LAYERS:
            raise UnsupportedCacheError(
                f"{model_name}: cache layer {index} is {type(layer).__name__}, which cannot keep a "
                "non-contiguous accepted path"
            )


def plain_layers(cache: object) -> bool:
    """Whether every layer of `cache` is a plain full-attention layer, `DynamicLayer` or `RoomyLayer` (a per-token
    prefix of the text; a DynamicCache made without a config adds such layers as it goes)."""
    if not isinstance(cache, DynamicCache):
        return False
    if not cache.layers:
        return getattr(cache, "layer_class_to_replicate", None) in FULL_LAYERS
    return all(type(layer) in FULL_LAYERS for layer in cache.layers)


def keep_accepted(cache: DynamicCache, prefix_len: int, kept_nodes: list[int]) -> None:
    """Keep cache entries [0, prefix_len) plus tree nodes `kept_nodes` (in order); drop everything else.

    Shapes: each layer's keys/values are [batch, kv_heads, seq, head_dim]; seq goes from prefix_len + n_nodes
    to prefix_len + len(kept_nodes).
    """
    new_len = prefix_len + len(kept_nodes)
    contiguous = kept_nodes == list(range(len(kept_nodes)))
    index = None if contiguous else torch.tensor(kept_nodes, dtype=torch.long) + prefix_len
    if not all(addressable(layer) for layer in cache.layers):
        keep_everything(cache, new_len)
        return
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        keys, values = layer.keys, layer.values
        if index is not None:
            index = index.to(keys.device)
            # Gather first (index_select copies), then overwrite: sources and targets may overlap.
            keys[..., prefix_len:new_len, :] = keys.index_select(-2, index)
            values[..., prefix_len:new_len, :] = values.index_select(-2, index)
        cut(layer, new_len)


def cut(layer: DynamicLayer, length: int) -> None:
    """Keep a per-token layer's first `length` entries (views: nothing is copied)."""
    layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = length


def addressable(layer: object) -> bool:
    """Whether a cache layer holds one entry per token, which `keep_accepted` can gather and crop (not a recurrent
    or convolution state, not a layer kind of a model's own)."""
    return isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin)


def keep_everything(cache: DynamicCache, new_len: int) -> None:
    """Commit a step that drops nothing on a cache with layers that cannot drop entries (a recurrent state has
    advanced through every token fed): plain decoding's one token, or a chain accepted whole. Raises
    UnsupportedCacheError where the step fed more than it keeps (the caller decoded trees it cannot verify)."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.get_seq_length() != new_len:
            raise UnsupportedCacheError(
                f"cache layer {index} ({type(layer).__name__}) cannot drop the rejected tokens of a step"
            )


ROOM = 64
"""Slots a `RoomyLayer` adds beyond what it holds when it must grow (at least; a quarter of its length if more)."""


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of buffers with spare slots: a forward's new entries are written
    in place, where `DynamicLayer` concatenates (copies) the whole layer every forward: a batch's step no longer
    copies every row's cache (a few percent of a step at 8 rows; one row: unchanged).

    Whoever replaces `keys`/`values` (cropping to a view, gathering, compacting) may; the next `update` writes in
    place when the tensors it finds are still the leading slots of its buffers, and re-buffers (one copy) otherwise.

    Example:
        >>> layer = RoomyLayer()
        >>> keys, _ = layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
        >>> keys.shape, layer.buffers[0].shape[2]        # 3 slots used, 67 allocated
        (torch.Size([1, 2, 3, 4]), 67)
        >>> keys, _ = layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
        >>> keys.shape[2], keys.data_ptr() == layer.buffers[0].data_ptr()   # written in place
        (4, True)

    `upcast=True` (a half-precision model whose attention computes in fp32 on the CPU, `attention.SDPA_FP32`):
    half-precision entries are kept in fp32, cast once as they are written, where the attention would cast the
    whole layer up again every forward. The same numbers (a bf16 or fp16 value is exact in fp32), twice the memory:
        >>> layer = RoomyLayer(upcast=True)
        >>> keys, _ = layer.update(torch.ones(1, 2, 3, 4, dtype=torch.bfloat16), torch.ones(1, 2, 3, 4))
        >>> keys.dtype, layer.written
        (torch.float32, torch.bfloat16)
    """

    def __init__(self, upcast: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.upcast = upcast

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.written = key_states.dtype
        """The dtype the model writes (the entries' own precision: a prefix cache keeps them in it)."""

    def appended(self, which: int, current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """`current` [rows, heads, length, dim] followed by `new` [rows, heads, n, dim], as a view of a buffer."""
        buffer = self.buffers[which]
        length = current.shape[-2] if current.dim() == 4 else 0
        total = length + new.shape[-2]
        in_place = (
            buffer is not None
            and length > 0
            and current.data_ptr() == buffer.data_ptr()
            and current.shape[:2] == buffer.shape[:2]
            and current.stride() == buffer.stride()
            and total <= buffer.shape[-2]
        )
        if not in_place:
            dtype = torch.float32 if self.upcast and new.dtype in HALF else new.dtype
            buffer = new.new_empty((*new.shape[:2], total + max(ROOM, total // 4), new.shape[-1]), dtype=dtype)
            if length:
                buffer[:, :, :length] = current
            self.buffers[which] = buffer
        buffer[:, :, length:total] = new
        return buffer[:, :, :total]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self.appended(0, self.keys, key_states)
        self.values = self.appended(1, self.values, value_states)
        return self.keys, self.values


FULL_LAYERS = (DynamicLayer, RoomyLayer)
"""The full-attention layer kinds whose entries are a per-token prefix of the text (not sliding-window layers,
which subclass `DynamicLayer` too)."""


HALF = (torch.bfloat16, torch.float16)


def roomy_cache(config) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are `RoomyLayer`s (sliding ones stay as they are),
    keeping half-precision entries in fp32 where the model attends in fp32 (`RoomyLayer`'s `upcast`)."""
    cache = DynamicCache(config=config)
    upcast = getattr(config, "_attn_implementation", None) == SDPA_FP32 and not latent(config)
    cache.layers = [RoomyLayer(upcast) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def latent(config) -> bool:
    """Whether the model caches latents that a layer expands into keys and values after the cache (multi-head latent
    attention, DeepSeek-V3's and GLM-4.7-Flash's `kv_lora_rank`): its entries must stay in the model's dtype."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "kv_lora_rank", None) is not None
