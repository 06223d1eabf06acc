"""A reasoning model's thought, told apart from its answer: the text between its own marks (Qwen3's, DeepSeek-R1's
and SmolLM3's `<think>` ... `</think>`, Mistral's `[THINK]` ... `[/THINK]`), which the server sends as `reasoning`
(and `reasoning_content`) beside the answer's `content`, as vLLM's, SGLang's and llama.cpp's servers do.

The split changes nothing the model wrote: the text is plain generate's, read after. It is read from the tokens,
not the text, as Mistral's marks are special tokens the decoded text drops. A thought is where the answer opens
one (its first token past whitespace is the opening mark) or where the prompt did (Qwen3.5's and DeepSeek-R1's
generation prompts end in `<think>\\n`), and it runs to the first closing mark, or to the answer's end where the
answer ended inside it.

Example (a Qwen3 answer of 4 tokens, `<think>`, "hmm", `</think>` and "Hi", whose marks the text shows):
    >>> thought = thought_in(tokenizer, thought_marks(tokenizer), answer_ids, opened=False)  # doctest: +SKIP
    >>> thought                                                                             # doctest: +SKIP
    Thought(start=7, end=10, after=18, tokens=3)
    >>> split("<think>hmm</think>Hi", Thought(start=7, end=10, after=18, tokens=3))
    ('hmm', 'Hi')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forerun.text import complete

THOUGHTS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
"""What a reasoning model's thought is written between: Qwen3's marks, Mistral's (Magistral, Ministral 3
Reasoning)."""


@dataclass(frozen=True)
class ThoughtMarks:
    """The token ids of a tokenizer's thought marks."""

    opening: int
    closing: int


@dataclass(frozen=True)
class Thought:
    """Where a thought stands in an answer's decoded text (special tokens skipped): its text is `text[start:end]`
    (whitespace at its ends aside), the answer after it begins at `after` (`end` and `after` are the text's end
    where the thought was never closed); `tokens`: the answer's tokens up to its end, its marks (and whitespace
    before it) included: OpenAI's `reasoning_tokens`."""

    start: int
    end: int
    after: int
    tokens: int


def thought_marks(tokenizer: object) -> ThoughtMarks | None:
    """The thought marks of `tokenizer`: the first pair of `THOUGHTS` that are both tokens added to its vocabulary
    (a model taught to think has them so), or None."""
    added = getattr(tokenizer, "get_added_vocab", None)
    vocabulary = added() if callable(added) else {}
    for opening, closing in THOUGHTS:
        if opening in vocabulary and closing in vocabulary:
            return ThoughtMarks(vocabulary[opening], vocabulary[closing])
    return None


def thoughts_told(tokenizer: object) -> str:
    """What `forerun serve` says at start of the thoughts it tells apart (the tokenizer's marks, or none)."""
    marks = thought_marks(tokenizer)
    if marks is None:
        return "none told apart (the tokenizer has no thought marks of its own): a thought stays in content"
    opening, closing = (tokenizer.convert_ids_to_tokens(mark) for mark in (marks.opening, marks.closing))
    return f"between {opening} and {closing}, sent as reasoning (and reasoning_content)"


def opened_by(tokenizer: object, marks: ThoughtMarks, prompt: Sequence[int]) -> bool:
    """Whether `prompt` (token ids) leaves a thought open: its last opening mark comes after its last closing mark
    and nothing but whitespace follows it (Qwen3.5's `...<|im_start|>assistant\\n<think>\\n`)."""
    ids = list(prompt)
    if marks.opening not in ids:
        return False
    last = len(ids) - 1 - ids[::-1].index(marks.opening)
    return marks.closing not in ids[last:] and not tokenizer.decode(ids[last + 1 :]).strip()


def thought_terms(
    tokenizer: object, special: Callable[[int], bool], prompt: Sequence[int] | None = None
) -> tuple[tuple[str, ...], bool]:
    """(the thought marks as grammar terms, by id: `<[7]>`, whether `prompt` leaves a thought open) where the
    tokenizer has thought marks that llguidance reads as special tokens (`special(id)`); ((), False) elsewhere.
    Without a prompt, the chat template's own generation prompt for a greeting tells (Qwen3.5's opens it)."""
    marks = thought_marks(tokenizer)
    if marks is None or not (special(marks.opening) and special(marks.closing)):
        return (), False
    if prompt is None:
        try:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]  # fmt: skip
        except Exception:  # the template's own refusals: no thought opened
            prompt = []
    return (f"<[{marks.opening}]>", f"<[{marks.closing}]>"), opened_by(tokenizer, marks, prompt)


def thought_in(tokenizer: object, marks: ThoughtMarks, ids: Sequence[int], opened: bool) -> Thought | None:
    """The thought of answer `ids` (its new tokens), or None where it has none: `opened` where its prompt left one
    open (`opened_by`); otherwise one opens where its first token past whitespace is the opening mark."""
    ids = list(ids)
    first = 0
    if not opened:
        while first < len(ids) and ids[first] != marks.opening and not decoded(tokenizer, ids[first:][:1]).strip():
            first += 1  # whitespace (or a special token the text drops) before the mark
        if first == len(ids) or ids[first] != marks.opening:
            return None
        first += 1
    closing = ids.index(marks.closing, first) if marks.closing in ids[first:] else None
    start = len(decoded(tokenizer, ids[:first]))
    if closing is None:
        end = len(decoded(tokenizer, ids))
        return Thought(start, end, end, len(ids))
    end, after = len(decoded(tokenizer, ids[:closing])), len(decoded(tokenizer, ids[: closing + 1]))
    return Thought(start, end, after, closing + 1)


def decoded(tokenizer: object, ids: Sequence[int]) -> str:
    """The text of `ids` as the answer's text holds it: special tokens skipped, no half character at its end."""
    return complete(tokenizer.decode(list(ids), skip_special_tokens=True))


def split(text: str, thought: Thought | None) -> tuple[str | None, str]:
    """(reasoning, the answer after it) of `text` (as shown: it may end before the thought does, at a stop
    string): the thought's text stripped (None where there is none or it is empty) and the rest, its leading
    whitespace dropped; (None, text) without a thought.

    Example:
        >>> split("<think>\\nhmm\\n</think>\\n\\nHi", Thought(7, 12, 20, 4))
        ('hmm', 'Hi')
    """
    if thought is None:
        return None, text
    reasoning = text[thought.start : thought.end].strip() or None
    return reasoning, text[thought.after :].lstrip()


class ThoughtWatch:
    """A growing answer's thought, followed token by token for a stream: whether one opens is undecided while only
    whitespace has come (the text is held), and its end is found once, as its closing mark comes.

    Example:
        >>> watch = ThoughtWatch(tokenizer, ThoughtMarks(7, 8), prompt_ids)   # doctest: +SKIP
        >>> watch.push([7, 20, 21]); watch.thought(3)                        # doctest: +SKIP
        Thought(start=7, end=3, ...)                                         # open: it runs to the text's end
    """

    def __init__(self, tokenizer: object, marks: ThoughtMarks, prompt: Sequence[int]) -> None:
        self.tokenizer, self.marks = tokenizer, marks
        self.ids: list[int] = []
        self.first: int | None = 0 if opened_by(tokenizer, marks, prompt) else None
        """The answer's first token inside the thought, once known."""
        self.start = 0
        self.closed: Thought | None = None
        self.none = False
        """Whether the answer is known to have no thought."""

    @property
    def undecided(self) -> bool:
        """Whether it is not yet known whether the answer opens a thought (only whitespace has come)."""
        return self.first is None and not self.none

    def push(self, ids: Sequence[int]) -> None:
        """The answer's next tokens."""
        before = len(self.ids)
        self.ids.extend(ids)
        if self.undecided:
            found = thought_in(self.tokenizer, self.marks, self.ids, opened=False)
            if found is None and decoded(self.tokenizer, self.ids).strip():
                self.none = True
            elif found is not None:
                self.first, self.start = self.ids.index(self.marks.opening) + 1, found.start
                before = self.first
        if self.first is not None and self.closed is None and self.marks.closing in self.ids[max(before, self.first) :]:
            self.closed = thought_in(self.tokenizer, self.marks, self.ids, opened=self.first == 0)

    def thought(self, length: int) -> Thought | None:
        """The thought as it stands in a text of `length` characters (an open one runs to its end)."""
        if self.closed is not None or self.first is None:
            return self.closed
        return Thought(self.start, length, length, len(self.ids))
