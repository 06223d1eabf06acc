"""The public entry points: `Decoder` (owns drafters whose state outlives a request) and `generate()`.

Example:
    >>> import forerun                                                   # doctest: +SKIP
    >>> model, tokenizer = forerun.load_model("smollm2-135m")             # doctest: +SKIP
    >>> decoder = forerun.Decoder(model, tokenizer, method="auto")        # doctest: +SKIP
    >>> result = decoder.generate("def fib(n):", max_new_tokens=64)      # doctest: +SKIP
    >>> result.sequences.shape, result.stats.tokens_per_forward           # doctest: +SKIP
    (torch.Size([1, 70]), 1.8...)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    PreTrainedTokenizerBase,
    StoppingCriteriaList,
)

from forerun.base import StaticBase, static_support
from forerun.batch import RowJob, batchable, decode_batch, decode_rows, fork
from forerun.checks import (
    check_batch_size,
    check_logprobs,
    check_sampling,
    check_seed,
    check_stops,
    check_text,
    check_text_length,
    row_seeds,
)
from forerun.config import EngineConfig
from forerun.costmodel import CostModel, ForwardTimes, LatencyCurve, StaticBudget
from forerun.drafters.base import Drafter
from forerun.drafters.prediction import PredictionDrafter
from forerun.engine import Budget, Sampling, Transcript, decode
from forerun.latency import DEFAULT_CACHE_DIR, curve_for, measure_batched
from forerun.logprobs import TokenLogprob
from forerun.methods import DEFAULT_METHOD, plan_method
from forerun.noise import GumbelNoise
from forerun.prefixcache import PrefixCache, Prefixes
from forerun.stats import GenerationStats
from forerun.stopping import Cancelled, StopStrings
from forerun.text import complete

logger = logging.getLogger(__name__)

Prompt = str | Sequence[dict] | Sequence[int] | torch.Tensor


@dataclass
class GenerationResult:
    """What one generation returns."""

    sequences: torch.Tensor
    """LongTensor [1, prompt_len + new_tokens], the same as model.generate(..., do_sample=False)."""
    prompt_len: int
    text: str | None
    """The decoded new tokens (None without a tokenizer)."""
    stats: GenerationStats
    token_sources: list[str]
    """Per new token: 'model' or the drafter whose guess was accepted ('prediction' for a predicted output)."""
    logprobs: list[TokenLogprob] | None = None
    """Per new token, with `generate(..., logprobs=k)`: its log-probability under the raw model, k alternatives."""
    prediction_tokens: int = 0
    """Tokens of the request's prediction (0 without one)."""

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.prompt_len :].tolist()

    @property
    def accepted_prediction_tokens(self) -> int:
        """New tokens that came from the prediction (OpenAI's usage.completion_tokens_details field)."""
        return self.stats.accepted_by.get("prediction", 0)

    @property
    def rejected_prediction_tokens(self) -> int:
        """Prediction tokens that did not make it into the answer through the prediction."""
        return max(0, self.prediction_tokens - self.accepted_prediction_tokens)


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
    vocab = model.get_output_embeddings().weight.shape[0]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise ValueError(f"eos_token_id must be a token id or a list of token ids, got {eos_token_id!r:.40}")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"eos_token_id must hold token ids in [0, {vocab}), got {token!r:.40}")
    return frozenset(ids)


DEFAULT_PREFIX_TOKENS = 4096
"""Tokens of KV a Decoder keeps for prompts that begin alike (SmolLM2-135M fp32: 46 KB a token, 189 MB)."""


class Decoder:
    """A model, its tokenizer and the drafters of one method expression; reuse it across requests (pools, tries
    and the cost model's calibration learn).

    `method`: one method (`"trie"`), several joined by `+` (`"prompt_lookup+trie"`), `"auto"` (every model-free
    method) or `"plain"`; see `forerun.methods`. Knobs are the fields of the methods' configs: `draft_len=8` for
    a single method, `trie.decoding_length=16` when several are combined; knobs not given take the defaults of
    the model's device kind (small on a CPU).

    Budget: the cost model chooses each step's tree on the device's latency curve (`forerun.costmodel`), at most
    `max_tree_nodes` nodes; `adaptive=False` feeds instead what the knobs ask for, every step (`draft_model` alone
    does that by default). The curve is `latency` if given (priced as it is), else read from or measured into
    `latency_cache` (a few seconds, once per model, dtype, device and thread count; None: measured, not stored) and
    corrected as decoding times its forwards (`costmodel.ForwardTimes`: longer contexts, a curve measured under
    load).

    `prefix_cache`: the KV of text this Decoder has read (prompts and answers) is kept for up to this many tokens,
    and a prompt that begins the same way (a shared system prompt, the next turn of a conversation) prefills only
    the rest (`forerun.prefixcache`); a `PrefixCache` to share one between Decoders of the same model; 0 or None:
    off.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None = None,
        method: str = DEFAULT_METHOD,
        *,
        max_tree_nodes: int | None = None,
        draft_in_prefill: bool = True,
        adaptive: bool | None = None,
        static_cache: bool | None = None,
        compile_buckets: bool = False,
        latency: LatencyCurve | None = None,
        latency_cache: str | Path | None = DEFAULT_CACHE_DIR,
        drafters: Sequence[Drafter] | None = None,
        draft_model: torch.nn.Module | str | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
        prefix_cache: PrefixCache | int | None = DEFAULT_PREFIX_TOKENS,
        **knobs: object,
    ) -> None:
        if latency is not None and not isinstance(latency, LatencyCurve):
            raise ValueError(f"latency must be a forerun.LatencyCurve or None, got {latency!r:.40}")
        self.model, self.tokenizer = model, tokenizer
        self.prefixes = prefix_cache if isinstance(prefix_cache, PrefixCache) else PrefixCache(prefix_cache or 0)
        device_type = next(model.parameters()).device.type
        self.plan = plan_method(method, knobs, device_type)
        self.method = self.plan.text
        self.engine_config = EngineConfig(max_tree_nodes, draft_in_prefill, adaptive, static_cache, compile_buckets)
        self.base = self.make_base(device_type)
        check_vocabulary(model, tokenizer)
        uses_draft = self.plan.uses_model()
        if draft_model is not None and not uses_draft:
            raise ValueError(f"draft_model is a knob of method 'draft_model', which is not part of {self.method!r}")
        self.draft_model = self.prepare_draft(draft_model, draft_tokenizer) if uses_draft else None
        self.latency, self.latency_cache = latency, latency_cache
        drafting = bool(self.plan.specs) if drafters is None else bool(drafters)
        self.budget = self.make_budget(latency, latency_cache, drafting)
        if drafters is None and isinstance(self.budget, CostModel) and self.budget.curve.flat:
            # Extra tokens cost little here: the drafters propose wide trees, the cost model cuts each step's
            # (bf16 on a CPU with bf16 units, SmolLM2 greedy: 1.91x -> 2.03x plain generate in forwards' cost)
            self.plan = plan_method(method, knobs, device_type, flat=True)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.drafters = list(self.plan.build(self.draft_model, vocab) if drafters is None else drafters)

    @property
    def config(self) -> object | None:
        """The config of the method when only one is used (None for 'plain' and combinations)."""
        return self.plan.configs[0] if len(self.plan.configs) == 1 else None

    def make_budget(self, latency: LatencyCurve | None, latency_cache: str | Path | None, drafting: bool) -> Budget:
        """The cost model (model-free methods and combinations, or adaptive=True) or a static node budget;
        `drafting`: whether there are drafters at all (without any, nothing is left to weigh)."""
        config = self.engine_config
        adaptive = self.plan.adaptive if config.adaptive is None else config.adaptive
        if config.max_tree_nodes is not None and config.max_tree_nodes < self.plan.min_budget():
            raise ValueError(
                f"{self.method} needs at least {self.plan.min_budget()} nodes per forward with these knobs "
                f"(the Jacobi window's W x (N-1) probes and the root), but max_tree_nodes={config.max_tree_nodes}"
            )
        if adaptive and drafting:
            curve = latency if latency is not None else curve_for(self.model, latency_cache, base=self.base)
            cap = config.max_tree_nodes or max(curve.default_cap(), self.plan.min_budget())
            # a measured curve is corrected by what this run's forwards take; a given one is the price as it is
            return CostModel(curve, cap, times=ForwardTimes() if latency is None else None)
        return StaticBudget(config.max_tree_nodes or (self.plan.static_budget() if self.plan.specs else 16))

    def make_base(self, device_type: str) -> StaticBase | None:
        """The static base for single rows (`EngineConfig.static_cache`), or None for the engine's growing cache."""
        wanted = self.engine_config.static_cache
        if wanted is False or (wanted is None and device_type != "cuda"):
            return None
        reason = static_support(self.model)
        if reason is not None:
            logger.warning("forerun: no static cache for this model (%s); using the growing cache", reason)
            return None
        return StaticBase(self.model, compiled=self.engine_config.compile_buckets)

    def batch_budget(self) -> Budget:
        """The budget batches decide on: the cost model's curve with its batched row curves
        (`LatencyCurve.batch_cost`), measured the first time a batch runs and stored beside the curve. A curve given
        as `latency` is used as it is (without batched rows, a batch is priced as one row of as many tokens)."""
        budget = self.budget
        measure = self.latency is None and batchable(self.model)
        if isinstance(budget, CostModel) and measure and not budget.curve.batched:
            if self.latency_cache is None:
                budget.curve = budget.curve.with_batches(measure_batched(self.model))
            else:
                budget.curve = curve_for(self.model, self.latency_cache, batched=True)
        return budget

    def prepare_draft(self, draft: torch.nn.Module | str | None, draft_tokenizer) -> torch.nn.Module:
        """The draft model of method 'draft_model': given, loaded by name, or the target's own first layers."""
        from forerun.drafters.draft_model import check_same_vocabulary, load_draft, self_draft

        layers = self.plan.model_config().self_draft_layers
        if layers:
            if draft is not None:
                raise ValueError("give either draft_model or self_draft_layers, not both")
            return self_draft(self.model, layers)
        if draft is None:
            raise ValueError(
                "method 'draft_model' needs draft_model=... (a model sharing the target's tokenizer, or its name) "
                "or the knob self_draft_layers=K (the target's own first K layers)"
            )
        if isinstance(draft, str):
            return load_draft(draft, self.model, self.tokenizer)
        check_same_vocabulary(self.model, draft, self.tokenizer, draft_tokenizer)
        return draft

    def save_cache(self, path: str) -> None:
        """Save the cross-request state (the trie of method 'trie') with safetensors."""
        drafter = self.trie_drafter()
        drafter.trie.save(path, drafter.config)

    def load_cache(self, path: str) -> None:
        """Replace the trie with one saved by `save_cache`; a bad file raises ValueError and changes nothing."""
        from forerun.drafters.trie import TokenTrie

        drafter = self.trie_drafter()
        vocab = self.model.get_output_embeddings().weight.shape[0]
        drafter.trie = TokenTrie.load(path, drafter.config.max_nodes, vocab)

    def trie_drafter(self):
        from forerun.drafters.trie import TrieDrafter

        for drafter in self.drafters:
            if isinstance(drafter, TrieDrafter):
                return drafter
        raise ValueError(f"method {self.method!r} keeps no trie to save or load; use a method with 'trie' in it")

    def encode(self, prompt: Prompt, chat: bool = False) -> torch.Tensor:
        """Prompt -> input_ids [1, L]: a string (chat=True wraps it as one user message), messages, or ids."""
        if isinstance(prompt, (bytes, bytearray)):  # iterating bytes gives ints: it would pass as token ids
            raise ValueError("prompt is bytes: decode it to text first, or pass token ids as a list")
        if not isinstance(prompt, (torch.Tensor, str, list, tuple)):
            raise ValueError(
                "prompt must be text, a list of chat messages or token ids (a list or a tensor), got "
                f"{type(prompt).__name__}"
            )
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise ValueError(f"input_ids must hold integer token ids, got a {prompt.dtype} tensor")
            if prompt.dim() not in (1, 2):
                raise ValueError(f"input_ids must be [length] or [1, length], got shape {list(prompt.shape)}")
            ids = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)
            if ids.shape[0] != 1:
                raise ValueError(f"forerun decodes one sequence at a time; got a batch of {ids.shape[0]}")
        elif isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give Decoder a tokenizer")
            if isinstance(prompt, str) and not prompt.strip():
                raise ValueError("prompt is empty")
            context = getattr(self.model.config, "max_position_embeddings", None)
            if isinstance(prompt, str):
                check_text_length("prompt", len(prompt), context)
                check_text("prompt", prompt)
            else:
                for i, message in enumerate(prompt):
                    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                        raise ValueError(f"messages[{i}] must be a dict with a string 'content'")
                    if not isinstance(message.get("role", "user"), str):
                        raise ValueError(f"messages[{i}].role must be a string, got {message['role']!r:.40}")
                    check_text(f"messages[{i}].content", message["content"])
                total = sum(len(message["content"]) for message in prompt)
                check_text_length("the messages' content", total, context)
            if isinstance(prompt, str) and not chat:
                ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            else:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
                try:
                    ids = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
                    )["input_ids"]
                except Exception as error:  # the template runs on the caller's messages: its refusals are theirs
                    raise ValueError(f"the chat template refused these messages: {error}") from error
        elif isinstance(prompt, (list, tuple)):
            values = list(prompt)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ValueError("a prompt given as a list must hold integer token ids")
            ids = torch.tensor([values], dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("prompt is empty")
        vocab = self.model.get_input_embeddings().num_embeddings
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"prompt has token ids outside the model's vocabulary [0, {vocab})")
        return ids.to(dtype=torch.long)

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        *,
        chat: bool = False,
        stop: str | Sequence[str] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: object | None = None,
        do_sample: bool = False,
        seed: int | None = None,
        cancel: threading.Event | None = None,
        prediction: str | Sequence[int] | None = None,
        logprobs: int | None = None,
        batch_size: int | None = None,
        cache_salt: str | None = None,
        **generation_kwargs: object,
    ) -> GenerationResult:
        """Generate; greedy output is token for token `model.generate(do_sample=False)`.

        `do_sample=True` and transformers generation settings (temperature, top_k, top_p, min_p, typical_p,
        repetition_penalty, no_repeat_ngram_size, ...) go through `model.generate` with forerun as its
        `custom_generate`, so the processors are exactly the ones transformers builds; sampled output keeps their
        distribution. `seed` fixes a sampled answer, whichever method drafts it (`forerun.noise`). `stop`: strings
        that end the answer (the token that completes one is the last). Setting `cancel` (from another thread)
        stops the generation after the current step; the result then holds the tokens made so far. `prediction`:
        text (or token ids) the answer is expected to resemble, drafted from (OpenAI's predicted outputs); the
        answer is unchanged by it.
        `logprobs=k`: each new token's log-probability under the raw model and its k likeliest alternatives.
        A list of prompts returns a list of results (`generate_batch`; `batch_size`: rows decoded at once).
        `cache_salt`: the prompt reuses (and leaves) prefix-cache entries only among requests with the same salt
        (`forerun.prefixcache`: one tenant cannot time whether another sent the same text).
        """
        check_batch_size(batch_size)
        if is_batch(prompt):
            return self.generate_batch(
                prompt,
                max_new_tokens,
                batch_size=batch_size,
                chat=chat,
                stop=stop,
                eos_token_id=eos_token_id,
                streamer=streamer,
                do_sample=do_sample,
                seed=seed,
                cancel=cancel,
                prediction=prediction,
                logprobs=logprobs,
                cache_salt=cache_salt,
                **generation_kwargs,
            )
        check_request(max_new_tokens, stop, seed, logprobs, do_sample, generation_kwargs)
        check_hooks(prediction, cancel, streamer)
        eos_ids_of(self.model, eos_token_id)  # checked before either path below takes it
        stops = check_stops(stop)
        input_ids = self.encode(prompt, chat)
        prompt_len = input_ids.shape[1]
        self.check_context(input_ids, max_new_tokens)
        request = Request(self.drafters, logprobs, prefixes=self.scoped_prefixes(cache_salt))
        if prediction is not None:
            request.prediction = self.encode_prediction(prediction)
            request.drafters = [PredictionDrafter(request.prediction), *self.drafters]
        stopping = StoppingCriteriaList()
        if stops:
            stopping.append(StopStrings(self.tokenizer, stops, prompt_len))
        if cancel is not None:
            stopping.append(Cancelled(cancel))
        if do_sample or generation_kwargs:
            return self.generate_with_transformers(
                input_ids, max_new_tokens, stopping, eos_token_id, streamer, do_sample, seed, request, generation_kwargs
            )
        eos = eos_ids_of(self.model, eos_token_id)
        criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=prompt_len + max_new_tokens)])
        if eos:
            criteria.append(EosTokenCriteria(eos_token_id=sorted(eos)))
        criteria.extend(stopping)
        if streamer is not None:
            streamer.put(input_ids.cpu())  # transformers' convention: a streamer sees the prompt first
        # The transcript stays on the host: its tokens come from the host, and checking the criteria against a
        # sequence on an accelerator would cost a copy and a sync per token.
        transcript, stats = self.decode(input_ids.cpu(), criteria, eos, max_new_tokens, streamer, request)
        return self.result(transcript, prompt_len, stats, request)

    def generate_batch(
        self,
        prompts: Sequence[Prompt] | torch.Tensor,
        max_new_tokens: int = 256,
        *,
        batch_size: int | None = None,
        **options: object,
    ) -> list[GenerationResult]:
        """Several prompts decoded together (`forerun.batch`): one GenerationResult per prompt, in order, each what
        `generate(prompt)` alone returns (greedy: token for token, fp32; sampled: row i what `generate` writes with
        `seed + i`). Rows finish independently. `batch_size`: at most this many rows at
        once, a finished row's place going to the next prompt (default: every prompt at once). The other options
        are `generate`'s. `generate([...])` lands here.

        Example:
            >>> results = decoder.generate(["Hi", "Name a colour."], 32, chat=True)   # doctest: +SKIP
            >>> [r.text for r in results]                                            # doctest: +SKIP
        """
        results: list[GenerationResult | None] = [None] * (len(prompts))
        for index, result in self.generate_each(prompts, max_new_tokens, batch_size=batch_size, **options):
            results[index] = result
        return results  # type: ignore[return-value]

    def generate_each(
        self,
        prompts: Sequence[Prompt] | torch.Tensor,
        max_new_tokens: int = 256,
        *,
        batch_size: int | None = None,
        chat: bool = False,
        stop: str | Sequence[str] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: object | None = None,
        do_sample: bool = False,
        seed: int | Sequence[int] | None = None,
        cancel: threading.Event | None = None,
        prediction: str | Sequence[int] | None = None,
        logprobs: int | None = None,
        cache_salt: str | None = None,
        **generation_kwargs: object,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """`generate_batch`, yielding (prompt index, result) as each row finishes (finishing order): write or
        show each answer as soon as it is there. Every prompt and setting is checked before this returns (a
        ValueError names the prompt); decoding starts when the iterator is first advanced. `seed`: row i draws
        from seed + i, or from seed[i] given one seed per prompt (`forerun run` seeds a record by its place in
        the file, whichever records are left to do).

        Example (8 prompts through 4 rows; each line printed the moment its row is done):
            >>> for i, result in decoder.generate_each(prompts, 64, batch_size=4):   # doctest: +SKIP
            ...     print(i, result.text)
        """
        if streamer is not None:
            raise ValueError("streamer= follows one prompt; stream a batch row by row with forerun.batch.Batch")
        if prediction is not None:
            raise ValueError("prediction= goes with one prompt; give batched prompts no prediction")
        check_batch_size(batch_size)
        seeds = row_seeds(seed, len(prompts))
        check_request(max_new_tokens, stop, None, logprobs, do_sample, generation_kwargs)
        check_hooks(None, cancel, None)
        prefixes = self.scoped_prefixes(cache_salt)
        rows = self.encode_batch(prompts, chat)
        jobs, requests = [], []
        for i, ids in enumerate(rows):
            try:
                self.check_context(ids, max_new_tokens)
            except ValueError as error:
                raise ValueError(f"prompt {i}: {error}") from None
            row_seed = seeds[i] if seeds is not None else None
            job, request = self.prepare_row(
                ids, max_new_tokens, stop, eos_token_id, None, do_sample, row_seed, cancel, None, logprobs,
                generation_kwargs, prefixes
            )  # fmt: skip
            jobs.append(job)
            requests.append(request)
        budget = self.batch_budget() if len(jobs) > 1 and batch_size != 1 else self.budget

        def finished() -> Iterator[tuple[int, GenerationResult]]:
            with torch.inference_mode():
                for index, stats in decode_rows(self.model, jobs, budget, batch_size, self.base):
                    job = jobs[index]
                    yield index, self.result(job.transcript, job.input_ids.shape[1], stats, requests[index])

        return finished()

    def check_prompt(self, prompt: Prompt, max_new_tokens: int = 256, chat: bool = False) -> torch.Tensor:
        """The prompt's input_ids [1, L] if `generate` would take it with `max_new_tokens`; otherwise the
        ValueError `generate` would raise (empty, ids outside the vocabulary, beyond the model's context)."""
        ids = self.encode(prompt, chat)
        self.check_context(ids, max_new_tokens)
        return ids

    def check_context(self, ids: torch.Tensor, max_new_tokens: int) -> None:
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and ids.shape[1] + max_new_tokens > context:
            raise ValueError(
                f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
                f"({context} tokens)"
            )

    def prepare(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        *,
        chat: bool = False,
        stop: str | Sequence[str] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: object | None = None,
        do_sample: bool = False,
        seed: int | None = None,
        cancel: threading.Event | None = None,
        prediction: str | Sequence[int] | None = None,
        logprobs: int | None = None,
        cache_salt: str | None = None,
        **generation_kwargs: object,
    ) -> tuple[RowJob, Request]:
        """One prompt, checked and set up as a row for a running `forerun.batch.Batch` (the server's continuous
        batching); the arguments are `generate`'s. Once the row is done, `result(job.transcript, prompt_len, stats,
        request)` makes its GenerationResult."""
        check_request(max_new_tokens, stop, seed, logprobs, do_sample, generation_kwargs)
        check_hooks(prediction, cancel, streamer)
        ids = self.encode(prompt, chat)
        self.check_context(ids, max_new_tokens)
        tokens = self.encode_prediction(prediction) if prediction is not None else None
        return self.prepare_row(
            ids, max_new_tokens, stop, eos_token_id, streamer, do_sample, seed, cancel, tokens, logprobs,
            generation_kwargs, self.scoped_prefixes(cache_salt)
        )  # fmt: skip

    def scoped_prefixes(self, cache_salt: str | None) -> Prefixes:
        """The prefix cache as requests with `cache_salt` see it; a salt that is not a string is refused."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        return self.prefixes.scoped(cache_salt) if cache_salt else self.prefixes

    def prepare_row(
        self, ids, max_new_tokens, stop, eos_token_id, streamer, do_sample, seed, cancel, prediction, logprobs,
        generation_kwargs, prefixes
    ) -> tuple[RowJob, Request]:  # fmt: skip
        """A checked, encoded prompt [1, L] -> its RowJob (criteria, forked drafters, processors, sampling);
        `prefixes`: the prefix cache as its salt sees it (`scoped_prefixes`)."""
        device = self.model.device
        eos = eos_ids_of(self.model, eos_token_id)
        prompt_len = ids.shape[1]
        criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=prompt_len + max_new_tokens)])
        if eos:
            criteria.append(EosTokenCriteria(eos_token_id=sorted(eos)))
        stops = check_stops(stop)
        if stops:
            criteria.append(StopStrings(self.tokenizer, stops, prompt_len))
        if cancel is not None:
            criteria.append(Cancelled(cancel))
        request = Request(fork(self.drafters), logprobs, prefixes=prefixes)
        if prediction is not None:
            request.prediction = list(prediction)
            request.drafters = [PredictionDrafter(request.prediction), *request.drafters]
        processor = sampling = None
        if do_sample or generation_kwargs:
            processor = self.processors(ids, max_new_tokens, do_sample, eos_token_id, generation_kwargs)
        if do_sample:
            sampling = Sampling(GumbelNoise.drawn(seeded(seed)))
        if streamer is not None:
            streamer.put(ids.cpu())  # transformers' convention: a streamer sees the prompt first
        transcript = Transcript(ids.to(device), criteria, streamer, logprobs_top=logprobs)
        job = RowJob(ids.to(device), transcript, request.drafters, eos, max_new_tokens, processor, sampling, prefixes)
        return job, request

    def encode_batch(self, prompts: Sequence[Prompt] | torch.Tensor, chat: bool) -> list[torch.Tensor]:
        """Each prompt -> input_ids [1, L_i]; a 2-D tensor is one prompt per row (no padding)."""
        if isinstance(prompts, torch.Tensor):
            return [self.encode(row, chat) for row in prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("the batch of prompts is empty")
        has_text = any(isinstance(p, str) for p in prompts)
        has_messages = any(isinstance(p, (list, tuple)) and p and isinstance(p[0], dict) for p in prompts)
        if has_text and has_messages and not chat:
            raise ValueError(
                "the batch mixes raw text prompts and chat message lists; pass chat=True to wrap every text "
                "prompt as a user message, or make every prompt the same kind"
            )
        encoded = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self.encode(prompt, chat))
            except ValueError as error:
                raise ValueError(f"prompt {i}: {error}") from None
        return encoded

    def processors(self, input_ids, max_new_tokens, do_sample, eos_token_id, generation_kwargs) -> LogitsProcessorList:
        """The logits processors `model.generate` builds for this prompt alone (temperature, top-p, penalties...),
        taken from its `custom_generate` hook before any forward runs."""
        extra = {}
        if eos_token_id is not None:
            extra["eos_token_id"] = list(eos_token_id) if not isinstance(eos_token_id, int) else eos_token_id
        return self.model.generate(
            input_ids.to(self.model.device),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            custom_generate=processors_only,
            pad_token_id=self.pad_token_id(),
            **extra,
            **generation_kwargs,
        )

    def encode_prediction(self, prediction: str | Sequence[int]) -> list[int]:
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise ValueError("a text prediction needs a tokenizer; pass token ids or give Decoder a tokenizer")
            check_text("prediction", prediction)
            return self.tokenizer(prediction, add_special_tokens=False)["input_ids"]
        return self.encode(list(prediction))[0].tolist()

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.Tensor,
        stopping: StoppingCriteriaList,
        eos: frozenset[int],
        max_new_tokens: int,
        streamer: object | None = None,
        request: Request | None = None,
        processor: LogitsProcessorList | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Transcript, GenerationStats]:
        """The one path into the engine, for `generate` and for `model.generate(custom_generate=...)`.

        The streamer has already seen the prompt; it gets the new tokens as they are committed, then `end()`.
        """
        request = request or Request(self.drafters)
        transcript = Transcript(input_ids, stopping, streamer, logprobs_top=request.logprobs)
        stats = decode(
            self.model,
            input_ids,
            request.drafters,
            transcript,
            eos,
            max_new_tokens,
            self.budget,
            self.engine_config.draft_in_prefill,
            processor,
            sampling,
            request.prefixes if request.prefixes is not None else self.prefixes,
            self.base,
        )
        if streamer is not None:
            streamer.end()
        return transcript, stats

    def result(self, transcript: Transcript, prompt_len: int, stats: GenerationStats, request: Request):
        sequences = transcript.sequence.cpu()
        text = None
        if self.tokenizer is not None:  # an answer cut inside a multi-byte character ends before it, not in U+FFFD
            text = complete(self.tokenizer.decode(sequences[0, prompt_len:], skip_special_tokens=True))
        logprobs = list(transcript.logprobs) if request.logprobs is not None else None
        return GenerationResult(
            sequences, prompt_len, text, stats, transcript.sources, logprobs, len(request.prediction or ())
        )

    def generate_with_transformers(
        self, input_ids, max_new_tokens, stopping, eos_token_id, streamer, do_sample, seed, request, generation_kwargs
    ) -> GenerationResult:
        """Let `model.generate` build processors and stopping criteria, with forerun as its custom_generate."""

        generator = seeded(seed)
        extra = {}
        if eos_token_id is not None:
            extra["eos_token_id"] = list(eos_token_id) if not isinstance(eos_token_id, int) else eos_token_id
        output = self.model.generate(
            input_ids.to(self.model.device),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            custom_generate=custom_generate,
            forerun_decoder=self,
            forerun_streamer=streamer,
            forerun_generator=generator,
            forerun_request=request,
            return_dict_in_generate=True,
            pad_token_id=self.pad_token_id(),
            stopping_criteria=stopping or None,
            **extra,
            **generation_kwargs,
        )
        return self.result(output.forerun_transcript, input_ids.shape[1], output.forerun_stats, request)

    def pad_token_id(self) -> int | None:
        config = self.model.generation_config
        if config.pad_token_id is not None:
            return config.pad_token_id
        eos = config.eos_token_id
        return eos if isinstance(eos, int) else (eos[0] if eos else 0)


@dataclass
class Request:
    """What one generation adds to its Decoder: its drafters (a prediction in front), log-probabilities asked."""

    drafters: list[Drafter]
    logprobs: int | None = None
    prediction: list[int] | None = None
    prefixes: Prefixes | None = None
    """The prefix cache as this request's salt sees it (None: the Decoder's, unsalted)."""


def check_generation_kwargs(generation_kwargs: dict[str, object]) -> None:
    """Unknown names are refused (a method knob passed here by mistake is named as such); values range-checked."""

    defaults = GenerationConfig()
    unknown = sorted(name for name in generation_kwargs if not hasattr(defaults, name))
    if unknown:
        raise ValueError(
            f"unknown generation argument(s) {unknown}; method knobs belong to Decoder(...) "
            "(or knobs={...} in forerun.generate)"
        )
    check_sampling(generation_kwargs)


def custom_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer: object | None = None,
    forerun_decoder: Decoder | None = None,
    forerun_streamer: object | None = None,
    forerun_generator: torch.Generator | None = None,
    forerun_request: Request | None = None,
    **model_kwargs: object,
):
    """forerun as transformers' `custom_generate`: decode with the processors and criteria transformers built.

    Streaming: transformers 5.23 forwards only the callable's own new keyword arguments, so `streamer=` never
    reaches a custom_generate callable (it only receives the prompt). Pass `forerun_streamer=` instead: it gets the
    prompt, then the new tokens as they are committed, then `end()`. Each sequence's noise seed (`forerun.noise`)
    is drawn from `forerun_generator`, else torch's global generator (so `torch.manual_seed` makes runs repeat, as
    with plain generate).
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if forerun_streamer is not None:
        streamer = forerun_streamer
        streamer.put(input_ids.cpu())
    if generation_config.num_beams not in (None, 1):
        raise ValueError(f"forerun does not do beam search (num_beams={generation_config.num_beams})")
    decoder = forerun_decoder

    def sampling() -> Sampling | None:
        """A sampled sequence's own noise (each row of a batch gets its own seed, drawn in row order)."""
        return Sampling(GumbelNoise.drawn(forerun_generator)) if generation_config.do_sample else None

    mask = model_kwargs.get("attention_mask")
    if input_ids.shape[0] != 1 or (isinstance(mask, torch.Tensor) and not bool(mask.all())):
        if streamer is not None:
            raise ValueError("forerun streams one sequence; a batch cannot take a streamer")
        return batch_custom_generate(
            model, input_ids, mask, logits_processor, stopping_criteria, generation_config, decoder, sampling
        )
    transcript, stats = decoder.decode(
        input_ids,
        stopping_criteria,
        eos_ids_of(model, generation_config.eos_token_id),
        generation_config.max_length - input_ids.shape[1],
        streamer,
        forerun_request,
        logits_processor,
        sampling(),
    )
    if generation_config.return_dict_in_generate:
        output = GenerateDecoderOnlyOutput(sequences=transcript.sequence)
        output.forerun_stats = stats
        output.forerun_sources = transcript.sources
        output.forerun_transcript = transcript
        return output
    return transcript.sequence


def batch_custom_generate(
    model, input_ids, mask, logits_processor, stopping_criteria, generation_config, decoder: Decoder, sampling
):
    """A left-padded batch through `custom_generate`: each row decoded without its padding (`forerun.batch`), the
    output laid out as plain batched generate lays it out: [rows, padded prompt + longest answer], rows that
    finished earlier filled with the pad token.

    Per row, the stopping criteria are transformers' own except the length, which counts from the row's own
    prompt; the logits processors see the row's own tokens (its padding is not text).
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    rows, padded_len = input_ids.shape
    if mask is None:
        mask = torch.ones_like(input_ids)
    max_new_tokens = generation_config.max_length - padded_len
    eos = eos_ids_of(model, generation_config.eos_token_id)
    kept = StoppingCriteriaList(c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria))
    jobs, pads = [], []
    for row in range(rows):
        real = mask[row].bool()
        pad = int((~real).sum())
        if bool((~real[pad:]).any()) or not bool(real[pad:].all()):
            raise ValueError(f"row {row} of the batch is not left-padded (pad with padding_side='left')")
        if pad == padded_len:
            raise ValueError(f"row {row} of the batch is all padding")
        ids = input_ids[row : row + 1, pad:]
        criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=ids.shape[1] + max_new_tokens), *kept])
        transcript = Transcript(ids, criteria)
        jobs.append(RowJob(ids, transcript, fork(decoder.drafters), eos, max_new_tokens, logits_processor, sampling()))
        pads.append(pad)
    stats = decode_batch(model, jobs, decoder.batch_budget() if len(jobs) > 1 else decoder.budget)
    longest = max(job.transcript.sequence.shape[1] + pad for job, pad in zip(jobs, pads, strict=True))
    pad_id = generation_config.pad_token_id
    if pad_id is None:
        pad_id = min(eos) if eos else 0
    sequences = input_ids.new_full((rows, longest), int(pad_id))
    for row, (job, pad) in enumerate(zip(jobs, pads, strict=True)):
        sequences[row, :pad] = input_ids[row, :pad]
        sequences[row, pad : pad + job.transcript.sequence.shape[1]] = job.transcript.sequence[0]
    if generation_config.return_dict_in_generate:
        output = GenerateDecoderOnlyOutput(sequences=sequences)
        output.forerun_stats = stats
        output.forerun_sources = [job.transcript.sources for job in jobs]
        return output
    return sequences


def seeded(seed: int | None) -> torch.Generator | None:
    """The generator a `seed` stands for (on the CPU: the same seed gives the same noise on every device); None:
    torch's global one."""
    return torch.Generator().manual_seed(seed) if seed is not None else None


def check_vocabulary(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """A tokenizer whose ids exceed the model's embedding rows belongs to another model."""
    if tokenizer is None:
        return
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has {len(tokenizer)} tokens but model {type(model).__name__} "
            f"embeds only {rows}: they do not belong together"
        )


def generate(
    model: torch.nn.Module,
    input_ids: Prompt,
    method: str = DEFAULT_METHOD,
    max_new_tokens: int = 256,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    knobs: dict[str, object] | None = None,
    max_tree_nodes: int | None = None,
    draft_model: torch.nn.Module | str | None = None,
    **generation_kwargs: object,
) -> GenerationResult:
    """One call: `Decoder(model, tokenizer, method, **knobs).generate(input_ids, max_new_tokens, **generation_kwargs)`.

    Method knobs go in `knobs` (e.g. `knobs={"draft_len": 8}`); every argument of `Decoder.generate` (chat, stop,
    eos_token_id, streamer, do_sample, seed, temperature, top_p, ...) is passed through.

    Example:
        >>> forerun.generate(model, ids, "trie", 64, do_sample=True, temperature=0.7, seed=0)  # doctest: +SKIP
    """
    decoder = Decoder(model, tokenizer, method, max_tree_nodes=max_tree_nodes, draft_model=draft_model, **(knobs or {}))
    return decoder.generate(input_ids, max_new_tokens, **generation_kwargs)


def processors_only(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """A `custom_generate` that decodes nothing: it returns the processors transformers prepared."""
    return logits_processor


def is_batch(prompt: object) -> bool:
    """A list of prompts (strings, message lists, id lists or tensors) or a [rows > 1, L] tensor, not one prompt."""
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 2 and prompt.shape[0] > 1
    if isinstance(prompt, (list, tuple)) and prompt:
        return isinstance(prompt[0], (str, list, tuple, torch.Tensor))
    return False


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


def check_request(max_new_tokens, stop, seed, logprobs, do_sample, generation_kwargs) -> None:
    """Every per-request value, checked before anything is encoded (a ValueError names the bad one)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_stops(stop)
    check_seed(seed)
    check_logprobs(logprobs)
    check_generation_kwargs(generation_kwargs)
    if do_sample or generation_kwargs:
        try:
            GenerationConfig(do_sample=do_sample, **generation_kwargs).validate(strict=True)
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid generation settings {generation_kwargs}: {error}") from error
