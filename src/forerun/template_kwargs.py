"""A request's own variables for the chat template (`chat_template_kwargs`, as vLLM, SGLang and llama.cpp take
them): Qwen3's `enable_thinking`, say, which turns its thought off. Only variables the template itself reads are
taken, so none can stand in for what `apply_chat_template` sets (the template, the messages, the tools, the special
tokens) and a misspelt one is a clear error, not silently ignored.

Example:
    >>> names = template_variables(tokenizer)                         # doctest: +SKIP
    >>> sorted(names)                                                  # Qwen3's template  # doctest: +SKIP
    ['enable_thinking']
    >>> checked_template_kwargs({"enable_thinking": False}, names)     # doctest: +SKIP
    {'enable_thinking': False}
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Collection, Mapping

from forerun.checks import MAX_DEPTH, check_text, nesting
from forerun.tool_specs import templates

FIELD = "chat_template_kwargs"
SET_BY_TRANSFORMERS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception",
                                 "strftime_now", "self", "bos_token", "eos_token", "unk_token", "sep_token",
                                 "pad_token", "cls_token", "mask_token", "additional_special_tokens"})  # fmt: skip
"""What `apply_chat_template` gives the template itself (besides its own parameters and the tokenizer's special
tokens): a request setting a special token's text would write that text where the template means the token."""
MAX_CHARACTERS = 65_536
"""The characters a request's template variables may hold, written as JSON."""


def template_variables(tokenizer: object) -> frozenset[str]:
    """The variables the tokenizer's chat templates read that a request may set: every name they use without
    setting it, less what `apply_chat_template` sets (its parameters, the special tokens). A template jinja2
    cannot parse gives none."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    environment = Environment(extensions=["jinja2.ext.loopcontrols"])
    names: set[str] = set()
    for text in templates(tokenizer):
        try:
            names |= meta.find_undeclared_variables(environment.parse(text))
        except TemplateSyntaxError:  # e.g. a training template's {% generation %} tag
            continue
    method = getattr(type(tokenizer), "apply_chat_template", None)
    own = set(inspect.signature(method).parameters) if method is not None else set()
    specials = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset(names - own - specials - SET_BY_TRANSFORMERS)


def checked_template_kwargs(kwargs: object, variables: Collection[str]) -> dict:
    """`kwargs` (a mapping of names to JSON values) if every name is one of the template's `variables`; otherwise
    a ValueError naming the field and the name."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{FIELD} must be an object of the chat template's variables, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str) or name not in variables:
            offered = ", ".join(sorted(variables)) or "none"
            raise ValueError(f"{FIELD}: {name!r:.60} is not a variable this model's chat template reads "
                             f"(it reads: {offered:.400})")  # fmt: skip
    if nesting(dict(kwargs)) > MAX_DEPTH:
        raise ValueError(f"{FIELD} nests more than {MAX_DEPTH} levels")
    try:
        written = json.dumps(dict(kwargs), ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{FIELD} must hold JSON values: {error}") from None
    if len(written) > MAX_CHARACTERS:
        raise ValueError(f"{FIELD} holds {len(written)} characters as JSON, more than {MAX_CHARACTERS}")
    check_text(FIELD, written)
    return dict(kwargs)
