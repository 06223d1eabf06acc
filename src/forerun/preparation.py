"""A request made ready to decode, and its result once it ends: the ids that end an answer, the stopping
criteria and logits processors (exactly those transformers builds for the request's settings), the row it becomes
(`Prepared`), and the `GenerationResult` a finished row gives.

Example:
    >>> eos_ids_of(model, [2, 7])                                         # doctest: +SKIP
    frozenset({2, 7})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from forerun.base.weights import vocabulary_rows
from forerun.checks import check_decoding_mode, row_seeds
from forerun.penalties import OccurrencePenalty
from forerun.prompts import check_kinds
from forerun.request import GenerationRequest, Prompt
from forerun.result import GenerationResult
from forerun.row import RowJob
from forerun.stats import GenerationStats
from forerun.stopping import Cancelled, StopStrings, first_stop
from forerun.structured import Constraint, Grammars
from forerun.text import complete
from forerun.thoughts import opened_by, thought_in, thought_marks
from forerun.tool_calls import marked_at, read_answer
from forerun.tool_specs import parameters_of


def eos_ids_of(model: torch.nn.Module, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The token ids that end an answer: `eos_token_id` (one id or a list; [] for none), else the model's own.
    An id that is not an integer in the model's vocabulary is a ValueError naming the argument."""
    given = eos_token_id is not None
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not given:
        return frozenset(ids)
    vocab = vocabulary_rows(model)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise ValueError(f"eos_token_id must be a token id or a list of token ids, got {eos_token_id!r:.40}")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"eos_token_id must hold token ids in [0, {vocab}), got {token!r:.40}")
    return frozenset(ids)


@dataclass(frozen=True)
class Prepared:
    """A request set up as a row: the row (`RowJob`), the request it came from, its prediction's length in tokens."""

    job: RowJob
    request: GenerationRequest
    prediction_tokens: int = 0


def as_request(prompt: Prompt | GenerationRequest, max_new_tokens: int, options: dict) -> GenerationRequest:
    """The request a `generate` call stands for: the one given (with no other options), or one built from them."""
    if isinstance(prompt, GenerationRequest):
        if options:
            raise ValueError(f"a GenerationRequest carries its own settings; got {sorted(options)} besides")
        return prompt
    return GenerationRequest.of(prompt, max_new_tokens, **options)


def seeded(seed: int | None) -> torch.Generator | None:
    """The generator a `seed` stands for (on the CPU: the same seed gives the same noise on every device); None:
    torch's global one."""
    return torch.Generator().manual_seed(seed) if seed is not None else None


def request_criteria(
    model: torch.nn.Module,
    tokenizer,
    ids: torch.Tensor,
    request: GenerationRequest,
    eos: frozenset[int],
    grammars: Grammars | None = None,
) -> tuple[LogitsProcessorList | None, StoppingCriteriaList]:
    """The request's logits processors (None when greedy) and stopping criteria: its length, EOS, stop strings,
    cancel, and any criterion transformers builds from its generation settings (e.g. max_time). `grammars`: the
    Decoder's, for a request with a response format."""
    prompt_len = ids.shape[1]
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=prompt_len + request.max_new_tokens)])
    if eos:
        criteria.append(EosTokenCriteria(eos_token_id=sorted(eos)))
    if request.stop:
        criteria.append(StopStrings(tokenizer, list(request.stop), prompt_len))
    if request.cancel is not None:
        criteria.append(Cancelled(request.cancel))
    if not request.processed and not config_processes(model.generation_config):
        return None, criteria
    constraint = None
    if request.held_format is not None:
        if grammars is None:
            raise ValueError("response_format and required tool calls need the Decoder's tokenizer")
        constraint = grammars.constraint(request.held_format, prompt_len, eos, ids[0].tolist())
    processor, theirs = transformers_processors(model, ids, request, tokenizer, constraint)
    criteria.extend(c for c in theirs if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)))
    return processor or None, criteria


GREEDY_INERT = frozenset(
    {"transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "use_cache"}
    | {"output_attentions", "output_hidden_states", "max_length", "max_new_tokens", "cache_implementation"}
    | {"do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p"}  # sampling's: a request samples or not
)
"""Settings of a model's generation config that build no processor or criterion for a greedy request (the ids,
lengths forerun sets itself, and the sampling warpers, which only a sampled request gets)."""


def config_processes(config: GenerationConfig) -> bool:
    """Whether a model's own generation config makes `model.generate(do_sample=False)` process the logits or stop
    by more than length and EOS (a `repetition_penalty` or `no_repeat_ngram_size` an instruct model ships with,
    `stop_strings`...): then every request is prepared as generate prepares it, greedy ones too.

    Example:
        >>> config_processes(GenerationConfig(eos_token_id=2, temperature=0.7, top_p=0.8))
        False
        >>> config_processes(GenerationConfig(repetition_penalty=1.05))
        True
    """
    return any(not key.startswith("_") and key not in GREEDY_INERT for key in config.to_diff_dict())


def transformers_processors(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    request: GenerationRequest,
    tokenizer=None,
    constraint: Constraint | None = None,
) -> tuple[LogitsProcessorList, StoppingCriteriaList]:
    """The logits processors and stopping criteria `model.generate` builds for this prompt alone (temperature,
    top-p, penalties, the model's own generation config...; OpenAI's penalties and the response format's
    `constraint` as a caller's processors), taken from its `custom_generate` hook before any forward runs
    (`tokenizer`: for stop strings the model's generation config may carry, which stop as generate stops: after
    the token that completes one)."""
    extra = {}
    if request.eos_token_id is not None:
        eos = request.eos_token_id
        extra["eos_token_id"] = list(eos) if not isinstance(eos, int) else eos
    settings = {"pad_token_id": pad_token_of(model), **extra, **request.generation}  # the request's pad id wins
    stops = model.generation_config.stop_strings
    if stops:  # transformers hands a callable custom_generate no tokenizer: the criterion is built here
        if tokenizer is None:
            raise ValueError("the model's generation config sets stop_strings: give the Decoder its tokenizer")
        settings["stop_strings"] = None
    callers = LogitsProcessorList()  # placed as generate places a caller's processors: before the sampling warpers
    if request.penalised:
        callers.append(OccurrencePenalty(request.frequency_penalty, request.presence_penalty, input_ids.shape[1]))
    if constraint is not None:  # last: the penalties move logits, the mask rules tokens out
        callers.append(constraint)
    if callers:
        settings["logits_processor"] = callers
    processor, criteria = model.generate(
        input_ids.to(model.device),
        max_new_tokens=request.max_new_tokens,
        do_sample=request.do_sample,
        custom_generate=processors_only,
        **settings,
    )
    if stops:
        criteria.append(StopStringCriteria(tokenizer, [stops] if isinstance(stops, str) else list(stops)))
    return processor, criteria


def finished_result(tokenizer, prepared: Prepared, stats: GenerationStats, mark: int | None = None) -> GenerationResult:
    """A finished row's GenerationResult; `mark`: the special token its template's calls open with
    (`forerun.tool_specs.call_mark`), where the decoded text drops it."""
    transcript, prompt_len = prepared.job.transcript, prepared.job.input_ids.shape[1]
    sequences = transcript.sequence.cpu()
    text = None
    if tokenizer is not None:  # an answer cut inside a multi-byte character ends before it, not in U+FFFD
        text = complete(tokenizer.decode(sequences[0, prompt_len:], skip_special_tokens=True))
    logprobs = list(transcript.logprobs) if prepared.request.logprobs is not None else None
    stop_at = first_stop(text, prepared.request.stop) if text is not None else None
    new = sequences[0, prompt_len:].tolist()
    ended = bool(new) and new[-1] in prepared.job.eos
    full = len(new) >= prepared.request.max_new_tokens
    reason = "length" if stop_at is None and not ended and full else "stop"
    calls = at = thought = None
    if text is not None and (marks := thought_marks(tokenizer)) is not None:
        thought = thought_in(tokenizer, marks, new, opened_by(tokenizer, marks, prepared.job.input_ids[0].tolist()))
    if text is not None and prepared.request.shown_tools:
        at = marked_at(tokenizer, new, mark)  # Mistral's or LFM2's mark, after a thought or words
        shown = text if stop_at is None else text[:stop_at]
        calls = read_answer(shown, thought, parameters_of(prepared.request.shown_tools), at)[1]
        reason = "tool_calls" if calls and reason == "stop" else reason
    return GenerationResult(
        sequences,
        prompt_len,
        text,
        stats,
        transcript.sources,
        logprobs,
        prepared.prediction_tokens,
        reason,
        stop_at,
        calls,
        at,
        thought,
    )


def pad_token_of(model: torch.nn.Module) -> int | None:
    """The pad id generate uses: the model's own, else its (first) EOS id, else 0."""
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return eos if isinstance(eos, int) else (eos[0] if eos else 0)


def processors_only(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """A `custom_generate` that decodes nothing: it returns the processors and criteria transformers prepared,
    once the request's settings over the model's generation config ask for a way of decoding forerun does."""
    check_decoding_mode(generation_config, "the model's generation config with this request's settings")
    return logits_processor, stopping_criteria


def requests_of(
    prompts: Sequence[Prompt | GenerationRequest] | torch.Tensor, max_new_tokens: int, options: dict
) -> list[GenerationRequest]:
    """A batch's requests: the given ones, or one per prompt with the shared options (row i seeded seed + i).

    Example:
        >>> [(r.prompt, r.seed) for r in requests_of(["a", "b"], 8, {"seed": 3})]
        [('a', 3), ('b', 4)]
    """
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("the batch of prompts is empty")
    if all(isinstance(p, GenerationRequest) for p in prompts):
        if options:
            raise ValueError(f"give each GenerationRequest its own settings, not {sorted(options)}")
        return prompts  # type: ignore[return-value]
    if options.get("streamer") is not None:
        raise ValueError("streamer= follows one prompt; give each row its own GenerationRequest with a streamer")
    if options.get("prediction") is not None:
        raise ValueError("prediction= goes with one prompt; give each row its own GenerationRequest")
    check_kinds(prompts, bool(options.get("chat")))
    seeds = row_seeds(options.pop("seed", None), len(prompts))
    GenerationRequest.of("-", max_new_tokens, **options)  # the shared settings, checked once before any prompt
    requests = []
    for i, prompt in enumerate(prompts):
        try:
            requests.append(as_request(prompt, max_new_tokens, {**options, "seed": seeds[i] if seeds else None}))
        except ValueError as error:
            raise ValueError(f"prompt {i}: {error}") from None
    return requests
