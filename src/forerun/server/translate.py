"""Request -> generation arguments: pure, so every 400 is decided (and tested) without a model or a server.

Example:
    >>> limits = Limits(model_name="smollm2-135m", method="auto")
    >>> args = translate(ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    ...                              max_tokens=8, stop="\\n"), limits)
    >>> args.prompt, args.max_new_tokens, args.stop, args.sampling
    ([{'role': 'user', 'content': 'Hi'}], 8, ['\\n'], {})
    >>> translate(ChatRequest(messages=[{"role": "user", "content": "Hi"}], audio={"voice": "alloy"}), limits)
    Traceback (most recent call last):
    ...
    forerun.server.fields.APIError: audio output is not supported: this server runs a plain text model
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from forerun.defaults import DEFAULT_METHOD
from forerun.fim import FimMarks, infill_prompt
from forerun.methods import parse_method, plan_method
from forerun.request import GenerationRequest, check_continued
from forerun.server.completion_prompts import prompts_of
from forerun.server.fields import (
    APIError,
    cache_salt_of,
    check_stream_options,
    checked,
    eos_of,
    logit_bias_of,
    logprobs_of,
    min_tokens_of,
    prediction_of,
    refuse,
    response_format_of,
    sampling_of,
    stops_of,
)
from forerun.server.messages import chat_messages
from forerun.server.schemas import ChatRequest, CommonRequest, CompletionRequest
from forerun.server.tool_fields import tools_of
from forerun.template_kwargs import FIELD, checked_template_kwargs

__all__ = ["APIError", "GenerationArgs", "Limits", "translate"]
MAX_CHOICES = 16
EFFORTS = ("none", "minimal", "low", "medium", "high")
"""OpenAI's `reasoning_effort` values."""
"""Choices one request may ask for (`n`): each sampled one is a row of its own in the batch."""


@dataclass(frozen=True)
class Limits:
    """What this server serves and allows."""

    model_name: str
    aliases: tuple[str, ...] = ()
    """Other names a request's `model` may give the model (`ServerConfig.aliases`)."""
    method: str = DEFAULT_METHOD
    knobs: dict = field(default_factory=dict)
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    sampling_defaults: dict = field(default_factory=dict)
    """The model's own generation_config sampling settings (do_sample, temperature, top_p, top_k, min_p,
    repetition_penalty) for the fields a request leaves out; empty: greedy."""
    device_type: str = "cpu"
    request_methods: tuple[str, ...] | None = None
    """Methods a request may name besides the server's (None: any; `ServerConfig.request_methods`)."""
    head: bool = False
    """Whether the server drafts with a trained head ('auto' then includes it, and its knobs route to it)."""
    vocab_size: int | None = None
    """Token ids `logit_bias` may name: [0, vocab_size) (None: unchecked here; the processor would fail)."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's own end-of-text ids (`stop_token_ids` add to them; `ignore_eos` drops them)."""
    tools: bool = False
    """Whether the chat template teaches tool calls in the format forerun reads (`forerun.tool_specs.takes_tools`)."""
    template_variables: frozenset[str] = frozenset()
    """The variables of the chat template a request may set (`forerun.template_kwargs`)."""
    context: int | None = None
    """The model's context length in tokens (`/tokenize`'s `max_model_len`), where its config gives one."""
    template_defaults: dict = field(default_factory=dict)
    """Variables given to the template for every chat request (`ServerConfig.chat_template_kwargs`), checked."""
    short_call_ids: bool = False
    """Whether it takes only 9-character call ids (`forerun.tool_specs.short_call_ids`): the calls answered get such."""
    call_mark: int | None = None
    """The special token its calls open with where the decoded text drops it (`forerun.tool_specs.call_mark`)."""
    fim: FimMarks | None = None
    """The tokenizer's fill-in-the-middle marks (`forerun.fim`): a completion's `suffix` is taken where it has them."""
    developer: bool = False
    """Whether its chat template names the developer role (else such messages are system messages:
    `forerun.server.messages.as_system`)."""


@dataclass(frozen=True)
class GenerationArgs:
    """Everything `Decoder.generate` and the response need from one request."""

    prompt: str | list[dict] | list[int]
    chat: bool
    method: str
    knobs: dict
    max_new_tokens: int
    stop: list[str]
    sampling: dict
    """do_sample and the processors' settings; empty = greedy."""
    seed: int | None
    logprobs: int | None
    """None: none asked; k: the chosen token's log-probability and k alternatives."""
    prediction: str | None
    stream: bool
    include_usage: bool
    cache_salt: str | None = None
    """Prefix-cache entries are shared only among requests with the same salt (None: the unsalted ones)."""
    n: int = 1
    """Choices asked for (OpenAI's `n`)."""
    logit_bias: dict[int, float] | None = None
    """A bias added to each named token's logit (OpenAI's `logit_bias`, transformers' `sequence_bias`)."""
    eos_token_id: tuple[int, ...] | None = None
    """The ids that end the answer (vLLM's `ignore_eos`, `stop_token_ids`); None: the model's own."""
    response_format: dict[str, Any] | None = None
    """OpenAI's, checked (`forerun.structured`); None: free text."""

    prompts: tuple[str | list[dict] | list[int], ...] = ()
    """Every prompt of the request (a completions request may send several: `each`); `prompt` is the first."""
    echo: bool = False
    """The prompt shown before each choice's text (a completion's `echo`), its tokens' logprobs with `logprobs`."""
    tools: tuple[dict, ...] = ()
    """A chat request's tools, checked (`forerun.tool_specs`)."""
    tool_choice: str = "none"
    """'none', 'auto', 'required' or the one function's name."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """A chat request's own variables for the chat template, checked (`forerun.template_kwargs`)."""
    continued: bool = False
    """The last message, an assistant's, is continued (`GenerationRequest.continue_final_message`)."""

    @property
    def runs(self) -> int:
        """Generations the choices take: one each where they are sampled, one for all where they are not (greedy
        choices are the same text, written once and shown `n` times); none where nothing is generated (an
        echoed prompt alone, `max_tokens` 0)."""
        if self.max_new_tokens == 0:
            return 0
        return self.n if self.sampling.get("do_sample") else 1

    def each(self) -> list[GenerationArgs]:
        """The arguments of each prompt's group of choices, in order."""
        return [dataclasses.replace(self, prompt=prompt, prompts=(prompt,)) for prompt in self.prompts or [self.prompt]]

    def request(
        self, streamer: object | None = None, cancel: threading.Event | None = None, choice: int = 0
    ) -> GenerationRequest:
        """The `GenerationRequest` of choice `choice`, with the server's own streamer and cancel event: choice i
        of a seeded request is seeded seed + i (as row i of a batch in `Decoder.generate`), so it writes what a
        request of n=1 with that seed writes."""
        return GenerationRequest.of(
            self.prompt,
            self.max_new_tokens,
            chat=self.chat,
            stop=tuple(self.stop),
            seed=None if self.seed is None else self.seed + choice,
            prediction=self.prediction,
            logprobs=self.logprobs,
            cache_salt=self.cache_salt,
            eos_token_id=self.eos_token_id,
            response_format=self.response_format,
            tools=self.tools or None,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            chat_template_kwargs=self.chat_template_kwargs,
            continue_final_message=self.continued,
            streamer=streamer,
            cancel=cancel,
            **self.sampling,  # do_sample and the processors' settings
            **({} if not self.logit_bias else {"sequence_bias": {(t,): b for t, b in self.logit_bias.items()}}),
        )


def unsupported(body: CommonRequest) -> None:
    """Fields OpenAI defines that this server cannot honour: refused when set to anything but their no-op."""
    checks: list[tuple[str, Any, str]] = []
    if isinstance(body, ChatRequest):
        plain = "this server runs a plain text model"
        checks += [
            ("functions", body.functions, "functions is OpenAI's old form of tools: send tools"),
            ("audio", body.audio, f"audio output is not supported: {plain}"),
            ("web_search_options", body.web_search_options, f"web search is not supported: {plain}"),
        ]
        if body.function_call not in (None, "none"):
            checks.append(("function_call", body.function_call, "function_call is OpenAI's old form: send tool_choice"))
        if body.modalities not in (None, ["text"]):
            checks.append(("modalities", body.modalities, "only the text modality is supported"))
        # Accepted and ignored, these would promise what the server does not do: refused, each by name. (metadata
        # is accepted: labels for a stored completion, and nothing is stored, as `store` says.)
        checks += [
            ("store", body.store, "store is not supported: this server keeps no completions (store: false)"),
        ]
        if body.service_tier not in (None, "auto", "default"):
            checks.append(("service_tier", body.service_tier, "service_tier takes 'auto' or 'default' (one tier)"))
    else:
        if body.best_of not in (None, 1):
            checks.append(("best_of", body.best_of, f"best_of={body.best_of} is not supported: one choice (best_of=1)"))

    for name, value, message in checks:
        if value not in (None, [], {}):
            raise refuse(name, message)


def echo_of(body: ChatRequest | CompletionRequest) -> bool:
    return isinstance(body, CompletionRequest) and bool(body.echo)


def translate(body: ChatRequest | CompletionRequest, limits: Limits) -> GenerationArgs:
    """The generation a request asks for, or an APIError saying which field is wrong and why."""
    chat = isinstance(body, ChatRequest)
    check_model(body.model, limits)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise refuse("n", f"n must be between 1 and {MAX_CHOICES} (choices per request), got {n}")
    unsupported(body)
    tools, tool_choice, parallel = tools_of(body, limits.tools) if chat else ((), "none", True)
    if chat:
        prompts: list = [chat_messages(body, limits.developer)]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    else:
        prompts = prompts_of(body.prompt, limits.vocab_size)
        if body.suffix:
            prompts = [filled(body, prompts, limits.fim)]
        max_tokens, field_name = body.max_tokens, "max_tokens"
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_tokens_limit)
    least = 0 if echo_of(body) else 1  # an echoed prompt alone: its tokens' logprobs, nothing generated
    if not least <= max_tokens <= limits.max_tokens_limit:
        raise refuse(
            field_name, f"{field_name} must be between {least} and {limits.max_tokens_limit}, got {max_tokens}"
        )
    if body.seed is not None and not 0 <= body.seed <= 2**63 - n:  # choice i is seeded seed + i
        raise refuse("seed", f"seed must be between 0 and 2**63 - {n}, got {body.seed}")
    check_stream_options(body)
    method, knobs = method_of(body, limits)
    eos = eos_of(body, limits)
    return GenerationArgs(
        prompt=prompts[0],
        prompts=tuple(prompts),
        echo=echo_of(body),
        chat=chat,
        method=method,
        knobs=knobs,
        max_new_tokens=max_tokens,
        stop=stops_of(body),
        sampling=sampling_of(body, limits) | min_tokens_of(body, max_tokens),
        seed=body.seed,
        logprobs=logprobs_of(body, chat),
        prediction=prediction_of(body) if chat else None,
        stream=body.stream,
        include_usage=bool((body.stream_options or {}).get("include_usage", False)),
        cache_salt=cache_salt_of(body),
        n=n,
        logit_bias=logit_bias_of(body, limits.vocab_size),
        eos_token_id=eos,
        response_format=response_format_of(body, eos),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs_of(body, limits) if chat else None,
        continued=chat and continued_of(body, prompts[0]),
    )


def template_kwargs_of(body: ChatRequest, limits: Limits) -> dict[str, Any] | None:
    """A chat request's `chat_template_kwargs`, each a variable the chat template reads, and its
    `reasoning_effort` given to the template as vLLM gives it (gpt-oss's reads one), over the server's own
    (`template_defaults`); else a 400 naming the field."""
    own = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        if "reasoning_effort" not in limits.template_variables:
            why = "this model's chat template reads no reasoning_effort (its thought's length is its own)"
            raise refuse("reasoning_effort", f"reasoning_effort is not supported: {why}")
        if body.reasoning_effort not in EFFORTS:
            raise refuse("reasoning_effort", f"reasoning_effort must be one of {', '.join(EFFORTS)}")
        if own.setdefault("reasoning_effort", body.reasoning_effort) != body.reasoning_effort:
            raise refuse("reasoning_effort", "reasoning_effort differs from chat_template_kwargs' reasoning_effort")
    kwargs = {**limits.template_defaults, **own}
    if not kwargs:
        return None
    try:
        return checked_template_kwargs(kwargs, limits.template_variables)
    except ValueError as error:
        raise refuse(FIELD, str(error)) from None


def filled(body: CompletionRequest, prompts: list, marks: FimMarks | None) -> str:
    """A completion with a `suffix`: the fill-in-the-middle prompt of its one text prompt and the suffix, in the
    tokenizer's own marks (`forerun.fim`); else a 400 naming the field."""
    if marks is None:
        why = "this model's tokenizer has no fill-in-the-middle tokens (<|fim_prefix|>, <fim_prefix>, ...)"
        raise refuse("suffix", f"suffix is not supported: {why}")
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise refuse("prompt", "a completion with a suffix takes one text prompt (the text before the gap)")
    if body.echo:
        raise refuse("echo", "echo and suffix cannot be used together")
    return infill_prompt(marks, prompts[0], checked("suffix", body.suffix))


def continued_of(body: ChatRequest, messages: list[dict]) -> bool:
    """Whether a chat request continues its last message (vLLM's `continue_final_message`, with
    `add_generation_prompt` false or left out), checked: the last message is an assistant's text."""
    if not body.continue_final_message:
        if body.add_generation_prompt is False:
            why = "the answer is the assistant's turn: to continue the last message, set continue_final_message"
            raise refuse("add_generation_prompt", f"add_generation_prompt false alone is not supported: {why}")
        return False
    if body.add_generation_prompt:
        raise refuse("add_generation_prompt", "add_generation_prompt and continue_final_message: give one")
    try:
        check_continued(messages, True)
    except ValueError as error:
        raise refuse("continue_final_message", str(error)) from None
    return True


def check_model(model: str | None, limits: Limits) -> None:
    """A request that names a model names the one served (404 otherwise)."""
    if model not in (None, limits.model_name, *limits.aliases):
        names = ", ".join(repr(name) for name in (limits.model_name, *limits.aliases))
        message = f"model {model!r:.200} is not served here; this server runs {names}"
        raise APIError(404, message, "model", "not_found_error")


def method_of(body: ChatRequest | CompletionRequest, limits: Limits) -> tuple[str, dict]:
    """(method, knobs) of the request's `forerun` field (the server's own where it names none), checked and
    admitted by the server's `request_methods`; else an APIError naming `forerun`."""
    options = dict(body.forerun or {})
    method = options.pop("method", limits.method)
    knobs = options if options or method != limits.method else dict(limits.knobs)
    try:
        plan_method(method, knobs, limits.device_type, head=limits.head)  # a bad method or knob: refused here
    except (ValueError, TypeError) as error:
        raise refuse("forerun", str(error)) from None
    allowed = limits.request_methods
    if allowed is not None and method != limits.method and not admitted(method, allowed):
        offered = ", ".join([limits.method, *allowed])
        raise refuse("forerun", f"method {method!r} is not enabled on this server (it offers: {offered})")
    return method, knobs


def admitted(method: str, allowed: tuple[str, ...]) -> bool:
    """Whether an operator's list of methods (`--request-methods`) admits a request's `method` expression: every
    part it names is listed ('auto' admits 'auto'), or every method it stands for is (prompt_lookup, trie and
    jacobi admit 'auto'). A head the server adds to 'auto' is the operator's, not the request's pick.

    Example:
        >>> admitted("auto", ("auto",)), admitted("auto", ("prompt_lookup", "trie", "jacobi"))
        (True, True)
        >>> admitted("trie", ("auto",)), admitted("auto+eagle3", ("auto",)), admitted("plain", ())
        (False, False, True)
    """
    listed = set(allowed)
    parts = {part.strip() for part in method.split("+")}
    return parts <= listed or {spec.name for spec in parse_method(method)} <= listed
