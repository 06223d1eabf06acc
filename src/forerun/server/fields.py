"""Each OpenAI request field checked and read on its own: the 400s that name one field (`translate` puts them
together).

Example:
    >>> stops_of(ChatRequest(messages=[{"role": "user", "content": "Hi"}], stop="\\n"))
    ['\\n']
    >>> logit_bias_of(ChatRequest(messages=[{"role": "user", "content": "Hi"}], logit_bias={"42": -100}), 1000)
    {42: -100.0}
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from forerun.checks import check_sampling, check_text
from forerun.penalties import REQUEST_FIELDS as OPENAI_PENALTIES
from forerun.server.schemas import ChatRequest, CommonRequest, CompletionRequest
from forerun.structured import check_response_format

if TYPE_CHECKING:
    from forerun.server.translate import Limits

MAX_STOPS = 4
"""As OpenAI."""
MAX_STOP_CHARS = 500
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}
"""As OpenAI: top_logprobs <= 20 in chat, logprobs <= 5 in completions."""
MAX_SALT_CHARS = 256
"""A cache salt names a tenant (a hash or an id), not a text."""
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
PENALTIES = ("repetition_penalty", *OPENAI_PENALTIES)
"""Settings that apply to greedy decoding too."""
MAX_LOGIT_BIAS = 300
"""Tokens one request may bias (`logit_bias`)."""
MAX_STOP_TOKENS = 64
"""Tokens one request may name in `stop_token_ids`."""


class APIError(Exception):
    """An error the client caused (or a limit it hit), sent as OpenAI's error shape with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def refuse(field_name: str, message: str) -> APIError:
    return APIError(400, message, field_name)


def checked(name: str, text: str) -> str:
    try:
        check_text(name, text)
    except ValueError as error:
        raise refuse(name, str(error)) from None
    return text


def stops_of(body: CommonRequest) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise refuse("stop", f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not stop:
            raise refuse("stop", f"stop[{i}] is empty: an empty stop sequence would end the answer at once")
        if len(stop) > MAX_STOP_CHARS:
            raise refuse("stop", f"stop[{i}] has {len(stop)} characters; at most {MAX_STOP_CHARS}")
        checked(f"stop[{i}]", stop)
    return stops


def sampling_of(body: CommonRequest, limits: Limits) -> dict:
    """Sampling settings: the request's fields, else the model's generation_config's; {} = greedy.

    Sampling happens when the temperature (the request's, else the model's default) is above 0, or when the
    request gives top_p, top_k or min_p without a temperature (OpenAI's default temperature is 1), or when the
    model's generation_config samples by default. The penalties (repetition, frequency, presence) apply to greedy
    decoding too.
    """
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    given |= {name: getattr(body, name) for name in OPENAI_PENALTIES if getattr(body, name) not in (None, 0)}
    for name, value in given.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise refuse(name, f"{name} must be a finite number, got {value}")
    if "temperature" in given and not (given["temperature"] == 0 or 1e-4 <= given["temperature"] <= 2):
        raise refuse(
            "temperature", f"temperature must be 0 (greedy) or between 0.0001 and 2, got {given['temperature']}"
        )
    if "top_k" in given and given["top_k"] < 1:
        raise refuse("top_k", f"top_k must be >= 1, got {given['top_k']}")
    defaults = {k: v for k, v in limits.sampling_defaults.items() if k in SAMPLING_FIELDS}
    settings = {**defaults, **given}
    if "temperature" in given:
        sample = given["temperature"] > 0
    else:
        sample = bool(limits.sampling_defaults.get("do_sample")) or bool(set(given) & {"top_p", "top_k", "min_p"})
    if not sample or settings.get("temperature") == 0:
        settings = {k: v for k, v in settings.items() if k in PENALTIES}
    else:
        settings["do_sample"] = True
    try:
        check_sampling(settings)
    except ValueError as error:
        name = str(error).split(" ", 1)[0]
        raise refuse(name, str(error)) from None
    return settings


def logprobs_of(body: CommonRequest, chat: bool) -> int | None:
    most = MAX_TOP_LOGPROBS["chat" if chat else "completions"]
    if chat:
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise refuse("top_logprobs", "top_logprobs needs logprobs: true")
        if not body.logprobs:
            return None
        top = 0 if top is None else top
        name = "top_logprobs"
    else:
        top, name = body.logprobs, "logprobs"
        if top is None:
            return None
    if not 0 <= top <= most:
        raise refuse(name, f"{name} must be between 0 and {most}, got {top}")
    return top


def prediction_of(body: ChatRequest) -> str | None:
    prediction = body.prediction
    if prediction is None:
        return None
    if prediction.get("type") != "content":
        raise refuse("prediction", "prediction.type must be 'content'")
    unknown = sorted(set(prediction) - {"type", "content"})
    if unknown:
        raise refuse("prediction", f"prediction: unrecognized field(s) {unknown}")
    content = prediction.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise refuse("prediction", "prediction.content parts must be text parts")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise refuse("prediction", "prediction.content must be a string or a list of text parts")
    return checked("prediction.content", content) or None


def check_stream_options(body: ChatRequest | CompletionRequest) -> None:
    """`stream_options` only with `stream`, and only `include_usage`, a boolean; else an APIError naming it."""
    if body.stream_options is None:
        return
    if not body.stream:
        raise refuse("stream_options", "stream_options needs stream: true")
    if set(body.stream_options) - {"include_usage"}:
        raise refuse("stream_options", f"stream_options takes include_usage only, got {sorted(body.stream_options)}")
    if not isinstance(body.stream_options.get("include_usage", False), bool):  # bool("false") is True
        raise refuse("stream_options", "stream_options.include_usage must be true or false")


def cache_salt_of(body: CommonRequest) -> str | None:
    salt = body.cache_salt
    if salt is None:
        return None
    if not salt or len(salt) > MAX_SALT_CHARS:
        raise refuse("cache_salt", f"cache_salt must be 1 to {MAX_SALT_CHARS} characters, got {len(salt)}")
    return checked("cache_salt", salt)


def min_tokens_of(body: CommonRequest, max_tokens: int) -> dict[str, int]:
    """vLLM's `min_tokens` as transformers' `min_new_tokens` (the end-of-text and stop ids masked until the answer
    holds that many tokens; stop strings still end it), or {} for none; an APIError outside [0, max_tokens].

    Example:
        >>> body = CompletionRequest(prompt="Hi", min_tokens=5)
        >>> min_tokens_of(body, 16), min_tokens_of(CompletionRequest(prompt="Hi", min_tokens=0), 16)
        ({'min_new_tokens': 5}, {})
    """
    if body.min_tokens is None or body.min_tokens == 0:
        return {}
    if not 0 <= body.min_tokens <= max_tokens:
        raise refuse("min_tokens", f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {body.min_tokens}")
    return {"min_new_tokens": body.min_tokens}


def logit_bias_of(body: CommonRequest, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` ({"token id": bias in [-100, 100]}) as {token: bias}; None where none is given. The
    bias is added to the token's logit before the other processors, as transformers' `sequence_bias` adds it (one
    token each), so the answer is what plain generate with that setting writes."""
    if not body.logit_bias:
        return None
    if len(body.logit_bias) > MAX_LOGIT_BIAS:
        raise refuse("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(body.logit_bias)}")
    biases = {}
    for key, value in body.logit_bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            vocabulary = f"[0, {vocab_size})" if vocab_size is not None else "of the vocabulary"
            raise refuse("logit_bias", f"logit_bias keys are token ids {vocabulary}, got {key!r:.40}")
        number_like = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number_like or not math.isfinite(value) or not -100 <= value <= 100:
            raise refuse("logit_bias", f"logit_bias[{key!r}] must be a number between -100 and 100, got {value!r:.40}")
        biases[token] = float(value)
    return biases


def eos_of(body: CommonRequest, limits: Limits) -> tuple[int, ...] | None:
    """The tokens that end the answer, from vLLM's `ignore_eos` and `stop_token_ids`: the model's own end-of-text
    ids (none with `ignore_eos`) and the stop ids, or None where the request names neither (the model's own).

    Example:
        >>> from forerun.server.translate import Limits
        >>> body = ChatRequest(messages=[{"role": "user", "content": "Hi"}], stop_token_ids=[7])
        >>> eos_of(body, Limits(model_name="m", eos_token_ids=(2,), vocab_size=100))
        (2, 7)
    """
    ids = body.stop_token_ids or []
    if not body.ignore_eos and not ids:
        return None
    if len(ids) > MAX_STOP_TOKENS:
        raise refuse("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKENS} ids, got {len(ids)}")
    vocab = limits.vocab_size
    for token in ids:
        if token < 0 or (vocab is not None and token >= vocab):
            raise refuse("stop_token_ids", f"stop_token_ids are token ids [0, {vocab}), got {token}")
    return tuple(sorted({*(() if body.ignore_eos else limits.eos_token_ids), *ids}))


def response_format_of(body: CommonRequest, eos: tuple[int, ...] | None) -> dict[str, Any] | None:
    """The checked `response_format` (None for free text), or an APIError naming it; a JSON answer ends at an
    end-of-text token, so one with `ignore_eos` and no `stop_token_ids` is refused.

    Example:
        >>> body = ChatRequest(messages=[{"role": "user", "content": "Hi"}], response_format={"type": "json"})
        >>> response_format_of(body, None)
        Traceback (most recent call last):
        ...
        forerun.server.fields.APIError: response_format's type must be one of text, json_object, json_schema, got 'json'
    """
    try:
        response_format = check_response_format(body.response_format)
    except ValueError as error:
        raise refuse("response_format", str(error)) from None
    if response_format is not None and eos == ():
        message = "a response_format answer ends at an end-of-text token: with ignore_eos, give stop_token_ids"
        raise refuse("ignore_eos", message)
    return response_format
