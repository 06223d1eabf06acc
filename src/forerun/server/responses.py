"""The Responses API's request path (`/v1/responses`): a request read as the chat request it stands for
(`forerun.server.responses_input`), generated on the same worker, queue and deadline as a chat completion
(`Service.generate_groups`), shaped as a response or its named events (`forerun.server.responses_shaping`).

Example:
    >>> from openai import OpenAI                                                        # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")           # doctest: +SKIP
    >>> client.responses.create(model="smollm2-135m", input="Hi", store=False).output_text  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from forerun.server.fields import APIError
from forerun.server.responses_input import chat_request
from forerun.server.responses_shaping import Events, Reply, answered, settings_of
from forerun.server.schemas import ResponsesRequest
from forerun.server.shaping import logprobs_payload
from forerun.server.stream import cancelling, lone_events
from forerun.server.translate import translate

if TYPE_CHECKING:
    from forerun.server.service import Service


async def respond(service: Service, body: ResponsesRequest, request: Request):
    """One Responses API request: its response object, or a stream of its events."""
    request.state.deadline = time.monotonic() + service.config.request_timeout_s
    chat, rename = chat_request(body)
    try:
        args = translate(chat, service.limits)
    except APIError as error:
        raise rename(error) from None
    ident = f"resp_{uuid.uuid4().hex[:24]}"
    reply = Reply(ident, int(time.time()), service.config.model_name, settings_of(body), service.limits.short_call_ids)
    cancel, logprobs = threading.Event(), args.logprobs is not None
    if not args.stream:
        decoder, done = await rename.awaited(service.generate_groups([args], request, None, cancel))
        service.metrics.count(request.url.path, 200)
        return answered(reply, done[0][1][0], service.tokenizer, decoder.method, logprobs)
    stream, task = await service.stream_one(args, request, cancel, rename)
    events = lone_events(Events(reply), stream, task, lambda entries: shown(service.tokenizer, entries))
    return StreamingResponse(cancelling(events, task, cancel), media_type="text/event-stream")


def shown(tokenizer, entries: list) -> list:
    """A delta's log-probability entries as an output_text delta carries them (chat's `content` entries)."""
    return logprobs_payload(tokenizer, entries, True)["content"]
