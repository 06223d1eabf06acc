"""Token ids in, text out, one piece at a time: the one incremental detokenizer of the CLI, the chat and the server.

Text is decoded cumulatively (a token's text can depend on its neighbours), and a character whose bytes are split
over tokens is held back until it is complete (the tokenizer shows it as U+FFFD meanwhile), so no reader ever sees
half a character.

Example:
    >>> text = IncrementalText(tokenizer)                          # doctest: +SKIP
    >>> text.push([9906]), text.push([11, 1917]), text.finish()    # doctest: +SKIP
    ('Hello', ', world', '')
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Accumulates token ids; `push` returns the newly complete text, `finish` the rest."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        """The text handed out so far."""

    def decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Iterable[int]) -> str:
        """Add token ids; the text they complete (possibly empty while a character is incomplete)."""
        self.ids.extend(int(i) for i in ids)
        full = self.decoded()
        if full.endswith(REPLACEMENT):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def finish(self) -> str:
        """The rest of the text; a character left incomplete by the last token is dropped, not shown as U+FFFD."""
        full = complete(self.decoded())
        delta, self.text = full[len(self.text) :], full
        return delta


def complete(text: str) -> str:
    """`text` without the trailing U+FFFD that an incomplete multi-byte character decodes to."""
    return text.rstrip(REPLACEMENT)
