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
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from forerun.prompts import rendered
from forerun.server.anthropic_input import chat_request
from forerun.server.anthropic_shaping import Events, Reply, answered
from forerun.server.fields import APIError
from forerun.server.renaming import Renaming
from forerun.server.schemas import AnthropicRequest, CountTokensRequest
from forerun.server.stream import cancelling, lone_events
from forerun.server.translate import GenerationArgs, check_model, translate

if TYPE_CHECKING:
    from forerun.server.service import Service


def translated(service: Service, body: AnthropicRequest | CountTokensRequest) -> tuple[GenerationArgs, Renaming]:
    """The generation `body` asks for, and how its errors name the fields sent; a 400 names the field sent."""
    chat, rename = chat_request(body, service.limits.template_variables)
    try:
        return translate(chat, service.limits), rename
    except APIError as error:
        raise rename(error) from None


async def respond(service: Service, body: AnthropicRequest, request: Request):
    """One Messages request: its message, or a stream of its events."""
    request.state.deadline = time.monotonic() + service.config.request_timeout_s
    args, rename = translated(service, body)
    reply = Reply(f"msg_{uuid.uuid4().hex[:24]}", service.config.model_name)
    cancel = threading.Event()
    if not args.stream:
        decoder, done = await rename.awaited(service.generate_groups([args], request, None, cancel))
        service.metrics.count(request.url.path, 200)
        return answered(reply, done[0][1][0], decoder.method, args.stop)
    stream, task = await service.stream_one(args, request, cancel, rename)
    events = Events(Reply(reply.ident, reply.model, stream.prompt_tokens), args.stop)
    written = lone_events(events, stream, task, lambda entries: None)  # Anthropic's API has no logprobs
    return StreamingResponse(cancelling(written, task, cancel), media_type="text/event-stream")


async def count_tokens(service: Service, body: CountTokensRequest) -> dict:
    """`/v1/messages/count_tokens`: the tokens the request's prompt holds, through the chat template with its
    tools, as a Messages request renders it."""
    check_model(body.model, service.limits)
    args, _ = translated(service, body)
    try:
        ids = await asyncio.to_thread(rendered, service.tokenizer, args.prompt, args.tools, args.chat_template_kwargs,
                                      True, args.continued)  # fmt: skip
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    return {"input_tokens": len(ids)}
