"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): a request read as the chat request it
stands for (`forerun.server.anthropic_input`), generated on the same worker, queue and deadline as a chat
completion (`Service.generate_groups`), shaped as a message or its named events (`forerun.server.anthropic_shaping`);
errors in Anthropic's shape (`forerun.server.errors`). Claude Code points here with `ANTHROPIC_BASE_URL`.

Example:
    >>> import anthropic                                                                    # doctest: +SKIP
    >>> client = anthropic.Anthropic(base_url="http://127.0.0.1:8000", api_key="none")    # doctest: +SKIP
    >>> client.messages.create(model="smollm2-135m", max_tokens=64,
    ...                        messages=[{"role": "user", "content": "Hi"}]).content[0].text  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from forerun.prompts import rendered
from forerun.server.anthropic_input import chat_request
from forerun.server.anthropic_shaping import Events, Reply, answered
from forerun.server.context_edits import apply_edits, edits_of
from forerun.server.fields import APIError
from forerun.server.renaming import Renaming
from forerun.server.schemas import AnthropicRequest, CountTokensRequest
from forerun.server.stream import cancelling, lone_events
from forerun.server.translate import GenerationArgs, check_model, translate

if TYPE_CHECKING:
    from forerun.server.service import Service

Body = TypeVar("Body", AnthropicRequest, CountTokensRequest)


def translated(service: Service, body: AnthropicRequest | CountTokensRequest) -> tuple[GenerationArgs, Renaming]:
    """The generation `body` asks for, and how its errors name the fields sent; a 400 names the field sent."""
    chat, rename = chat_request(body, service.limits.template_variables)
    try:
        return translate(chat, service.limits), rename
    except APIError as error:
        raise rename(error) from None


def prompt_tokens(service: Service, body: AnthropicRequest | CountTokensRequest) -> int:
    """The tokens of `body`'s prompt, through the chat template with its tools, as a Messages request renders it."""
    args, _ = translated(service, body)
    try:
        return len(rendered(service.tokenizer, args.prompt, args.tools, args.chat_template_kwargs, True,
                            args.continued))  # fmt: skip
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None


def context_edited(service: Service, body: Body) -> tuple[Body, list[dict] | None, int | None]:
    """(`body` with its `context_management` edits applied, what they cleared (None where it asks for none), the
    prompt's tokens before them where they were counted)."""
    if body.context_management is None:
        return body, None, None
    edits = edits_of(body.context_management)
    counts: dict[int, int] = {}

    def count(messages: list) -> int:
        counts[id(messages)] = prompt_tokens(service, body.model_copy(update={"messages": messages}))
        return counts[id(messages)]

    messages, applied = apply_edits(body.messages, edits, count)
    return body.model_copy(update={"messages": messages}), applied, counts.get(id(body.messages))


async def respond(service: Service, body: AnthropicRequest, request: Request):
    """One Messages request: its message, or a stream of its events."""
    request.state.deadline = time.monotonic() + service.config.request_timeout_s
    body, applied, _ = await asyncio.to_thread(context_edited, service, body)  # it may render the prompt
    args, rename = translated(service, body)
    edits = None if applied is None else {"applied_edits": applied}
    shown = (body.thinking or {}).get("display") != "omitted"
    reply = Reply(f"msg_{uuid.uuid4().hex[:24]}", service.config.model_name, edits=edits, thoughts=shown)
    cancel = threading.Event()
    if not args.stream:
        decoder, done = await rename.awaited(service.generate_groups([args], request, None, cancel))
        service.metrics.count(request.url.path, 200)
        return answered(reply, done[0][1][0], decoder.method, args.stop)
    stream, task = await service.stream_one(args, request, cancel, rename)
    events = Events(Reply(reply.ident, reply.model, stream.prompt_tokens, edits, shown), args.stop)
    written = lone_events(events, stream, task, lambda entries: None)  # Anthropic's API has no logprobs
    return StreamingResponse(cancelling(written, task, cancel), media_type="text/event-stream")


async def count_tokens(service: Service, body: CountTokensRequest) -> dict:
    """`/v1/messages/count_tokens`: the tokens the request's prompt holds, through the chat template with its
    tools, as a Messages request renders it (after its context edits: then with the count before them)."""
    check_model(body.model, service.limits)
    edited, applied, before = await asyncio.to_thread(context_edited, service, body)
    counted = await asyncio.to_thread(prompt_tokens, service, edited)
    if applied is None:
        return {"input_tokens": counted}
    return {"input_tokens": counted, "context_management": {"original_input_tokens": before or counted}}
