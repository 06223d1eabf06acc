"""GenerationResult -> Anthropic's Messages API objects: the message (thinking, text and tool_use blocks), its stop
reason and usage, its errors, and the named server-sent events of its stream (`Events`). Pure functions of a
result (no server, no model), as `forerun.server.shaping` is for OpenAI's chat.

Example:
    >>> events = Events(Reply("msg_1", "smollm2-135m", 12))
    >>> [e.split("\\n")[0] for e in events.opening() + events.text("Hi")]
    ['event: message_start', 'event: content_block_start', 'event: content_block_delta']
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from forerun.decoder import GenerationResult
from forerun.server.errors import anthropic_error
from forerun.server.fields import APIError
from forerun.server.shaping import usage
from forerun.tool_calls import ToolCall
from forerun.tool_stream import CallPart


@dataclass(frozen=True)
class Reply:
    """What every part of one message repeats: its id (`msg_...`), the model's name, and its prompt's tokens."""

    ident: str
    model: str
    prompt_tokens: int = 0
    edits: dict | None = None
    """The request's context edits, as the answer's `context_management` tells them (None: none asked)."""
    thoughts: bool = True
    """Whether a thinking block shows its thought (`thinking.display: "omitted"`: empty, as Anthropic's)."""


def stop_of(result: GenerationResult, stops: Sequence[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the answer's end as Anthropic says it, and the stop sequence that ended it."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.tool_calls:
        return "tool_use", None
    if result.stop_at is not None:
        text = result.text or ""
        return "stop_sequence", next((s for s in stops if text.startswith(s, result.stop_at)), None)
    return "end_turn", None


def usage_of(result: GenerationResult, method: str) -> dict:
    """Anthropic's `usage` (its `input_tokens` are those not read from the cache) and forerun's statistics."""
    chat = usage([result], method)
    counts = chat["usage"]
    cached = counts["prompt_tokens_details"]["cached_tokens"]
    return {
        "usage": {
            "input_tokens": counts["prompt_tokens"] - cached,
            "output_tokens": counts["completion_tokens"],
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        },
        "forerun": chat["forerun"],
    }


def fresh_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_use(call: ToolCall) -> dict:
    """A call as a tool_use block, its input the arguments' object, with a fresh `toolu_` id."""
    return {"type": "tool_use", "id": fresh_tool_use_id(), "name": call.name,
            "input": json.loads(call.arguments)}  # fmt: skip


def message(reply: Reply, content: list[dict], stop: tuple[str | None, str | None], used: dict | None = None) -> dict:
    edits = {} if reply.edits is None else {"context_management": reply.edits}
    return {"id": reply.ident, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            **(used or {"usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}), **edits}  # fmt: skip


def answered(reply: Reply, result: GenerationResult, method: str, stops: Sequence[str]) -> dict:
    """The whole (not streamed) message of one generation: its thought, its words, its calls, in that order."""
    content = []
    if result.reasoning is not None:
        content.append({"type": "thinking", "thinking": result.reasoning if reply.thoughts else "", "signature": ""})
    if result.content:
        content.append({"type": "text", "text": result.content})
    content += [tool_use(call) for call in result.tool_calls or ()]
    return message(reply, content, stop_of(result, stops), usage_of(result, method))


class Events:
    """The server-sent events of one streamed message, in Anthropic's order: message_start, then each content
    block started, its deltas, stopped (a thought, the words, then each call as it is written), then
    message_delta (the stop reason and usage) and message_stop."""

    def __init__(self, reply: Reply, stops: Sequence[str] = ()) -> None:
        self.reply, self.stops = reply, stops
        """The message and the request's stop sequences (`stop_of` names the one that ended it)."""
        self.blocks = 0
        """Blocks started so far (the next one's index)."""
        self.open: str | None = None
        """The kind of the block being written ('thinking' or 'text'), or None."""

    @staticmethod
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def opening(self) -> list[str]:
        return [self.event("message_start", message=message(self.reply, [], (None, None)))]

    def opened(self, kind: str) -> list[str]:
        """The events that start a block of `kind` (the open one stopped first), or none where one is open."""
        if self.open == kind:
            return []
        events = self.closed()
        self.open = kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": kind, kind: ""}
        )
        return [*events, self.event("content_block_start", index=self.blocks, content_block=block)]

    def closed(self) -> list[str]:
        if self.open is None:
            return []
        self.open, self.blocks = None, self.blocks + 1
        return [self.event("content_block_stop", index=self.blocks - 1)]

    def reasoning(self, delta: str) -> list[str]:
        events = self.opened("thinking")
        if not self.reply.thoughts:
            return events
        return [*events, self.event("content_block_delta", index=self.blocks,
                                    delta={"type": "thinking_delta", "thinking": delta})]  # fmt: skip

    def text(self, delta: str, logprobs: list | None = None) -> list[str]:
        """A words delta (Anthropic's API sends no log-probabilities: `logprobs` is not sent)."""
        events = self.opened("text")
        return [*events, self.event("content_block_delta", index=self.blocks,
                                    delta={"type": "text_delta", "text": delta})]  # fmt: skip

    def call(self, part: CallPart) -> list[str]:
        """A piece of a call (`forerun.tool_stream`): its tool_use block started with its first piece (the open
        block stopped first), its input's JSON as it is written, the block stopped with its last."""
        events = []
        if part.name is not None:
            events, self.open = self.closed(), "tool_use"
            block = {"type": "tool_use", "id": fresh_tool_use_id(), "name": part.name, "input": {}}
            events.append(self.event("content_block_start", index=self.blocks, content_block=block))
        if part.arguments:
            delta = {"type": "input_json_delta", "partial_json": part.arguments}
            events.append(self.event("content_block_delta", index=self.blocks, delta=delta))
        return [*events, *self.closed()] if part.done else events

    def finish(self, result: GenerationResult, method: str) -> list[str]:
        """The last events: the open block stopped, the stop reason and usage, the message's stop."""
        reason, sequence = stop_of(result, self.stops)
        used = usage_of(result, method)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        edits = {} if self.reply.edits is None else {"context_management": self.reply.edits}
        ended = self.event("message_delta", delta=delta, **used, **edits)
        return [*self.closed(), ended, self.event("message_stop")]

    def fail(self, failure: APIError) -> list[str]:
        """The last event of a message that failed while it was written: Anthropic's error event."""
        return [*self.closed(), self.event("error", error=anthropic_error(failure.status, failure.message)["error"])]
