"""Another API's request (OpenAI's Responses, Anthropic's Messages) made into the chat request it stands for, and
the errors of that chat request naming the fields the client sent: chat's `messages[i]` as the item or message it
came from, chat's field names as that API's.

Example (a Responses request's first input item made chat's second message, after its instructions):
    >>> rename = Renaming(["instructions", "input[0]"], {"max_completion_tokens": "max_output_tokens"}, "input")
    >>> error = rename(APIError(400, "messages[1].content is missing", "messages[1].content"))
    >>> error.param, error.message
    ('input[0].content', 'input[0].content is missing')
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from forerun.server.fields import APIError, refuse
from forerun.server.schemas import ChatRequest


@dataclass(frozen=True)
class Renaming:
    """How a chat request's errors name what the client sent: `origins[i]` for chat's `messages[i]`, `listed` for
    chat's messages as a whole, `names` for chat's other fields."""

    origins: list[str]
    names: dict[str, str]
    listed: str

    def __call__(self, error: APIError) -> APIError:
        return APIError(error.status, self.named(error.message) or "", self.named(error.param), error.kind)

    def named(self, text: str | None) -> str | None:
        if text is None:
            return None
        origins = self.origins
        text = re.sub(r"\bmessages\[(\d+)\]", lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0], text)
        text = re.sub(r"\b(input\[\d+\])\.tool_calls(\[\d+\])?", r"\1", text)  # a Responses item is its call
        text = re.sub(r"\bmessages\b(?!\[)", self.listed, text)
        return re.sub(r"\b(" + "|".join(self.names) + r")\b", lambda m: self.names[m[1]], text)

    def chat(self, fields: dict[str, Any]) -> ChatRequest:
        """The chat request of `fields` (None values left out), or a 400 naming what the client sent: a value of
        the wrong type inside a field pydantic checks."""
        try:
            return ChatRequest(**{name: value for name, value in fields.items() if value is not None})
        except ValidationError as error:
            first = error.errors()[0]
            where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
            raise self(refuse(where, f"invalid request: {where}: {first['msg']}")) from None

    async def awaited(self, work: Awaitable) -> Any:
        """`work`'s result, its errors naming what the client sent."""
        try:
            return await work
        except APIError as error:
            raise self(error) from None
