"""GenerationResult -> OpenAI's Responses API objects: the response, its output items (a reasoning model's thought,
the message, its function calls), its usage, and the named server-sent events of its stream (`Events`). Pure
functions of a result (no server, no model), as `forerun.server.shaping` is for chat.

Example:
    >>> reply = Reply("resp_1", 1700000000, "smollm2-135m", {})
    >>> events = Events(reply)
    >>> [json.loads(e.split("data: ")[1])["type"] for e in events.opening() + events.text("Hi", None)]
    ['response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added', \
'response.output_text.delta']
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from forerun.decoder import GenerationResult
from forerun.logprobs import entries_before
from forerun.server.fields import APIError
from forerun.server.schemas import ResponsesRequest
from forerun.server.shaping import logprobs_payload, usage
from forerun.tool_calls import ToolCall
from forerun.tool_stream import CallPart


@dataclass(frozen=True)
class Reply:
    """What every part of one response repeats: its id (`resp_...`), creation time, model, and the request's
    settings the response object shows (`settings_of`)."""

    ident: str
    created: int
    model: str
    settings: dict
    short_call_ids: bool = False
    """Whether its calls get 9-character ids (the chat template takes no others: Mistral's)."""

    def item_id(self, kind: str, k: int = 0) -> str:
        """The id of one of its output items: `msg_...`, `rs_...`, `fc_..._k`."""
        return f"{kind}_{self.ident.removeprefix('resp_')}" + (f"_{k}" if k else "")


def settings_of(body: ResponsesRequest) -> dict:
    """The request's settings as a response repeats them (OpenAI's defaults where it left them out); `store`
    false: nothing is kept."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "tools": body.tools or [],
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}},
        "reasoning": body.reasoning or {"effort": None, "summary": None},
        "metadata": body.metadata or {},
        "user": body.user,
        "store": False,
        "truncation": "disabled",
        "previous_response_id": None,
        "background": False,
        "service_tier": "default",
    }


def response(
    reply: Reply,
    status: str,
    output: list[dict],
    used: dict | None = None,
    error: dict | None = None,
) -> dict:
    """The response object: `status` 'in_progress', 'completed', 'incomplete' (the answer reached
    `max_output_tokens`) or 'failed' (with `error`); `used`: its usage and forerun's statistics (`usage_of`)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": reply.ident,
        "object": "response",
        "created_at": reply.created,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": reply.model,
        "output": output,
        **reply.settings,
        **(used or {"usage": None}),
    }


def usage_of(results: Sequence[GenerationResult], method: str) -> dict:
    """The Responses API's `usage` (input and output tokens, cached and reasoning ones among them) and forerun's
    statistics, as a chat completion's (`forerun.server.shaping.usage`)."""
    chat = usage(results, method)
    counts = chat["usage"]
    return {
        "usage": {
            "input_tokens": counts["prompt_tokens"],
            # cache_write_tokens: OpenAI's SDK needs the field; what the prefix cache keeps is not counted
            "input_tokens_details": {**counts["prompt_tokens_details"], "cache_write_tokens": 0},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": counts["completion_tokens_details"]["reasoning_tokens"]},
            "total_tokens": counts["total_tokens"],
        },
        "forerun": chat["forerun"],
    }


def status_of(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def answered(reply: Reply, result: GenerationResult, tokenizer, method: str, logprobs: bool) -> dict:
    """The whole (not streamed) response of one generation."""
    output = []
    if result.reasoning is not None:
        output.append(reasoning_item(reply, result.reasoning))
    if result.content or not result.tool_calls and result.reasoning is None:
        output.append(message_item(reply, result.content or "", answer_logprobs(result, tokenizer, logprobs)))
    calls = result.tool_calls or ()
    output += [call_item(reply, call, k, call_id(reply, call)) for k, call in enumerate(calls)]
    return response(reply, status_of(result), output, usage_of([result], method))


def answer_logprobs(result: GenerationResult, tokenizer, asked: bool) -> list | None:
    """The log-probabilities of the answer's tokens after its thought, up to a stop string (None: not asked)."""
    if not asked or result.logprobs is None:
        return None
    entries = entries_before(tokenizer, result.logprobs, result.stop_at)
    entries = entries[result.thought.tokens :] if result.thought is not None else entries
    return logprobs_payload(tokenizer, entries, chat=True)["content"]


def call_id(reply: Reply, call: ToolCall) -> str:
    """A fresh id for a call (`call_id`: a tool's output names it), as a chat completion's calls get."""
    return call.as_openai(short=reply.short_call_ids)["id"]


def reasoning_item(reply: Reply, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": reply.item_id("rs"), "summary": [], "content": content,
            "encrypted_content": None, "status": status}  # fmt: skip


def message_item(reply: Reply, text: str, logprobs: list | None, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": reply.item_id("msg"), "status": status, "role": "assistant", "content": [part]}


def call_item(reply: Reply, call: ToolCall, k: int, ident: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": reply.item_id("fc", k), "call_id": ident, "name": call.name,
            "arguments": call.arguments, "status": status}  # fmt: skip


class Events:
    """The server-sent events of one streamed response, in the order OpenAI's SDKs check: the response created,
    then each output item added, its part's deltas, its part and item done (a thought first, the message, then
    each call as it is written), then the response completed (or incomplete, or failed) with every item."""

    def __init__(self, reply: Reply) -> None:
        self.reply, self.sequence = reply, 0
        self.items: list[dict] = []
        """Output items done."""
        self.open: dict | None = None
        """The item being written (a reasoning or message item), its part's text growing."""
        self.logprobs: list = []

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def opening(self) -> list[str]:
        snapshot = response(self.reply, "in_progress", [])
        return [self.event(f"response.{kind}", response=snapshot) for kind in ("created", "in_progress")]

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)} if self.open else {}

    def reasoning(self, delta: str) -> list[str]:
        events = self.opened("reasoning")
        self.open["content"][0]["text"] += delta
        return [*events, self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=delta)]

    def text(self, delta: str, logprobs: list | None) -> list[str]:
        events = self.opened("message")
        self.open["content"][0]["text"] += delta
        self.logprobs += logprobs or []
        fields = {**self.where(), "content_index": 0, "delta": delta, "logprobs": logprobs or []}
        return [*events, self.event("response.output_text.delta", **fields)]

    def opened(self, kind: str) -> list[str]:
        """The events that open an item of `kind` (the one open closed first), or none where one is open."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self.closed()
        if kind == "reasoning":
            self.open = reasoning_item(self.reply, "", "in_progress")
        else:
            self.open = message_item(self.reply, "", None, "in_progress")
        shown = {**self.open, "content": []}
        events.append(self.event("response.output_item.added", output_index=len(self.items), item=shown))
        part = self.open["content"][0]
        return [*events, self.event("response.content_part.added", **self.where(), content_index=0, part=part)]

    def closed(self, status: str = "completed") -> list[str]:
        """The events that close the open item (none where none is open)."""
        if self.open is None:
            return []
        if self.open["type"] == "function_call":
            return self.call_closed(status)
        part, where = self.open["content"][0], self.where()
        if self.open["type"] == "message":
            part["logprobs"] = self.logprobs
            done = self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                              logprobs=part["logprobs"])  # fmt: skip
        else:
            done = self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
        self.open["status"] = status
        events = [done, self.event("response.content_part.done", **where, content_index=0, part=part)]
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=self.open))
        self.items.append(self.open)
        self.open = None
        return events

    def call_closed(self, status: str) -> list[str]:
        """The events that close the open call's item: its arguments whole, the item done."""
        item, where = self.open, self.where()
        item["status"] = status
        events = [self.event("response.function_call_arguments.done", **where, arguments=item["arguments"],
                             name=item["name"]),
                  self.event("response.output_item.done", output_index=where["output_index"], item=item)]  # fmt: skip
        self.items.append(item)
        self.open = None
        return events

    def call(self, part: CallPart) -> list[str]:
        """A piece of a call (`forerun.tool_stream`): its item added with its first piece (the open item closed
        first), its arguments' deltas as they come, the item done with its last."""
        events = []
        if part.name is not None:
            events = self.closed()
            call = ToolCall(part.name, "")
            self.open = call_item(self.reply, call, part.index, call_id(self.reply, call), "in_progress")
            events.append(self.event("response.output_item.added", output_index=len(self.items), item=self.open))
        if part.arguments:
            self.open["arguments"] += part.arguments
            events.append(self.event("response.function_call_arguments.delta", **self.where(), delta=part.arguments))
        return [*events, *self.closed()] if part.done else events

    def finish(self, result: GenerationResult, method: str) -> list[str]:
        """The last events: the open item closed (an empty message where nothing was written), the response
        completed, or incomplete where it reached `max_output_tokens`."""
        events = [] if self.items or self.open else self.opened("message")
        events += self.closed()
        status = status_of(result)
        done = response(self.reply, status, self.items, usage_of([result], method))
        return [*events, self.event(f"response.{status}", response=done)]

    def fail(self, failure: APIError) -> list[str]:
        """The last event of a response that failed while it was written (its items so far in it)."""
        events = self.closed("incomplete")
        error = {"code": failure.kind, "message": failure.message}
        failure = response(self.reply, "failed", self.items, None, error)
        return [*events, self.event("response.failed", response=failure)]
