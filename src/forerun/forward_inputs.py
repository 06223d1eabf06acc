"""What a model's forward takes and keeps, read from its class: a cache forerun can feed, position ids, a recurrent
state.

forerun feeds every step after a transformers cache it passes as the forward's cache argument (`cache` from
transformers 5.24 on, `past_key_values` before: `cache_argument`), each token at the position it gives in
`position_ids`, and rolls the cache back to the accepted guesses. A model outside that contract either cannot be
decoded at all (a state of its own: RWKV's `state`; Mamba's `cache_params` before transformers 5.24), or verifies
a chain, not a tree (recurrent states that a rejected guess cannot be taken out of: Qwen3.5, Qwen3-Next, Granite 4,
`forerun.base.chain`), or one token per forward (positions taken from the cache length: TrOCR's decoder).

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                      num_attention_heads=2, vocab_size=32))
    >>> check_cache_input(model), cache_argument(model) in ("cache", "past_key_values"), stateful(model)
    (None, True, False)
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Mapping

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, LinearAttentionCacheLayerMixin

OWN_STATE = ("cache_params", "state", "cache")
"""Forward arguments in which models keep a state of their own instead of a transformers cache (`cache` where it
is not annotated as one: XLM's dict)."""
CACHE_NAME = re.compile(r"(?<![\w.])(transformers\.cache_utils\.)?(Dynamic|Static)?Cache\b")
"""A transformers cache's name in an annotation written as a string (a module with postponed annotations)."""


def forward_signature(model: torch.nn.Module) -> Mapping[str, inspect.Parameter]:
    """The parameters of the forward of `model` (of the model a PEFT wrapper or `torch.compile` holds); none where
    its signature cannot be read."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(inner, "_orig_mod", inner)
    try:
        return inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return {}


def forward_parameters(model: torch.nn.Module) -> set[str] | None:
    """The named arguments of the forward of `model` (`forward_signature`), or None where it names none (a wrapper
    taking `*args, **kwargs`: nothing can be told)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = {parameter.name for parameter in forward_signature(model).values() if parameter.kind not in variadic}
    return named or None


def cache_argument(model: torch.nn.Module) -> str | None:
    """The name under which the forward of `model` takes a transformers cache: `cache` (transformers 5.24 renamed
    it), `past_key_values` (earlier versions, and models of the hub's own code), or None where it takes none.
    A forward that names no arguments (a wrapper's `**kwargs`) is given `past_key_values`, which transformers'
    models take under either name."""
    parameters = forward_signature(model)
    if "past_key_values" in parameters:
        return "past_key_values"
    cache = parameters.get("cache")
    if cache is not None and annotated_cache(cache.annotation):
        return "cache"
    return "past_key_values" if forward_parameters(model) is None else None


def annotated_cache(annotation: object) -> bool:
    """Whether a `cache` argument so annotated takes a transformers `Cache` (`Cache | None`), not a state of the
    model's own under that name (xLSTM's `xLSTMCache`, XLM's dict)."""
    if isinstance(annotation, str):
        return CACHE_NAME.search(annotation) is not None
    kinds = typing.get_args(annotation) or (annotation,)
    return any(isinstance(kind, type) and issubclass(kind, Cache) for kind in kinds)


def check_cache_input(model: torch.nn.Module) -> None:
    """Raise ValueError naming the model when its forward takes no transformers cache (forerun could not give it
    the text before each step's tokens: it would decode other text)."""
    named = forward_parameters(model)
    if named is None or cache_argument(model) is not None:
        return None
    own = next((name for name in OWN_STATE if name in named), None)
    kept = f" (it keeps a state of its own in `{own}`)" if own else ""
    raise ValueError(
        f"{type(model).__name__}.forward takes no transformers cache{kept}: forerun feeds each step after a "
        "cache it passes there, so it cannot decode this model (plain model.generate can)"
    )


def stateful(model: torch.nn.Module) -> bool:
    """Whether `model` keeps recurrent or convolution states (state-space, linear-attention or short-convolution
    layers) besides or instead of per-token keys and values: such a layer in the cache its config lays out (a
    hybrid's linear-attention or convolution layers), or the model's own `_is_stateful` flag (transformers set it
    before 5.25; a hub model's own code may still)."""
    if getattr(model, "_is_stateful", False):
        return True
    # the config's layer types, read as transformers' DynamicCache maps them to layer classes (building that
    # cache to look took ~0.5 ms, and this is asked at every request)
    config = model.config.get_text_config(decoder=True)
    kinds = getattr(config, "layer_types", None) or ()
    classes = (DYNAMIC_LAYER_TYPE_MAPPING.get(kind, object) for kind in kinds)
    return any(issubclass(layer, LinearAttentionCacheLayerMixin) for layer in classes)


def positional_support(model: torch.nn.Module) -> str | None:
    """None if a tree's nodes can be told their positions, else why not: a model whose forward takes no
    `position_ids` counts positions from its cache's length, where a tree's nodes sit side by side at other
    depths (TrOCR's decoder)."""
    named = forward_parameters(model)
    if named is None or "position_ids" in named:
        return None
    return (
        f"{type(model).__name__}.forward takes no position_ids: it counts positions from its cache's length, and "
        "a tree's nodes sit side by side at other depths"
    )
