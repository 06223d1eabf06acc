"""One generation request: every per-request setting in one frozen object, checked where it is made.

`Decoder.generate`, `Decoder.generate_each` and `Decoder.prepare` take it; the server's translation and `forerun run`
build one per request or record, so rows with different settings share a batch. A new request field is a field
here, its check in `__post_init__`, and where the Decoder reads it.

Example:
    >>> request = GenerationRequest("def fib(n):", 64, stop=("\\n\\n",), do_sample=True, seed=3,
    ...                             generation={"temperature": 0.7})
    >>> request.stop, request.processed
    (('\\n\\n',), True)
    >>> GenerationRequest.of("Hi", 16, temperature=0.5, do_sample=True).generation
    {'temperature': 0.5}
    >>> GenerationRequest("Hi", 0)
    Traceback (most recent call last):
    ...
    ValueError: max_new_tokens must be a positive integer, got 0
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from forerun.checks import check_decoding_mode, check_logprobs, check_sampling, check_seed, check_stops
from forerun.penalties import REQUEST_FIELDS as PENALTY_FIELDS
from forerun.structured import check_response_format
from forerun.tool_specs import check_tool_choice, check_tools, held_calls

Prompt = str | Sequence[dict] | Sequence[int] | torch.Tensor
"""Text, chat messages ([{"role": ..., "content": ...}]), token ids, or input_ids [1, L]."""


@dataclass(frozen=True)
class GenerationRequest:
    """What one answer is asked with. Greedy unless `do_sample` or `generation` says otherwise; the answer is the
    model's own either way (drafts never change it)."""

    prompt: Prompt
    max_new_tokens: int = 256
    chat: bool = False
    """Wrap a text prompt as one user message in the chat template."""
    stop: tuple[str, ...] = ()
    """Strings that end the answer (the token that completes one is the last)."""
    eos_token_id: int | tuple[int, ...] | None = None
    """The ids that end an answer (None: the model's own; () for none)."""
    do_sample: bool = False
    seed: int | None = None
    """Fixes a sampled answer, whichever method drafts it (`forerun.noise`)."""
    generation: Mapping[str, object] = field(default_factory=dict)
    """transformers generation settings: temperature, top_k, top_p, min_p, repetition_penalty, ..."""
    frequency_penalty: float = 0.0
    """OpenAI's: each token's logit lowered by this much per time the answer already holds it, in [-2, 2]."""
    presence_penalty: float = 0.0
    """OpenAI's: each token's logit lowered by this much once the answer holds it, in [-2, 2]
    (`forerun.penalties`)."""
    response_format: Mapping[str, object] | None = None
    """OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    holds the answer to JSON (`forerun.structured`); None or {"type": "text"}: free text."""
    tools: Sequence[Mapping[str, object]] | None = None
    """OpenAI's function tools ({"type": "function", "function": {"name", "description", "parameters"}}), shown to
    the model through its chat template; the calls it writes are read out of its answer
    (`GenerationResult.tool_calls`, `forerun.tool_specs`)."""
    tool_choice: str | Mapping[str, object] | None = None
    """'auto' (the default with tools), 'none' (not shown), 'required' or {"type": "function", "function": {"name":
    ...}} (or the name alone): the last two hold the answer to calls, as `response_format` holds one to JSON. Kept
    as one string: 'auto', 'none', 'required' or the function's name."""
    parallel_tool_calls: bool = True
    """Whether a required call may be several (False: exactly one)."""
    chat_template_kwargs: Mapping[str, object] | None = None
    """Variables the chat template reads, given to it (Qwen3's `{"enable_thinking": False}`); each must be one it
    reads (`forerun.template_kwargs`)."""
    continue_final_message: bool = False
    """The last message, an assistant's, is continued: its text is the answer's beginning, the answer what follows
    (Anthropic's prefill, vLLM's and transformers' `continue_final_message`); no new turn is opened after it."""
    prediction: str | tuple[int, ...] | None = None
    """Text or ids the answer is expected to resemble, drafted from (OpenAI's predicted outputs)."""
    logprobs: int | None = None
    """k: each new token's log-probability under the raw model and its k likeliest alternatives."""
    cache_salt: str | None = None
    """Prefix-cache entries are reused (and left) only among requests with the same salt."""
    streamer: object | None = None
    """A transformers streamer: put(prompt ids), put(new ids)..., end()."""
    cancel: threading.Event | None = None
    """Set from another thread: the answer ends after the current step, with the tokens made so far."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens <= 0
        ):
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        set_field = object.__setattr__.__get__(self)  # frozen: normalised values are set once, here
        set_field("stop", tuple(check_stops(self.stop)))
        check_seed(self.seed)
        check_logprobs(self.logprobs)
        if not isinstance(self.generation, Mapping):
            raise ValueError(f"generation must be a mapping of transformers settings, got {self.generation!r:.40}")
        set_field("generation", dict(self.generation))
        check_generation_kwargs(self.generation)
        check_sampling({name: getattr(self, name) for name in PENALTY_FIELDS})
        set_field("response_format", check_response_format(self.response_format))
        self.check_tools(set_field)
        if self.processed:
            try:
                config = GenerationConfig(do_sample=self.do_sample, **self.generation)
                config.validate(strict=True)
            except (TypeError, ValueError) as error:
                raise ValueError(f"invalid generation settings {self.generation}: {error}") from error
            check_decoding_mode(config)
        check_hooks(self.prediction, self.cancel, self.streamer)
        if isinstance(self.prediction, list):
            set_field("prediction", tuple(self.prediction))
        if isinstance(self.eos_token_id, list):
            set_field("eos_token_id", tuple(self.eos_token_id))
        if self.chat_template_kwargs is not None:
            if not isinstance(self.chat_template_kwargs, Mapping):
                kind = type(self.chat_template_kwargs).__name__
                raise ValueError(f"chat_template_kwargs must be a mapping of the template's variables, got {kind}")
            set_field("chat_template_kwargs", dict(self.chat_template_kwargs))
        if self.continue_final_message is not False:
            check_continued(self.prompt, self.continue_final_message)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")

    @classmethod
    def of(cls, prompt: Prompt, max_new_tokens: int = 256, **options: object) -> GenerationRequest:
        """A request from `generate`-style keywords: this class's fields by name, every other keyword a
        transformers generation setting (`temperature=0.7`); `stop=None`, `prediction=None` and a penalty of None
        mean none."""
        names = {f.name for f in dataclasses.fields(cls)} - {"prompt", "max_new_tokens", "generation"}
        given = {name: options.pop(name) for name in list(options) if name in names}
        for name in ("stop", *PENALTY_FIELDS):  # None: none (as a JSON null says)
            if given.get(name) is None:
                given.pop(name, None)
        return cls(prompt, max_new_tokens, generation=options, **given)  # type: ignore[arg-type]

    def check_tools(self, set_field) -> None:
        """`tools` and `tool_choice` checked and normalised (`forerun.tool_specs`)."""
        set_field("tools", check_tools(self.tools) or None)
        set_field("tool_choice", check_tool_choice(self.tool_choice, self.tools or ()))
        if not isinstance(self.parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls must be true or false, got {self.parallel_tool_calls!r:.40}")
        if self.tools and self.tool_choice != "none" and self.response_format is not None:
            raise ValueError("tools and response_format cannot be used together: give one (or tool_choice 'none')")

    @property
    def shown_tools(self) -> tuple[dict, ...] | None:
        """The tools the chat template shows the model (None: none, or tool_choice 'none')."""
        return self.tools if self.tool_choice != "none" else None

    @property
    def held_format(self) -> Mapping[str, object] | None:
        """What the answer is held to: its `response_format`, or calls where `tool_choice` requires them (in the
        format the chat template teaches: `forerun.tool_grammar.calls_grammar`), or, under tool_choice auto with a
        `strict` function, any call it opens ("lazy": free text until then); None: free text."""
        held = held_calls(self.tools or (), self.tool_choice, self.parallel_tool_calls)
        return held if held is not None else self.response_format

    @property
    def processed(self) -> bool:
        """Whether logits processors run (sampling, any generation setting, a penalty, a held format)."""
        return self.do_sample or bool(self.generation) or self.penalised or self.held_format is not None

    @property
    def penalised(self) -> bool:
        """Whether OpenAI's frequency or presence penalty applies (`forerun.penalties`)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0


NOT_REQUEST_SETTINGS = {
    "stop_strings": "stop=[...] (the answer's text ends before the first)",
    "num_return_sequences": "a batch of the prompt n times, each with its own seed",
    "return_dict_in_generate": "the GenerationResult (sequences, text, stats, logprobs)",
    "output_scores": "logprobs=k",
    "output_logits": "logprobs=k",
    "output_attentions": "model.generate without forerun",
    "output_hidden_states": "model.generate without forerun",
}
"""transformers settings that shape generate's return value, not the answer: each request has its own way."""


def check_generation_kwargs(generation_kwargs: Mapping[str, object]) -> None:
    """Unknown names are refused (a method knob passed here by mistake is named as such), and the settings that
    shape generate's return value (`NOT_REQUEST_SETTINGS`, each with what to use instead); values range-checked."""
    defaults = GenerationConfig()
    unknown = sorted(name for name in generation_kwargs if not hasattr(defaults, name))
    if unknown:
        raise ValueError(
            f"unknown generation argument(s) {unknown}; method knobs belong to Decoder(...) "
            "(or knobs={...} in forerun.generate)"
        )
    for name, instead in NOT_REQUEST_SETTINGS.items():
        value = generation_kwargs.get(name)
        if value is None or value is False or (name == "num_return_sequences" and value == 1 and value is not True):
            continue
        raise ValueError(f"{name} is not a setting of a forerun request; use {instead}")
    check_sampling(dict(generation_kwargs))


def check_hooks(prediction: object, cancel: object, streamer: object) -> None:
    """The per-request objects a caller hands over, checked by what they must be able to do (ValueError naming
    the argument, before anything runs)."""
    if prediction is not None and not isinstance(prediction, str):
        if not isinstance(prediction, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prediction
        ):
            raise ValueError(f"prediction must be text or a list of token ids, got {prediction!r:.40}")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ValueError(f"cancel must be a threading.Event (or have is_set()), got {cancel!r:.40}")
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        raise ValueError(f"streamer must have put() and end() (a transformers streamer), got {streamer!r:.40}")


def is_batch(prompt: object) -> bool:
    """A list of prompts (strings, message lists, id lists, tensors or requests) or a [rows > 1, L] tensor, not
    one prompt."""
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 2 and prompt.shape[0] > 1
    if isinstance(prompt, (list, tuple)) and prompt:
        return isinstance(prompt[0], (str, list, tuple, torch.Tensor, GenerationRequest))
    return False


def check_continued(prompt: Prompt, continued: object) -> None:
    """A request that continues its final message (`continue_final_message`) gives messages ending with an
    assistant's text; else a ValueError saying what is wrong.

    Example:
        >>> check_continued([{"role": "user", "content": "Hi"}], True)
        Traceback (most recent call last):
        ...
        ValueError: continue_final_message continues the last message, an assistant's; the last is a user's
    """
    if continued is not True:
        raise ValueError(f"continue_final_message must be true or false, got {continued!r:.40}")
    last = prompt[-1] if isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) else None
    if not isinstance(last, Mapping):
        raise ValueError("continue_final_message needs chat messages, the last an assistant's")
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or not last["content"].strip():
        role = last.get("role")
        whose = f"a {role}'s" if isinstance(role, str) and role != "assistant" else "without text to continue"
        raise ValueError(f"continue_final_message continues the last message, an assistant's; the last is {whose}")
