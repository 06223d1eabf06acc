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

from forerun.decoder import GenerationResult
from forerun.logprobs import TokenLogprob, entries_before


@dataclass(frozen=True)
class Answer:
    """What every part of one response repeats: its id, creation time, model name and kind."""

    ident: str
    created: int
    model: str
    chat: bool

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(results: Sequence[GenerationResult], method: str) -> dict:
    """OpenAI's `usage` of a response's choices (with cached prompt tokens and predicted-output counts; the prompt
    counted once, every choice's tokens) and forerun's own statistics of the generations that wrote them (greedy
    choices are one generation shown n times; sampled ones a row each, whose forwards each count)."""
    generations = list({id(result): result for result in results}.values())
    first, stats = generations[0], [result.stats for result in generations]
    new_tokens, forwards = sum(s.new_tokens for s in stats), sum(s.forwards for s in stats)
    candidates = sum(s.candidates for s in stats)
    completion_tokens = sum(result.stats.new_tokens for result in results)
    return {
        "usage": {
            "prompt_tokens": first.prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": first.prompt_len + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": first.stats.cached_prompt_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": sum(result.accepted_prediction_tokens for result in results),
                "rejected_prediction_tokens": sum(result.rejected_prediction_tokens for result in results),
            },
        },
        "forerun": {
            "method": method,
            "forwards": forwards,
            "tokens_per_forward": new_tokens / forwards if forwards else 0.0,
            "acceptance": sum(s.accepted for s in stats) / candidates if candidates else 0.0,
            "seconds": max(s.total_seconds for s in stats),
            "prefill_seconds": max(s.prefill_seconds for s in stats),
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
    pieces = [tokenizer.decode([e.token]) for e in entries]
    offsets = [offset + sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return {
        "tokens": pieces,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{tokenizer.decode([t]): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def completion(answer: Answer, results: Sequence[GenerationResult], method: str, tokenizer) -> dict:
    """The whole (not streamed) response, a choice per result: the text up to the first stop string, its finish
    reason, logprobs."""
    return {
        "id": answer.ident,
        "object": answer.kind,
        "created": answer.created,
        "model": answer.model,
        "choices": [choice_of(answer, result, index, tokenizer) for index, result in enumerate(results)],
        **usage(results, method),
    }


def choice_of(answer: Answer, result: GenerationResult, index: int, tokenizer) -> dict:
    """Choice `index` of a whole response."""
    text = result.shown_text
    entries = None if result.logprobs is None else entries_before(tokenizer, result.logprobs, result.stop_at)
    logprobs = logprobs_payload(tokenizer, entries, answer.chat)
    if answer.chat:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": result.finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}


def chunk(
    answer: Answer,
    delta: str | None,
    reason: str | None = None,
    extra: dict | None = None,
    choices: bool = True,
    logprobs: dict | None = None,
    index: int = 0,
) -> str:
    """One server-sent event of a stream: a text delta of choice `index` (None: no content, e.g. the last chunk
    with its reason)."""
    if answer.chat:
        choice = {"index": index, "delta": {} if delta is None else {"content": delta}, "finish_reason": reason}
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


def opening(answer: Answer, index: int = 0) -> str:
    """A chat stream's first chunk of choice `index`: the assistant's role, no content yet."""
    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    payload = {"id": answer.ident, "object": answer.chunk_kind, "created": answer.created, "model": answer.model}
    return f"data: {json.dumps({**payload, 'choices': [first]})}\n\n"


def event(body: dict) -> str:
    """Any JSON body as one server-sent event (an error inside a stream)."""
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
