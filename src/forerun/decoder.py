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
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path

import torch
from transformers import LogitsProcessorList, PreTrainedTokenizerBase, StoppingCriteriaList

from forerun.assembly import (
    check_causal,
    check_vocabulary,
    make_base,
    make_budget,
    make_prefixes,
    method_plan,
    prepare_draft,
    prepare_head,
    price_costly,
    reads_on_states,
    rows_together,
    scoped_prefixes,
    verifying_base,
    warm_graphs,
    with_batched_rows,
)
from forerun.base.chain import ChainBase
from forerun.base.weights import vocabulary_rows
from forerun.batch import fork
from forerun.batched import decode_rows
from forerun.checks import check_batch_size, check_warm_up
from forerun.config import EngineConfig
from forerun.costmodel import Budget, LatencyCurve
from forerun.defaults import DEFAULT_METHOD
from forerun.drafters.base import Drafter
from forerun.drafters.prediction import PredictionDrafter
from forerun.engine import decode
from forerun.latency import DEFAULT_CACHE_DIR
from forerun.methods import MethodPlan
from forerun.noise import GumbelNoise
from forerun.prefixcache import PrefixCache, Prefixes
from forerun.preparation import Prepared, as_request, eos_ids_of, finished_result, request_criteria, requests_of, seeded
from forerun.prompts import check_context, encode_prediction, encode_prompt
from forerun.request import GenerationRequest, Prompt, is_batch
from forerun.result import GenerationResult
from forerun.row import RowJob
from forerun.scoring import DEFAULT_CHUNK, Entries, score_prompt
from forerun.stats import GenerationStats
from forerun.structured import Grammars
from forerun.taps import feature_layers
from forerun.transcript import Transcript
from forerun.verify import Sampling

logger = logging.getLogger(__name__)


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
    the rest (`forerun.prefixcache`); "auto": four of the model's contexts, within 1 GiB of keys and values
    (`assembly.prefix_tokens`); a `PrefixCache` to share one between Decoders of the same model; 0 or None: off.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None = None,
        method: str | MethodPlan = DEFAULT_METHOD,
        *,
        max_tree_nodes: int | None = None,
        draft_in_prefill: bool = True,
        adaptive: bool | None = None,
        static_cache: bool | None = None,
        compile_buckets: bool = False,
        reproducible: bool | None = None,
        latency: LatencyCurve | None = None,
        latency_cache: str | Path | None = DEFAULT_CACHE_DIR,
        drafters: Sequence[Drafter] | None = None,
        draft_model: torch.nn.Module | str | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
        draft_head: str | Path | torch.nn.Module | None = None,
        prefix_cache: PrefixCache | int | str | None = "auto",
        **knobs: object,
    ) -> None:
        if latency is not None and not isinstance(latency, LatencyCurve):
            raise ValueError(f"latency must be a forerun.LatencyCurve or None, got {latency!r:.40}")
        check_causal(model)
        self.lock = threading.RLock()
        """Held while a call decodes: calls from several threads take turns (batch requests to decode them together)."""
        self.model, self.tokenizer = model, tokenizer
        self.reads_on = reads_on_states(model)
        """Whether a prompt may be read on from a stored cache or in chunks (a hybrid whose scan over several tokens
        loses its states reads every prompt whole: `assembly.reads_on_states`)."""
        self.prefixes = make_prefixes(model, prefix_cache, self.reads_on)
        device_type = next(model.parameters()).device.type
        self.plan = method_plan(method, knobs, device_type, draft_head)
        self.method = self.plan.text
        self.engine_config = EngineConfig(
            max_tree_nodes, draft_in_prefill, adaptive, static_cache, compile_buckets, reproducible
        )
        check_vocabulary(model, tokenizer)
        self.draft_model = prepare_draft(model, tokenizer, self.plan, draft_model, draft_tokenizer)
        self.draft_head = prepare_head(model, self.plan, draft_head)
        read = feature_layers(drafters) if drafters is not None else getattr(self.draft_head, "aux_layers", ())
        self.base = make_base(model, self.engine_config, device_type, read)
        self.latency, self.latency_cache = latency, latency_cache
        drafting = bool(self.plan.specs) if drafters is None else bool(drafters)
        self.base, self.fallback_reason = verifying_base(model, self.base)
        """Why this model verifies no guesses (one token per forward), or None where it does."""
        if drafting and self.fallback_reason is not None:
            logger.warning("forerun: %s decodes one token per forward: %s", self.method, self.fallback_reason)
            drafting = False
        chains = isinstance(self.base, ChainBase)
        self.budget = make_budget(
            model, self.plan, self.engine_config, latency, latency_cache, self.base, drafting, chains
        )
        if drafters is None and self.budget.curve is not None and self.budget.curve.flat:
            # Extra tokens cost little here: the drafters propose wide trees, the cost model cuts each step's
            # (bf16 on a CPU with bf16 units, SmolLM2 greedy: 1.91x -> 2.03x plain generate in forwards' cost)
            self.plan = self.plan.for_flat_curve()
        vocab = vocabulary_rows(model)
        self.drafters = list(
            self.plan.build(self.draft_model, vocab, self.draft_head) if drafters is None else drafters
        )
        price_costly(self.drafters, self.budget, latency_cache)
        ends = eos_ids_of(model, None)  # llguidance's end token; each request's own EOS ids stand in for it
        self.grammars = Grammars(tokenizer, vocab, min(ends) if ends else getattr(tokenizer, "eos_token_id", None))

    @property
    def config(self) -> object | None:
        """The config of the method when only one is used (None for 'plain' and combinations)."""
        return self.plan.configs[0] if len(self.plan.configs) == 1 else None

    def batch_budget(self) -> Budget:
        """The budget batches decide on: the cost model's curve with its batched row curves
        (`LatencyCurve.batch_cost`), measured the first time a batch runs and stored beside the curve. A curve given
        as `latency` is used as it is (without batched rows, a batch is priced as one row of as many tokens)."""
        measure = self.latency is None and self.batches  # a curve given is priced as it is
        return with_batched_rows(self.model, self.budget, self.base, self.latency_cache, measure)

    def save_cache(self, path: str) -> None:
        """Save the cross-request state (the trie of method 'trie') with safetensors."""
        drafter = self.trie_drafter()
        with self.lock:
            drafter.trie.save(path, drafter.config)

    def load_cache(self, path: str) -> None:
        """Replace the trie with one saved by `save_cache`; a bad file raises ValueError and changes nothing."""
        from forerun.drafters.trie import TokenTrie

        drafter = self.trie_drafter()
        vocab = vocabulary_rows(self.model)
        trie = TokenTrie.load(path, drafter.config.max_nodes, vocab)
        with self.lock:
            drafter.trie = trie

    def trie_drafter(self):
        from forerun.drafters.trie import trie_drafter_of

        return trie_drafter_of(self.drafters, self.method)

    def warm_up(self, max_len: int = 2048, batch_size: int = 1, single: bool = True) -> float:
        """Capture the static cache's graphs now (compiled first, with compile_buckets) for texts of up to `max_len`
        tokens (prompt + new tokens), so that no request pays for them, and a trained head's or a draft model's own
        graphs; returns the seconds spent (0.0 without a static cache, a CPU's default). A longer request later
        allocates a larger cache and captures again.
        `batch_size` > 1: also the graphs of batches of up to that many rows (every row count they are padded
        to, a joining row's prompt fed into its place, and a draft model's slot cache for each row):
        `generate_each(..., batch_size=)` and a server's continuous batch of that many rows. `single=False` (with
        `batch_size` > 1): only those, not a lone request's own (`generate(prompt)`); a server whose every request
        joins its batch never replays them.

        Example:
            >>> decoder = Decoder(model, tokenizer, "auto")                    # doctest: +SKIP
            >>> decoder.warm_up(1024, batch_size=8)                            # seconds, once  # doctest: +SKIP
        """
        context = getattr(self.model.config, "max_position_embeddings", None)
        check_warm_up(max_len, batch_size, single, context)
        batched = batch_size > 1 and self.batches
        single = single or not batched  # a warm-up warms something
        if self.base is None or isinstance(self.base, ChainBase):  # nothing captured there
            return 0.0
        with self.lock, torch.inference_mode():
            longest = max_len + self.budget.max_nodes
            return warm_graphs(self.base, self.drafters, longest, batch_size, single, batched)

    def encode(
        self,
        prompt: Prompt,
        chat: bool = False,
        tools: Sequence[dict] | None = None,
        template_kwargs: Mapping[str, object] | None = None,
        continued: bool = False,
    ) -> torch.Tensor:
        """Prompt -> input_ids [1, L] on the host: a string (chat=True wraps it as one user message), messages, or
        ids (`forerun.prompts`); `tools` shown by the chat template, `template_kwargs` given to it; `continued`:
        the last message left open (`GenerationRequest.continue_final_message`)."""
        return encode_prompt(self.model, self.tokenizer, prompt, chat, tools, template_kwargs, continued)

    def generate(
        self,
        prompt: Prompt | GenerationRequest | Sequence[Prompt | GenerationRequest],
        max_new_tokens: int = 256,
        *,
        batch_size: int | None = None,
        **options: object,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate; greedy output is token for token `model.generate(do_sample=False)`.

        `prompt` is text, chat messages, token ids or a `GenerationRequest`; the options are the request's fields
        (chat, stop, eos_token_id, do_sample, seed, prediction, logprobs, cache_salt, streamer, cancel; see
        `forerun.request`), and any other keyword is a transformers generation setting (temperature, top_k, top_p,
        min_p, typical_p, repetition_penalty, no_repeat_ngram_size, ...): the logits processors are exactly those
        transformers builds for it, so sampled output keeps their distribution. A list of prompts or requests
        returns a list of results (`generate_batch`; `batch_size`: rows decoded at once).

        Example:
            >>> decoder.generate("def fib(n):", 64, stop="\\n\\n").text          # doctest: +SKIP
            >>> decoder.generate(GenerationRequest("Hi", 32, chat=True, do_sample=True, seed=1))  # doctest: +SKIP
        """
        check_batch_size(batch_size)
        if is_batch(prompt):
            return self.generate_batch(prompt, max_new_tokens, batch_size=batch_size, **options)
        request = as_request(prompt, max_new_tokens, options)
        with self.lock, torch.inference_mode():
            prepared = self.prepare(request, fork_drafters=False)
            stats = decode(self.model, prepared.job, self.budget, self.engine_config.draft_in_prefill, self.base)
        return self.result(prepared, stats)

    def generate_batch(
        self,
        prompts: Sequence[Prompt | GenerationRequest] | torch.Tensor,
        max_new_tokens: int = 256,
        *,
        batch_size: int | None = None,
        **options: object,
    ) -> list[GenerationResult]:
        """Several prompts decoded together (`forerun.batch`): one GenerationResult per prompt, in order, each what
        `generate(prompt)` alone returns (greedy: token for token, fp32; sampled: row i what `generate` writes with
        `seed + i`). Rows finish independently. `batch_size`: at most this many rows at once, a finished row's place
        going to the next prompt (default: every prompt at once). The options are `generate`'s, for every prompt;
        requests carry their own. `generate([...])` lands here.

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
        prompts: Sequence[Prompt | GenerationRequest] | torch.Tensor,
        max_new_tokens: int = 256,
        *,
        batch_size: int | None = None,
        **options: object,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """`generate_batch`, yielding (prompt index, result) as each row finishes (finishing order): write or
        show each answer as soon as it is there. Every prompt and setting is checked before this returns (a
        ValueError names the prompt); decoding starts when the iterator is first advanced. Shared options: `seed`
        gives row i seed + i, or seed[i] given one seed per prompt. A list of `GenerationRequest`s lets every row
        have its own settings (`forerun run` gives each record its own).

        Example (8 prompts through 4 rows; each line printed the moment its row is done):
            >>> for i, result in decoder.generate_each(prompts, 64, batch_size=4):   # doctest: +SKIP
            ...     print(i, result.text)
        """
        check_batch_size(batch_size)
        requests = requests_of(prompts, max_new_tokens, options)
        prefixes = {}  # one scoped view per salt
        rows = []
        with self.lock:
            for i, request in enumerate(requests):
                try:
                    rows.append(self.prepare(request, prefixes=prefixes))
                except ValueError as error:
                    raise ValueError(f"prompt {i}: {error}") from None
        budget = self.batch_budget() if len(rows) > 1 and batch_size != 1 else self.budget
        jobs = [row.job for row in rows]

        def finished() -> Iterator[tuple[int, GenerationResult]]:
            with self.lock, torch.inference_mode():  # held until the last row is done (or the iterator closed)
                for index, stats in decode_rows(self.model, jobs, budget, batch_size, self.base, self.batches):
                    yield index, self.result(rows[index], stats)

        return finished()

    def check_prompt(
        self, prompt: Prompt, max_new_tokens: int = 256, chat: bool = False, **shown: object
    ) -> torch.Tensor:
        """The prompt's input_ids [1, L] if `generate` would take it with `max_new_tokens`; otherwise the
        ValueError `generate` would raise (empty, ids outside the vocabulary, beyond the model's context).
        `shown`: `tools` and `template_kwargs`, as `encode` takes them."""
        ids = self.encode(prompt, chat, **shown)
        check_context(self.model, ids, max_new_tokens)
        return ids

    def score(self, prompt: Prompt, top: int = 0, chat: bool = False) -> Entries:
        """Each prompt token's log-probability given the tokens before it, under the raw model (`forerun.scoring`:
        None for the first token; `top` alternatives each). `decoder.score(context + continuation, top=1)` is an
        evaluation harness's loglikelihood (`forerun.scoring.continuation_logprob`); a head scored before is read
        from the prefix cache, and the prompt left there."""
        ids = self.check_prompt(prompt, 0, chat)
        with self.lock:
            return score_prompt(self.model, ids, top, DEFAULT_CHUNK if self.reads_on else None, keep=self.prefixes)

    def prepare(
        self, request: GenerationRequest, fork_drafters: bool = True, prefixes: dict[str, Prefixes] | None = None
    ) -> Prepared:
        """One request, checked and set up as a row (`forerun.row.RowJob`: criteria, drafters, processors,
        sampling noise) for `engine.decode` or a running `forerun.batch.Batch` (the server's continuous batching).
        Once the row is done, `result(prepared, stats)` makes its GenerationResult.

        `fork_drafters`: the row gets its own view of the drafters (rows decoding at once); False: the Decoder's
        own (one row at a time: per-request adaptation such as a draft model's length carries over).
        `prefixes`: scoped prefix-cache views by salt, shared by the rows of one batch."""
        eos = eos_ids_of(self.model, request.eos_token_id)
        ids = self.encode(request.prompt, request.chat, request.shown_tools, request.chat_template_kwargs,
                          request.continue_final_message)  # fmt: skip
        check_context(self.model, ids, request.max_new_tokens)
        scoped = scoped_prefixes(self.prefixes, request.cache_salt, prefixes)
        drafters = self.row_drafters(fork_drafters)
        prediction = None
        if request.prediction is not None:
            prediction = encode_prediction(self.model, self.tokenizer, request.prediction)
            drafters = [PredictionDrafter(prediction), *drafters] if self.fallback_reason is None else []
        processor, criteria = request_criteria(self.model, self.tokenizer, ids, request, eos, self.grammars)
        sampling = Sampling(GumbelNoise.drawn(seeded(request.seed))) if request.do_sample else None
        if request.streamer is not None:
            request.streamer.put(ids.cpu())  # transformers' convention: a streamer sees the prompt first
        # The transcript stays on the host: its tokens come from the host, and checking the criteria against a
        # sequence on an accelerator would cost a copy and a sync per token.
        transcript = Transcript(ids, criteria, request.streamer, logprobs_top=request.logprobs)
        job = RowJob(ids, transcript, drafters, eos, request.max_new_tokens, processor, sampling, scoped)
        return Prepared(job, request, len(prediction or ()))

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.Tensor,
        stopping: StoppingCriteriaList,
        eos: frozenset[int],
        max_new_tokens: int,
        streamer: object | None = None,
        processor: LogitsProcessorList | None = None,
        sampling: Sampling | None = None,
        keep_logits: bool = False,
    ) -> tuple[Transcript, GenerationStats]:
        """One row with criteria and processors built elsewhere (`model.generate(custom_generate=...)`, `forerun.hf`).
        The streamer has already seen the prompt; it gets the new tokens as they are committed, then `end()`.
        `keep_logits`: the transcript keeps each new token's raw logits (the drop-in's scores and logits)."""
        transcript = Transcript(input_ids, stopping, streamer, keep_logits=keep_logits)
        drafters = self.row_drafters(fork_drafters=False)
        job = RowJob(input_ids, transcript, drafters, eos, max_new_tokens, processor, sampling, self.prefixes)
        with self.lock:
            stats = decode(self.model, job, self.budget, self.engine_config.draft_in_prefill, self.base)
        return transcript, self.told(stats)

    def row_drafters(self, fork_drafters: bool = True) -> list[Drafter]:
        """A row's drafters (`prepare`'s `fork_drafters`): none where this model verifies no guesses."""
        if self.fallback_reason is not None:
            return []
        return fork(self.drafters) if fork_drafters else list(self.drafters)

    def told(self, stats: GenerationStats) -> GenerationStats:
        """`stats` with why this model verified no guesses, where a request drafting would have drafted (the model's
        reason, over a batch's: a row of a hybrid whose chains are not exact verifies none alone either)."""
        if self.fallback_reason is not None and self.drafters:
            stats.fallback_reason = self.fallback_reason
        return stats

    @cached_property
    def batches(self) -> bool:
        """Whether rows decode together (`generate_each`, a server's continuous batch): where the model's cache can
        hold ragged rows and its trees are verified (a row's positions are its own there too); a hybrid's rows
        (chaining together where their states are windows or recorded, else one token each a step), where a batch
        gives them their own logits (`rowstates.state_rows_support`, probed at the first batch)."""
        return rows_together(self.model, self.fallback_reason, getattr(self.base, "records", False))

    def result(self, prepared: Prepared, stats: GenerationStats) -> GenerationResult:
        """A finished row's GenerationResult."""
        mark = self.grammars.call_mark() if prepared.request.shown_tools and self.tokenizer is not None else None
        return finished_result(self.tokenizer, prepared, self.told(stats), mark)
