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
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


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
        elif type(layer) is not DynamicLayer:
            raise UnsupportedCacheError(
                f"{model_name}: cache layer {index} is {type(layer).__name__}, which cannot keep a "
                "non-contiguous accepted path"
            )


def keep_accepted(cache: DynamicCache, prefix_len: int, kept_nodes: list[int]) -> None:
    """Keep cache entries [0, prefix_len) plus tree nodes `kept_nodes` (in order); drop everything else.

    Shapes: each layer's keys/values are [batch, kv_heads, seq, head_dim]; seq goes from prefix_len + n_nodes
    to prefix_len + len(kept_nodes).
    """
    new_len = prefix_len + len(kept_nodes)
    contiguous = kept_nodes == list(range(len(kept_nodes)))
    index = None if contiguous else torch.tensor(kept_nodes, dtype=torch.long) + prefix_len
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        keys, values = layer.keys, layer.values
        if index is not None:
            index = index.to(keys.device)
            # Gather first (index_select copies), then overwrite: sources and targets may overlap.
            keys[..., prefix_len:new_len, :] = keys.index_select(-2, index)
            values[..., prefix_len:new_len, :] = values.index_select(-2, index)
        layer.keys = keys[..., :new_len, :]
        layer.values = values[..., :new_len, :]
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = new_len
