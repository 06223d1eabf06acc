"""A completions request's `prompt` in each of OpenAI's four forms: a string, a list of strings, a list of token
ids, a list of lists of token ids. Several prompts are several groups of `n` choices (prompt i's choice j is
choice i * n + j); token ids are used as they are (no tokenizer, no BOS added), which is what evaluation harnesses
send to score exactly the tokens they counted.

Example:
    >>> prompts_of("Hi", 100), prompts_of([[1, 2], [3]], 100), prompts_of(["a", "b"], 100)
    (['Hi'], [[1, 2], [3]], ['a', 'b'])
    >>> prompts_of([1, 200], 100)
    Traceback (most recent call last):
    ...
    forerun.server.fields.APIError: prompt[1] is token id 200, outside the vocabulary [0, 100)
"""

from __future__ import annotations

from typing import Any

from forerun.server.fields import checked, refuse

MAX_PROMPTS = 64
"""Prompts one completions request may send (each takes its own places in the queue, `n` of them if sampled)."""
FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"

Prompt = str | list[int]


def prompts_of(prompt: str | list[Any], vocab_size: int | None) -> list[Prompt]:
    """The request's prompts, each checked: strings non-empty and free of lone surrogates, token ids integers in
    [0, vocab_size) (unchecked where the vocabulary is unknown: the decoder refuses them then)."""
    if isinstance(prompt, str):
        return [text_prompt("prompt", prompt)]
    if not prompt:
        raise refuse("prompt", "prompt is empty")
    if all(is_id(value) for value in prompt):
        return [ids_prompt("prompt", prompt, vocab_size)]
    if len(prompt) > MAX_PROMPTS:
        raise refuse("prompt", f"prompt lists at most {MAX_PROMPTS} prompts, got {len(prompt)}")
    if all(isinstance(value, str) for value in prompt):
        return [text_prompt(f"prompt[{i}]", text) for i, text in enumerate(prompt)]
    if all(isinstance(value, list) for value in prompt):
        return [ids_prompt(f"prompt[{i}]", ids, vocab_size) for i, ids in enumerate(prompt)]
    raise refuse("prompt", f"prompt must be {FORMS} (one form for all)")


def is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text_prompt(name: str, text: str) -> str:
    if not text.strip():
        raise refuse(name, f"{name} is empty")
    return checked(name, text)


def ids_prompt(name: str, ids: list[Any], vocab_size: int | None) -> list[int]:
    if not ids:
        raise refuse(name, f"{name} is empty")
    for i, value in enumerate(ids):
        if not is_id(value):
            raise refuse(name, f"{name} must be {FORMS}: item {i} is {type(value).__name__}, not a token id")
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            bound = "" if vocab_size is None else f", outside the vocabulary [0, {vocab_size})"
            raise refuse(name, f"{name}[{i}] is token id {value}{bound}" if bound else f"{name}[{i}] is negative")
    return list(ids)
