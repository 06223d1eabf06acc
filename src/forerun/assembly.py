"""What a `Decoder` is assembled from, besides its drafters: its draft model, its EAGLE-3 head, its base and its
budget, each made (and checked) from the method plan and the engine's settings.

Example (what `Decoder.__init__` does, in order; on a CPU with method auto):
    >>> plan, config = method_plan("auto", {}, "cpu", None), EngineConfig()         # doctest: +SKIP
    >>> prepare_draft(model, tokenizer, plan, None, None), prepare_head(model, plan, None)  # doctest: +SKIP
    (None, None)
    >>> base = make_base(model, config, "cpu")            # None: the growing cache  # doctest: +SKIP
    >>> make_budget(model, plan, config, None, DEFAULT_CACHE_DIR, base, True)       # doctest: +SKIP
    CostModel(...)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from forerun.base.chain import ChainBase, chain_support, crops_states, reads_on, records_states
from forerun.base.static import StaticBase, graph_features, static_support
from forerun.base.weights import weights_kind
from forerun.batch import batchable
from forerun.config import EngineConfig
from forerun.costmodel import Budget, CostModel, DraftSwitch, ForwardTimes, LatencyCurve, StaticBudget
from forerun.costmodel.switch import FIRST_PROBE_STEPS
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.feed_probe import check_feed
from forerun.forward_inputs import check_cache_input, stateful
from forerun.latency import batches_of, curve_for
from forerun.methods import MethodPlan, plan_method
from forerun.prefixcache import PrefixCache, Prefixes
from forerun.rowstates import state_rows_support
from forerun.tree import tree_support

logger = logging.getLogger(__name__)


def method_plan(method: str | MethodPlan, knobs: dict[str, object], device_type: str, draft_head: object) -> MethodPlan:
    """The Decoder's method plan: `method` parsed with its `knobs` for the device, or a plan already parsed (by a
    run specification: not rendered as text again), which carries its own knobs; a given `draft_head` makes 'auto'
    draft with it too."""
    if not isinstance(method, MethodPlan):
        return plan_method(method, knobs, device_type, head=draft_head is not None)
    if knobs:
        raise ValueError(f"a MethodPlan carries its knobs; got {sorted(knobs)} besides")
    return method if draft_head is None else method.with_head()


def prepare_draft(
    model: torch.nn.Module, tokenizer, plan: MethodPlan, draft: torch.nn.Module | str | None, draft_tokenizer
) -> torch.nn.Module | None:
    """The draft model of method 'draft_model': given, loaded by name, or the target's own first layers; None
    where the plan has no draft model (one given then is an error)."""
    from forerun.drafters.draft_model import check_same_vocabulary, load_draft, self_draft

    if not plan.uses_model():
        if draft is not None:
            raise ValueError(f"draft_model is a knob of method 'draft_model', which is not part of {plan.text!r}")
        return None
    layers = plan.model_config().self_draft_layers
    if layers:
        if draft is not None:
            raise ValueError("give either draft_model or self_draft_layers, not both")
        return self_draft(model, layers)
    if draft is None:
        raise ValueError(
            "method 'draft_model' needs draft_model=... (a model sharing the target's tokenizer, or its name) "
            "or the knob self_draft_layers=K (the target's own first K layers)"
        )
    if isinstance(draft, str):
        draft = load_draft(draft, model, tokenizer)
    else:
        check_same_vocabulary(model, draft, tokenizer, draft_tokenizer)
    check_draft_model(draft)
    return draft


def check_draft_model(draft: torch.nn.Module) -> None:
    """A draft model drafts on a cache it rolls back to the target's accepted text: a causal model taking a
    transformers cache, without recurrent states (those cannot step back)."""
    check_causal(draft, "draft model ")
    if stateful(draft):
        raise ValueError(
            f"draft model {type(draft).__name__} keeps recurrent states (state-space, linear-attention or convolution "
            "layers), "
            "which cannot step back to the target's accepted text; give a transformer draft model"
        )


def prepare_head(
    model: torch.nn.Module, plan: MethodPlan, head: str | Path | torch.nn.Module | None
) -> torch.nn.Module | None:
    """The EAGLE-3 head of method eagle3: given as a module, or read from a folder (`load_head`); None where the
    plan has no head (one given then is an error)."""
    from forerun.drafters.eagle3 import load_head

    if not plan.uses_head():
        if head is not None:
            raise ValueError(f"draft_head is for method 'eagle3' (or 'auto'), which is not part of {plan.text!r}")
        return None
    if head is None:
        raise ValueError("method 'eagle3' needs draft_head=PATH (a folder with an EAGLE-3 head in SpecForge's layout)")
    return head if isinstance(head, torch.nn.Module) else load_head(head, model)


def make_base(
    model: torch.nn.Module, config: EngineConfig, device_type: str, read: Sequence[int] = ()
) -> StaticBase | None:
    """The static base for single rows (`EngineConfig.static_cache`; by default on a CUDA device), or None for the
    engine's growing cache. `read`: the layers the drafters read (a head's), returned by the base's forwards where
    it can (`graph_features`)."""
    wanted = config.static_cache
    if wanted is False or (wanted is None and device_type != "cuda"):
        if config.compile_buckets:  # said, not ignored in silence
            logger.warning("forerun: compile_buckets compiles the static cache's buckets, which are off here "
                           "(static_cache=%s, a %s device): nothing is compiled; static_cache=True turns them on",
                           wanted, device_type)  # fmt: skip
        return None
    reason = static_support(model)
    if reason is not None:  # a warning where it was asked for; by default (a card's) the growing cache is the plan
        level = logging.WARNING if wanted else logging.INFO
        logger.log(level, "forerun: no static cache for this model (%s); using the growing cache", reason)
        return None
    features = graph_features(model, read)
    if read and not features:
        logger.info("forerun: the head reads the target's last layer: it drafts only where no graph replays")
    return StaticBase(model, compiled=config.compile_buckets, features=features)


def verifying_base(model: torch.nn.Module, base: StaticBase | None) -> tuple[StaticBase | ChainBase | None, str | None]:
    """The base a single row's guesses are verified on, and why none can be (None: they can): a model with
    recurrent states verifies chains on a `ChainBase` where `chain_support` finds them exact (its prefix cache then
    keeps states too); others verify trees on `base` where `tree_support` allows and, for a family the tests do not
    cover, where `feed_probe.check_feed` finds a tree's logits the model's own (it raises for a model whose steps
    it finds wrong: no way of feeding it is exact)."""
    if not stateful(model):
        reason = tree_support(model)
        return base, check_feed(model, trees=reason is None) or reason
    check_feed(model, trees=False)
    records = records_states(model)  # a partly accepted chain's states cut back, not put back and fed again
    reason = chain_support(model, records)
    return (ChainBase(model, records) if reason is None else base), reason


def make_budget(
    model: torch.nn.Module,
    plan: MethodPlan,
    config: EngineConfig,
    latency: LatencyCurve | None,
    latency_cache: str | Path | None,
    base: StaticBase | ChainBase | None,
    drafting: bool,
    chain: bool = False,
) -> Budget:
    """The cost model (model-free methods and combinations, or adaptive=True) or a static node budget;
    `drafting`: whether there are drafters at all (without any, nothing is left to weigh); `chain`: it feeds one
    chain a step (`forerun.base.chain`)."""
    adaptive = plan.adaptive if config.adaptive is None else config.adaptive
    if config.max_tree_nodes is not None and config.max_tree_nodes < plan.min_budget():
        raise ValueError(
            f"{plan.text} needs at least {plan.min_budget()} nodes per forward with these knobs "
            f"(the Jacobi window's W x (N-1) probes and the root), but max_tree_nodes={config.max_tree_nodes}"
        )
    if not (adaptive and drafting):
        return StaticBudget(config.max_tree_nodes or (plan.static_budget() if plan.specs else 16), chain)
    static = base if isinstance(base, StaticBase) else None
    curve = latency if latency is not None else curve_for(model, latency_cache, base=static)
    cap = config.max_tree_nodes or max(curve.default_cap(), plan.min_budget())
    # a measured curve is corrected by what this run's forwards take (unless choices must be reproducible); a
    # given one is the price as it is
    reproducible = config.reproducible
    if reproducible is None:
        reproducible = model.dtype != torch.float32 or weights_kind(model) is not None
    times = ForwardTimes() if latency is None and not reproducible else None
    # costly drafters (a trained head's forwards) are weighed against rates without them: measured, or priced on
    # the curve where choices must be reproducible
    return CostModel(
        curve,
        cap,
        times=times,
        reproducible=reproducible,
        switch=DraftSwitch(probing=FIRST_PROBE_STEPS, paired=True),
        chain=chain,
        refeeds=not (chain and ((isinstance(base, ChainBase) and base.records) or crops_states(model))),
    )


def price_costly(drafters: Sequence[object], budget: Budget, cache_dir: str | Path | None) -> None:
    """Where the budget prices steps instead of timing them (reproducible choices), give each costly drafter (a
    trained head) what its own forwards cost on this device (`price`: stored in `cache_dir`, or measured now), so
    that the switch weighs them at what they take here, not at what they weigh."""
    if isinstance(budget, CostModel) and budget.reproducible and budget.switch is not None:
        for drafter in drafters:
            if getattr(drafter, "costly", False) and hasattr(drafter, "price"):
                drafter.price(cache_dir)


def check_causal(model: torch.nn.Module, role: str = "") -> None:
    """forerun decodes causal (decoder-only) language models that take a transformers cache; an encoder-decoder
    (T5, BART) or a model keeping a state of its own (Mamba, RWKV) is refused by name (`role`: e.g. "draft model
    ", naming which of the models it is)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{role}{type(model).__name__} is an encoder-decoder model; forerun decodes causal (decoder-only) "
            "language models"
        )
    try:
        check_cache_input(model)
    except ValueError as error:
        raise ValueError(f"{role}{error}") from None


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


def rows_together(model: torch.nn.Module, fallback_reason: str | None, records: bool = False) -> bool:
    """Whether `model`'s rows decode together in a batch: where its cache holds ragged rows and its trees are
    verified (`fallback_reason`, the Decoder's, is None: a row's positions are its own in a batch too); a hybrid's
    (its rows chaining together where its states are windows, or recorded: `records`; else one token per row a
    step), where the probe finds each row's logits its own (`rowstates.state_rows_support`)."""
    if not stateful(model):
        return fallback_reason is None and batchable(model)
    reason = state_rows_support(model, records)
    if reason is not None:
        logger.info("forerun: a batch's rows decode one after another: %s", reason)
    return reason is None


def warm_graphs(
    base: StaticBase, drafters: Sequence[object], longest: int, batch_size: int, single: bool, batched: bool
) -> float:
    """Capture (and compile, where the base does) the graphs `Decoder.warm_up` promises, for texts of up to
    `longest` cache slots; returns the seconds spent. `single`: a lone request's buckets, and a trained head's
    graphs (a batch's rows run heads eagerly); `batched`: every row count a batch of `batch_size` rows is padded
    to, at its places, and a draft model's slot cache for each row."""
    seconds = 0.0
    if single:
        seconds += base.warm(longest)
        warmed = [drafter for drafter in drafters if callable(getattr(drafter, "warm", None))]
        seconds += sum(drafter.warm(longest) for drafter in warmed)
    if batched:  # the places `generate_each` and a server's batch take
        rows = base.sibling(batch_size)
        seconds += rows.warm(longest, rows.row_buckets, placed=True)
        drafts = [drafter for drafter in drafters if isinstance(drafter, DraftModelDrafter)]
        seconds += sum(drafter.warm(longest, rows=batch_size) for drafter in drafts)
    return seconds


def with_batched_rows(
    model: torch.nn.Module, budget: Budget, base: object, latency_cache: str | Path | None, measure: bool
) -> Budget:
    """`budget` whose curve prices batched rows too (`LatencyCurve.batch_cost`): measured on `base` the first time
    (stored beside the curve under `latency_cache`), unless `measure` is False or the model is a hybrid, whose
    rows verify no trees. Without batched rows a batch is priced as one row of as many tokens."""
    curve = budget.curve
    if curve is None or not measure or stateful(model) or curve.batched:
        return budget
    # on the base the curve was measured on: a static base's batches are its siblings' steps
    if latency_cache is None:
        budget.curve = curve.with_batches(batches_of(model, base))
    else:
        budget.curve = curve_for(model, latency_cache, batched=True, base=base)
    return budget


def scoped_prefixes(cache: PrefixCache, salt: str | None, views: dict[str, Prefixes] | None) -> Prefixes:
    """The prefixes a request with `cache_salt=salt` may read: the whole cache without a salt, else its view for
    that salt, made once per batch through `views` (salt -> view), so that a batch's rows of one salt share it.

    Example:
        >>> views = {}                                                        # doctest: +SKIP
        >>> scoped_prefixes(cache, "tenant-a", views) is scoped_prefixes(cache, "tenant-a", views)  # doctest: +SKIP
        True
    """
    salt = salt or ""
    scoped = views.get(salt) if views is not None else None
    if scoped is None:
        scoped = cache.scoped(salt) if salt else cache
        if views is not None:
            views[salt] = scoped
    return scoped


PREFIX_BYTES = 2**30
"""The keys and values a Decoder's prefix cache keeps by default, at most: 1 GiB."""


def prefix_tokens(model: torch.nn.Module, minimum: int = 4096) -> int:
    """The tokens a Decoder's prefix cache keeps by default: four of the model's contexts (a long conversation's
    next turn and an agent's long prompt are read again, not prefilled), as many as `PREFIX_BYTES` of keys and
    values hold, never fewer than `minimum`.

    Example (SmolLM2-135M: 30 layers of 3 key/value heads of 64 values; 8,192 tokens of context):
        >>> prefix_tokens(model)  # fp32: 46,080 bytes a token, 23,301 in 1 GiB (bf16: 4 contexts)  # doctest: +SKIP
        23301
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(config, "max_position_embeddings", None) or minimum
    return max(minimum, min(4 * context, PREFIX_BYTES // kv_bytes_per_token(model)))


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """The bytes of keys and values a token takes in `model`'s cache: every layer's key and value heads, in the
    activations' dtype (4-bit weights: bf16's), as a plain full-attention model holds them.

    Example (SmolLM2-135M in fp32: 30 layers x 2 x 3 heads x 64 values x 4 bytes):
        >>> kv_bytes_per_token(model)                                                  # doctest: +SKIP
        46080
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None) or 0
    heads = getattr(config, "num_attention_heads", None) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) or 0) // heads
    width = getattr(getattr(model, "dtype", None), "itemsize", 4)
    return max(layers * 2 * kv_heads * head_dim * width, 1)


def reads_on_states(model: torch.nn.Module) -> bool:
    """Whether `model`, fed several tokens after its cache, reads them as one forward over the whole text would: any
    model without recurrent states; a hybrid where the probe finds so (`forerun.base.chain.reads_on`). Where not,
    its prompts are read whole: no prefix cache, no chunks."""
    if not stateful(model) or reads_on(model):
        return True
    logger.info("forerun: %s loses its states read on after its cache: prompts read whole", type(model).__name__)
    return False


def make_prefixes(model: torch.nn.Module, prefix_cache: PrefixCache | int | str | None, reads: bool) -> PrefixCache:
    """A Decoder's prefix cache: the one given (shared), or one of that many tokens ("auto": `prefix_tokens`;
    0 or None: off); off where the model cannot read a prompt on from a stored cache (`reads`: `reads_on_states`)."""
    if not reads:
        return PrefixCache(0)
    if isinstance(prefix_cache, PrefixCache):
        return prefix_cache
    if isinstance(prefix_cache, str):
        if prefix_cache != "auto":
            raise ValueError(
                f"prefix_cache must be 'auto', a number of tokens or a PrefixCache, got {prefix_cache!r:.40}"
            )
        return PrefixCache(prefix_tokens(model))
    return PrefixCache(prefix_cache or 0)
