"""Measure a model's forward-latency curve on this device, once, and keep it on disk for the cost model.

The curve (seconds per forward against tokens fed, with a cached context) depends on the architecture, the dtype,
the device and the thread count, not on the weights: it is measured at first use (a few seconds) and stored under
`~/.cache/forerun/latency/<key>.json`, the key naming exactly those. `forerun curve` measures it again and
overwrites the same file.

Sizes are measured interleaved (1, 2, 3, ... then again) and the fastest of the repeats is kept: on a shared
machine a burst of load only ever slows a forward down, so the minimum is the steadiest estimate of its cost.

Example:
    >>> curve = curve_for(model)                       # measured once, then read from the cache  # doctest: +SKIP
    >>> round(curve.relative(8), 2)                                                             # doctest: +SKIP
    1.68
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

from forerun.attention import sdpa_like
from forerun.base.chain import before_guesses, copy_states, cut_back, put_back, records_states
from forerun.base.kernels import KernelLinear
from forerun.base.packed import packed, row_table
from forerun.base.row_int8 import TILE_ROWS, RowInt8Linear
from forerun.base.stacked import stacked
from forerun.base.weights import dense, output_matrix, weights_kind
from forerun.costmodel import LatencyCurve
from forerun.forward_inputs import stateful
from forerun.head import LogitsHead
from forerun.kvcache import plain_layers, roomy_cache
from forerun.measured import (
    DEFAULT_CACHE_DIR,
    config_shape,
    device_name,
    fastest,
    read_json,
    settings_digest,
    synchronize,
    write_json,
)
from forerun.tree import as_attention_mask

__all__ = ["DEFAULT_CACHE_DIR", "curve_for", "device_name", "measure_batched", "measure_curve", "synchronize"]
SIZES = (*range(1, 17), 20, 24, 32, 48, 64)
"""Every size up to 16: matrix kernels favour some row counts (on an AVX-512 CPU, fp32, 7 tokens cost 1.9x one
token and 8 tokens 1.77x), so the cost model must see each size a step may feed, not interpolate over them."""
FORWARDS = 4
"""How forerun runs a forward, part of a curve's key: a curve stored by an older way is measured again (2: the
logits of 2-8 positions as a tall product where that is the model's own computation, `forerun.head`; 3: only at
the sizes where that product measured faster on this device; 4: one position too, its row written twice)."""
CONTEXT = 256
"""Cached tokens before each measured forward: a realistic mid-answer length."""
BATCH_ROWS = (2, 4, 8)
"""Rows per forward measured for batched decoding (between them the cost is interpolated, beyond extrapolated)."""
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
"""Tokens per row measured with several rows: a batch's per-row trees stay small."""


def curve_settings(model: torch.nn.Module) -> dict[str, object]:
    """What the curve depends on: the architecture's sizes, dtype, attention, device, threads, torch."""
    device = next(model.parameters()).device
    return (
        {
            "model": type(model).__name__,
            "architecture": config_shape(model.config),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "attention": getattr(model.config, "_attn_implementation", None) or "eager",
            "device": device_name(device),
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "torch": torch.__version__,
            "sizes": list(SIZES),  # a curve measured at other sizes is measured again
            "forwards": FORWARDS,
        }
        | ({"sdpa_masked_gqa": True} if masked_gqa(model) else {})
        | weights_settings(model)
        | ({"chains": "recorded"} if stateful(model) and records_states(model) else {})  # a curve of its own
    )  # only then: names kept


def weights_settings(model: torch.nn.Module) -> dict[str, object]:
    """{'weights': 'int4'} for quantized weights (their curve is their own), else {} (existing names kept); with
    'kernels': 'direct' where their layers call the kernel themselves (`forerun.base.kernels`: a step without the
    subclass's dispatch costs less, so a curve measured through it misprices one), 'wide_rows' where they take
    that many rows or more through unpacked weights (`forerun.base.unpacked`: a batch's wide steps cost less), and
    'output': 'dense' where the output matrix is (`quantize_weights` leaves it so); 'tile_rows' where 8-bit
    activations take that many rows or more through AMX's tiles (`forerun.base.row_int8`); 'packed': True where dense
    layers are laid out for oneDNN (`forerun.base.packed`), 'stacked' where siblings are laid out as one matrix
    (`forerun.base.stacked`), and 'rows' where they compute a few rows as more (`forerun.base.packed_rows`)."""
    kind = weights_kind(model)
    laid_out = {"packed": True} if packed(model) else {}  # oneDNN's layout: cheaper forwards, trees the most
    if stacked(model):  # siblings in one product each: cheaper forwards again
        laid_out["stacked"] = True
    table = row_table(model)
    if any(n != m for m, n in enumerate(table)):  # a few rows computed as more: another curve
        laid_out["rows"] = list(table)
    if not kind:
        return laid_out
    direct = [module for module in model.modules() if isinstance(module, KernelLinear)]
    rows = [layer.wide.rows for layer in direct if layer.wide is not None]
    wide = {"wide_rows": min(rows)} if rows else {}
    tiled = any(isinstance(module, RowInt8Linear) and module.tiles for module in model.modules())
    tiles = {"tile_rows": TILE_ROWS} if tiled else {}  # trees through AMX's tiles: cheaper, a curve of their own
    output = output_matrix(model)
    dense_output = {"output": "dense"} if output is not None and dense(getattr(output, "weight", None)) else {}
    return {"weights": kind} | ({"kernels": "direct"} | wide if direct else {}) | tiles | laid_out | dense_output


def masked_gqa(model: torch.nn.Module) -> bool:
    """Whether transformers' sdpa attends grouped key/value heads as they are under a mask (its own switch,
    `TRANSFORMERS_SDPA_FORCE_GQA=1`), instead of copying them once per query head: a tree forward of 8 rows x 4
    nodes then costs ~20 ms less in fp32 on this CPU (docs/benchmarks.md), so a curve measured one way misprices trees
    the other. Asked of transformers itself, not read from the environment."""
    if not sdpa_like(getattr(model.config, "_attn_implementation", None)):
        return False
    try:
        from transformers.integrations.sdpa_attention import use_gqa_in_sdpa
    except ImportError:  # another transformers: its sdpa path is its own business
        return False
    keys, mask = torch.zeros(1, 1, 1, 8), torch.ones(1, 1, 1, 1, dtype=torch.bool)
    return bool(use_gqa_in_sdpa(mask, keys, keys))


def curve_key(settings: dict[str, object]) -> str:
    """A file name for `settings`: the model class, dtype, threads and a hash of the rest."""
    digest = settings_digest(settings)
    threads = f"-t{settings['threads']}" if settings.get("threads") else ""
    return f"{settings['model']}-{settings['dtype']}{threads}-{digest}"


@torch.inference_mode()
def measure_curve(
    model: torch.nn.Module, sizes: Sequence[int] = SIZES, context: int = CONTEXT, repeats: int = 3, seed: int = 0
) -> LatencyCurve:
    """Time forwards of each size after `context` cached tokens; the fastest of `repeats` rounds per size."""
    if not sizes or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError("sizes must be >= 1, context >= 1 and repeats >= 1")
    return time_forwards(model, 1, sizes, context, repeats, seed)


@torch.inference_mode()
def measure_batched(
    model: torch.nn.Module,
    rows: Sequence[int] = BATCH_ROWS,
    sizes: Sequence[int] = BATCH_SIZES,
    context: int = CONTEXT,
    repeats: int = 2,
    seed: int = 0,
) -> tuple[tuple[int, LatencyCurve], ...]:
    """Per row count r: seconds of forwards of r rows x n tokens after `context` cached tokens per row, fed as a
    batch feeds them (per-row position ids, a 4-D mask: every token sees its row's cache and the tokens before
    it). The fastest of `repeats` rounds, after a warm-up round."""
    if not rows or min(rows) < 2 or not sizes or min(sizes) < 1 or context < 1 or repeats < 1:
        raise ValueError("rows must be >= 2, sizes >= 1, context >= 1 and repeats >= 1")
    return tuple((count, time_forwards(model, count, sizes, context, repeats, seed)) for count in sorted(set(rows)))


def time_forwards(
    model: torch.nn.Module, rows: int, sizes: Sequence[int], context: int, repeats: int, seed: int
) -> LatencyCurve:
    """The fastest of `repeats` rounds (after a warm-up round) of forwards of `rows` x n tokens per size n, after
    `context` random cached tokens per row, fed as the engine feeds them: a 4-D mask (every token sees its row's
    cache and the tokens before it), except for one row of one token (plain decoding's step, no mask)."""
    sizes = sorted(set(int(n) for n in sizes) | {1})
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        context = max(1, min(context, limit - max(sizes)))
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (rows, context + max(sizes)), generator=generator).to(device)
    cache = roomy_cache(model.config)  # the growing cache decoding runs on (`forerun.base.dynamic.DynamicBase`)
    head = LogitsHead(model)  # forwards as decoding runs them: this prefill decides how their logits are computed
    head(1, input_ids=ids[:, :context], cache=cache, use_cache=True)
    shape = f"{rows} rows x " if rows > 1 else ""
    what = f"timing forwards of {shape}{sizes[0]}-{sizes[-1]} tokens (once per model, dtype, device and threads)"
    records = not plain_layers(cache) and records_states(model)  # a hybrid's chains cut back, nothing copied
    cost = fastest(sizes, lambda n: time_one(head, cache, ids, rows, n, context, records), repeats, what)
    return LatencyCurve(tuple(sizes), tuple(cost[n] for n in sizes))


def time_one(
    head: LogitsHead, cache: DynamicCache, ids: torch.Tensor, rows: int, n: int, context: int, records: bool = False
) -> float:
    """Seconds of one forward of `rows` x `n` tokens (`ids[:, context : context + n]`) after `context` cached
    tokens per row, the cache cropped back after it (a hybrid's chain: its states copied first and put back, or,
    `records`, recorded through the forward and cut back, as `forerun.base.chain` steps)."""
    model, device = head.model, ids.device
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    positions = torch.arange(context, context + n, device=device).expand(rows, n)
    masked = {}
    chained = not plain_layers(cache)  # recurrent states: a chain, its states copied first (`forerun.base.chain`)
    if (rows > 1 or n > 1) and not chained:  # as decoding feeds them: a tree's 4-D mask, or the root alone
        visible = torch.ones(rows, 1, n, context + n, dtype=torch.bool)
        visible[..., context:] = torch.ones(n, n, dtype=torch.bool).tril()
        masked["attention_mask"] = as_attention_mask(visible, attention, model.dtype).to(device)
    copies = copy_states(cache) if chained and n == 1 else None  # a 1-token step copies nothing: not timed
    synchronize(device)
    started = time.perf_counter()
    recording = False
    if chained and n > 1:  # a chain's step records its states or copies them first: timed
        recording, copies = before_guesses(cache, n, records)
    head(input_ids=ids[:, context : context + n], cache=cache, position_ids=positions, use_cache=True,
         **masked)  # fmt: skip
    synchronize(device)
    seconds = time.perf_counter() - started
    if copies is not None:
        put_back(cache, copies, context)
    elif recording:
        cut_back(cache, n, context)
    else:
        cache.crop(-n)  # back to the context (negative: drop the last n)
    return seconds


def batches_of(model: torch.nn.Module, base: object | None) -> tuple[tuple[int, LatencyCurve], ...]:
    """The batched row curves: a static base's batches (its siblings' steps), else the growing cache's."""
    if base is not None:
        return base.measure_rows(BATCH_ROWS, BATCH_SIZES, CONTEXT)
    return measure_batched(model)


def curve_path(model: torch.nn.Module, cache_dir: Path | str = DEFAULT_CACHE_DIR, base: object | None = None) -> Path:
    return settings_path(base_settings(model, base), cache_dir)


def settings_path(settings: dict[str, object], cache_dir: Path | str) -> Path:
    """Where the curve of `settings` is kept under `cache_dir`."""
    return Path(cache_dir).expanduser() / "latency" / f"{curve_key(settings)}.json"


def base_settings(model: torch.nn.Module, base: object | None) -> dict[str, object]:
    """The curve's settings, with those of the base it is measured on (`forerun.base.static.StaticBase.settings`)."""
    return curve_settings(model) | (base.settings() if base is not None else {})


def save_curve(curve: LatencyCurve, path: Path, settings: dict[str, object]) -> None:
    """Write the curve as JSON (a temporary file renamed over the target: never a half-written file)."""
    write_json(path, {"settings": settings, **curve.as_dict()})


def load_curve(path: Path) -> LatencyCurve | None:
    """The curve stored at `path`, or None if it is missing or unreadable (then it is measured again)."""
    data = read_json(path)
    try:
        return None if data is None else LatencyCurve.from_dict(data)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def kept_as_measured(curve: LatencyCurve | None, base: object | None) -> LatencyCurve | None:
    """`curve` as read from its file where it holds what `curve_for` measures (every size of `SIZES`, or each size up
    to a static base's largest bucket; batched rows `BATCH_ROWS` at `BATCH_SIZES`); its single-row part alone where
    only the batched part differs; None where the single-row part differs (then it is measured again).

    A curve of other sizes under the same key (a `forerun curve --sizes 1` of an older forerun stored its one size
    there) would price every step on what it holds: with one size nothing larger is ever fed, and a model never
    drafts again, silently.

    Example:
        >>> kept_as_measured(LatencyCurve((1,), (0.05,)), None) is None
        True
        >>> full = LatencyCurve(SIZES, tuple(0.01 + 0.001 * n for n in SIZES))
        >>> odd_rows = full.with_batches(((2, LatencyCurve((1, 2), (0.02, 0.03))),))
        >>> kept_as_measured(full, None) is full, kept_as_measured(odd_rows, None).batched
        (True, ())
    """
    if curve is None:
        return None
    sizes = tuple(SIZES) if base is None else tuple(range(1, base.largest + 1))
    if curve.sizes != sizes:
        return None
    rows = tuple(count for count, _ in curve.batched)
    row_sizes = {row_curve.sizes for _, row_curve in curve.batched}
    if curve.batched and (rows != BATCH_ROWS or (base is None and row_sizes != {BATCH_SIZES})):
        return curve.with_batches(())  # measured again when a batch asks for it
    return curve


def curve_for(
    model: torch.nn.Module,
    cache_dir: Path | str | None = DEFAULT_CACHE_DIR,
    batched: bool = False,
    base: object | None = None,
) -> LatencyCurve:
    """The model's curve on this device: read from `cache_dir`, else measured now and stored there.

    `batched=True`: with its batched row curves (`measure_batched`, ten seconds or so, measured the first time a
    batch needs them and added to the same file). `cache_dir=None` measures without reading or writing any file.
    `base`: a `forerun.base.static.StaticBase` whose bucketed steps are what the single-row curve times (its own
    `measure_curve`, stored under its own key).
    """
    measure = base.measure_curve if base is not None else lambda: measure_curve(model)
    if cache_dir is None:
        curve = measure()
        return curve.with_batches(batches_of(model, base)) if batched else curve
    settings = base_settings(model, base)  # once: a hybrid's are read off a probe forward (`records_states`)
    path = settings_path(settings, cache_dir)
    curve = kept_as_measured(load_curve(path), base)
    missing = curve is None or (batched and not curve.batched)
    if curve is None:
        curve = measure()
    if batched and not curve.batched:
        curve = curve.with_batches(batches_of(model, base))
    if missing:
        try:
            save_curve(curve, path, settings)
        except OSError:
            pass  # a read-only home: the curve still serves this process
    return curve
