"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix, in the marks its tokenizer
has (Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`, DeepSeek-Coder's `<｜fim▁begin｜>`), the order
each was trained on (prefix, suffix, middle). The answer is the middle, what plain generate writes after that
prompt; an editor's completion often repeats the suffix's and the prefix's text, which prompt lookup drafts.

Example:
    >>> marks = fim_marks(tokenizer)                                                   # doctest: +SKIP
    >>> infill_prompt(marks, "def add(a, b):\\n    return ", "\\n\\nprint(add(1, 2))")  # doctest: +SKIP
    '<|fim_prefix|>def add(a, b):\\n    return <|fim_suffix|>\\n\\nprint(add(1, 2))<|fim_middle|>'
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimMarks:
    """The three marks of a fill-in-the-middle prompt, as text (each one token of the tokenizer's own)."""

    prefix: str
    suffix: str
    middle: str


FORMS = (
    FimMarks("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimMarks("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    FimMarks("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)
"""Qwen2.5-Coder and Qwen3-Coder; StarCoder, StarCoder2 and their kin; DeepSeek-Coder."""


def fim_marks(tokenizer: object) -> FimMarks | None:
    """The tokenizer's fill-in-the-middle marks: the first of `FORMS` whose three marks are all tokens of its own
    (added to its vocabulary, as a model trained to fill in has them), or None.

    Example:
        >>> class Tokenizer:
        ...     def get_added_vocab(self): return {"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3}
        >>> fim_marks(Tokenizer())
        FimMarks(prefix='<fim_prefix>', suffix='<fim_suffix>', middle='<fim_middle>')
    """
    added = getattr(tokenizer, "get_added_vocab", None)
    vocabulary = added() if callable(added) else {}
    return next((form for form in FORMS if all(mark in vocabulary for mark in vars(form).values())), None)


def infill_prompt(marks: FimMarks, prefix: str, suffix: str) -> str:
    """The prompt whose answer is the text between `prefix` and `suffix` (prefix, suffix, then the middle's mark:
    the order these models were trained on)."""
    return f"{marks.prefix}{prefix}{marks.suffix}{suffix}{marks.middle}"
