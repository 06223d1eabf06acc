"""GenerationResult -> OpenAI's JSON: completions, chat completions, their streamed chunks, usage and logprobs.
Pure functions of a result (no server, no model), so every response shape is tested without uvicorn.

Example:
    >>> answer = Answer("chatcmpl-1", 1700000000, "smollm2-135m", chat=True)
    >>> json.loads(chunk(answer, "Hi")[6:])["choices"]
    [{'index': 0, 'delta': {'content': 'Hi'}, 'finish_reason': None, 'logprobs': None}]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from forerun.decoder import GenerationResult
from forerun.logprobs import TokenLogprob, entries_before
from forerun.tool_calls import fresh_call_id
from forerun.tool_stream import CallPart


@dataclass(frozen=True)
class Answer:
    """What every part of one response repeats: its id, creation time, model name and kind."""

    ident: str
    created: int
    model: str
    chat: bool
    short_call_ids: bool = False
    """Whether its tool calls get 9-character ids (the chat template takes no others: Mistral's)."""

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass(frozen=True)
class Echo:
    """A completion's prompt shown before its text (`echo`): the text, its token ids, and their log-probability
    entries (`forerun.scoring`: the first token's None), or None where no logprobs were asked."""

    text: str
    ids: tuple[int, ...]
    entries: tuple[TokenLogprob | None, ...] | None = None
    cached: int = 0
    """Prompt tokens read from the prefix cache (a head scored before)."""


def usage(results: Sequence[GenerationResult | None], method: str, prompts: tuple[int, int] | None = None) -> dict:
    """OpenAI's `usage` of a response's choices (with cached prompt tokens and predicted-output counts; the prompt
    counted once, every choice's tokens) and forerun's own statistics of the generations that wrote them (greedy
    choices are one generation shown n times; sampled ones a row each, whose forwards each count).
    `prompts`: (tokens, cached tokens) of the request's prompts, where it sends several or generates nothing (an
    echoed prompt alone); None: the first generation's."""
    written = [result for result in results if result is not None]
    generations = list({id(result): result for result in written}.values())
    stats = [result.stats for result in generations]
    new_tokens, forwards = sum(s.new_tokens for s in stats), sum(s.forwards for s in stats)
    candidates = sum(s.candidates for s in stats)
    completion_tokens = sum(result.stats.new_tokens for result in written)
    if prompts is None:
        prompts = generations[0].prompt_len, generations[0].stats.cached_prompt_tokens
    prompt_tokens, cached = prompts
    return {
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {
                "accepted_prediction_tokens": sum(result.accepted_prediction_tokens for result in written),
                "rejected_prediction_tokens": sum(result.rejected_prediction_tokens for result in written),
                "reasoning_tokens": sum(result.thought.tokens for result in written if result.thought is not None),
            },
        },
        "forerun": {
            "method": method,
            "forwards": forwards,
            "tokens_per_forward": new_tokens / forwards if forwards else 0.0,
            "acceptance": sum(s.accepted for s in stats) / candidates if candidates else 0.0,
            "seconds": max((s.total_seconds for s in stats), default=0.0),
            "prefill_seconds": max((s.prefill_seconds for s in stats), default=0.0),
            "prefill_chunks": sum(s.prefill_chunks for s in stats),
        },
    }


def logprobs_payload(tokenizer, entries: Sequence[TokenLogprob] | None, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for `entries` (None: none were asked); `offset`: characters shown before them (a
    completion's `text_offset` counts from the answer's start)."""
    if entries is None:
        return None

    def described(token: int, value: float) -> dict:
        piece = tokenizer.decode([token])
        return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

    if chat:
        content = [
            {**described(e.token, e.logprob), "top_logprobs": [described(t, v) for t, v in e.top]} for e in entries
        ]
        return {"content": content, "refusal": None}
    return text_logprobs(tokenizer, [e.token for e in entries], entries, offset)


def echo_payload(tokenizer, echo: Echo | None) -> dict | None:
    """A completion's logprobs object of its echoed prompt (None: no echo, or no logprobs asked): the first
    token's logprob and alternatives null, as OpenAI's."""
    if echo is None or echo.entries is None:
        return None
    return text_logprobs(tokenizer, echo.ids, echo.entries)


def text_logprobs(tokenizer, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0) -> dict:
    """A completion's logprobs object: each token's text, its log-probability and alternatives (null where its
    entry is None), and where its text begins, counted from `offset` characters."""
    pieces = [tokenizer.decode([token]) for token in tokens]
    return {
        "tokens": pieces,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {tokenizer.decode([t]): v for t, v in e.top} for e in entries],
        "text_offset": list(accumulate((len(piece) for piece in pieces), initial=offset))[:-1],
    }


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completion logprobs objects one after the other (an echoed prompt's, then its answer's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def completion(
    answer: Answer,
    results: Sequence[GenerationResult | None],
    method: str,
    tokenizer,
    echoes: Sequence[Echo | None] | None = None,
    prompts: tuple[int, int] | None = None,
) -> dict:
    """The whole (not streamed) response, a choice per result: the text up to the first stop string (after its
    echoed prompt, `echoes[i]`; a result None: the prompt alone), its finish reason, logprobs."""
    echoes = echoes or [None] * len(results)
    choices = [
        choice_of(answer, result, index, tokenizer, echo)
        for index, (result, echo) in enumerate(zip(results, echoes, strict=True))
    ]
    return {
        "id": answer.ident,
        "object": answer.kind,
        "created": answer.created,
        "model": answer.model,
        "choices": choices,
        **usage(results, method, prompts),
    }


def choice_of(answer: Answer, result: GenerationResult | None, index: int, tokenizer, echo: Echo | None = None) -> dict:
    """Choice `index` of a whole response."""
    shown = "" if echo is None else echo.text
    if result is None:  # the echoed prompt alone
        return {"index": index, "text": shown, "logprobs": echo_payload(tokenizer, echo), "finish_reason": "length"}
    text = result.shown_text
    entries = None if result.logprobs is None else entries_before(tokenizer, result.logprobs, result.stop_at)
    logprobs = logprobs_payload(tokenizer, entries, answer.chat, len(shown))
    if answer.chat:
        message = {"role": "assistant", "content": result.content, "refusal": None, **thought_fields(result.reasoning)}
        if result.tool_calls:
            message["tool_calls"] = [call.as_openai(short=answer.short_call_ids) for call in result.tool_calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": result.finish_reason}
    logprobs = joined(echo_payload(tokenizer, echo), logprobs)
    return {"index": index, "text": shown + text, "logprobs": logprobs, "finish_reason": result.finish_reason}


def thought_fields(reasoning: str | None) -> dict:
    """A message's (or a delta's) thought: under vLLM's and OpenRouter's name (`reasoning`) and DeepSeek's and
    llama.cpp's (`reasoning_content`), as clients read one or the other; none where there is no thought."""
    return {} if reasoning is None else {"reasoning": reasoning, "reasoning_content": reasoning}


def chunk(
    answer: Answer,
    delta: str | None,
    reason: str | None = None,
    extra: dict | None = None,
    choices: bool = True,
    logprobs: dict | None = None,
    index: int = 0,
    reasoning: str | None = None,
) -> str:
    """One server-sent event of a stream: a text delta of choice `index` (None: no content, e.g. the last chunk
    with its reason), or a delta of its thought (`reasoning`)."""
    if answer.chat:
        delta_of = thought_fields(reasoning) if reasoning is not None else {} if delta is None else {"content": delta}
        choice = {"index": index, "delta": delta_of, "finish_reason": reason}
    else:
        choice = {"index": index, "text": delta or "", "finish_reason": reason}
    choice["logprobs"] = logprobs
    payload = {
        "id": answer.ident,
        "object": answer.chunk_kind,
        "created": answer.created,
        "model": answer.model,
        "choices": [choice] if choices else [],
        **(extra or {}),
    }
    return f"data: {json.dumps(payload)}\n\n"


def call_chunk(answer: Answer, part: CallPart, index: int = 0) -> str | None:
    """A chat stream's chunk of choice `index` carrying a piece of a tool call (`forerun.tool_stream.CallPart`): a
    fresh id, the type and the name with its first piece, then its arguments as they come, as OpenAI streams them;
    None for a piece that carries nothing (a call's end)."""
    if part.name is None and not part.arguments:
        return None
    call: dict = {"index": part.index, "function": {"arguments": part.arguments}}
    if part.name is not None:
        call = {"index": part.index, "id": fresh_call_id(answer.short_call_ids), "type": "function",
                "function": {"name": part.name, "arguments": part.arguments}}  # fmt: skip
    choice = {"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None, "logprobs": None}
    payload = {"id": answer.ident, "object": answer.chunk_kind, "created": answer.created, "model": answer.model}
    return f"data: {json.dumps({**payload, 'choices': [choice]})}\n\n"


def opening(answer: Answer, index: int = 0) -> str:
    """A chat stream's first chunk of choice `index`: the assistant's role, no content yet."""
    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    payload = {"id": answer.ident, "object": answer.chunk_kind, "created": answer.created, "model": answer.model}
    return f"data: {json.dumps({**payload, 'choices': [first]})}\n\n"


def event(body: dict) -> str:
    """Any JSON body as one server-sent event (an error inside a stream)."""
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
