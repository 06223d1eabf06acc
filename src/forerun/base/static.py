"""The GPU's base: a preallocated cache, trees padded to a few sizes, one captured forward per size.

A GPU runs a small model's forward in well under a millisecond, and an eager Python loop spends tens of
milliseconds launching its kernels. What makes it fast is what the field's GPU engines do: fix the shapes, capture
the forward once as a CUDA graph, and replay it.

- **Slots, not a growing cache.** Keys and values live in one buffer per layer of `places` rows of `length`
  slots (`forerun.base.slots`). A forward after `prefix_len` committed tokens writes its nodes at slots
  prefix_len, prefix_len + 1, ... of its place; the commit gathers the accepted path to the front of that region
  in place; slots past the committed length are never visible, so nothing is cleared.
- **Rows.** A batch's rows are places 0..R-1 of one forward (`forward_rows`), R a row bucket (`ROW_BUCKETS`),
  each row at its own prefix length (no left padding, no holes); places no row holds are fed a padding root. A
  joining row's prompt is fed into its own place (`forward(..., place=p)`), the others waiting; rows joining
  together are fed side by side, every place's chunk in the same forward (`forward_places`, `prompt_feed`).
- **Buckets.** A tree of n nodes is fed as the smallest bucket B >= n (`BUCKETS`); the padding nodes repeat the
  root, see only the prefix and themselves, and write into slots that the next forward overwrites. The latency
  curve is measured per bucket (`measure_curve`), so the cost model prices a tree at its bucket's cost and fills it.
- **One graph per (rows, bucket)**, captured at first use (warm-up forwards write only into a scratch region at
  the end of the cache) and replayed after: the step's inputs (per row: place, prefix length, tokens, depths,
  ancestry) travel in one host-to-device copy into the graph's input buffer; the mask, positions and slots are
  computed inside the graph.
- **One device-to-host copy per step**: the target's argmax at every node, computed inside the graph.
- **Features from the graph too**: the outputs of the decoder layers a trained head reads (`features`), taken
  from the forward's own hidden states inside the graph; forward hooks do not run when a graph replays.
- **The prompt through the same graphs**: a prefill feeds the prompt in chunks of the largest bucket (a chain is
  a tree), then the rest of it with the first tree; no eager forward of a shape seen once.

On a CPU the same bucketed forward runs without graphs, eagerly (what the CPU tests check token for token against
plain generate) or compiled (`compiled=True`, with `static_cache=True`: inductor fuses the small operators between
the products; docs/benchmarks.md says where that paid).

Example (a GPU):
    >>> base = StaticBase(model)                                         # doctest: +SKIP
    >>> base.begin(max_len=600)                                          # None: trees can be verified  # doctest: +SKIP
    >>> out = base.forward(tree, prefix_len=300, lead=())                # 5 nodes fed as bucket 8  # doctest: +SKIP
    >>> out.logits.shape, out.argmax.shape                               # doctest: +SKIP
    (torch.Size([5, 49152]), torch.Size([5]))
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from types import MethodType

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from forerun.base import static_timing
from forerun.base.bucket_steps import BucketStep, Outputs, capture, compiled_copy, new_step, refuse_laid_out
from forerun.base.dynamic import TreeLogits
from forerun.base.place_prefixes import seed_place, store_place
from forerun.base.prompt_feed import Fed, feed_places
from forerun.base.slots import SlotLayer, Slots, copy_place, gather_paths
from forerun.base.step_inputs import fill_host
from forerun.costmodel import LatencyCurve
from forerun.forward_inputs import cache_argument
from forerun.kvcache import UnsupportedCacheError, check_tree_cache
from forerun.prefixcache import Prefixes
from forerun.tree import TokenTree, tree_support

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Node counts a forward is padded to: each has its own captured graph and its own point on the latency curve."""
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts a batch's forward is padded to (capped at the base's places): a graph per (rows, nodes)."""
LENGTH_STEP = 512
"""The cache's slot count is rounded up to a multiple of this: requests of similar lengths reuse its graphs."""


def static_support(model: torch.nn.Module, max_len: int | None = None) -> str | None:
    """None if `model` can verify trees on slots for texts of `max_len` tokens (None: of some length), else why
    not: the growing cache's own conditions (`kvcache.check_tree_cache`). A sliding-window layer holds every token
    while the text is shorter than its window, and the tree's mask is the one every layer gets: there it is a
    full-attention layer."""
    reason = tree_support(model)
    if reason is not None:
        return reason
    try:
        check_tree_cache(DynamicCache(config=model.config), max_len or 0, type(model).__name__)
    except UnsupportedCacheError as error:
        return str(error)
    return None


def graph_features(model: torch.nn.Module, layers: Sequence[int]) -> tuple[int, ...]:
    """The decoder layers of `layers` a static base returns from its forwards: all of them where none is the last
    (transformers hands the last layer's output back after the final norm), else none (the step loop's hooks read
    them then, on the forwards that are not replayed graphs).

    Example (a 30-layer target; an EAGLE-3 head's usual choice, then one that reads the last layer):
        >>> from types import SimpleNamespace; from transformers import LlamaConfig
        >>> model = SimpleNamespace(config=LlamaConfig(num_hidden_layers=30))
        >>> graph_features(model, (1, 14, 26)), graph_features(model, (1, 14, 29))
        ((1, 14, 26), ())
    """
    last = model.config.get_text_config(decoder=True).num_hidden_layers - 1
    return tuple(layers) if all(0 <= i < last for i in layers) else ()


class StaticBase:
    """Verifies trees on slots in buckets (module docstring); `graphs` (None: on a CUDA device) captures each
    (rows, bucket) forward once and replays it. `places`: rows it holds at once (1: a single row's base)."""

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: Sequence[int] = BUCKETS,
        graphs: bool | None = None,
        compiled: bool = False,
        places: int = 1,
        features: Sequence[int] = (),
        program: Callable[..., Outputs] | None = None,
    ) -> None:
        """`compiled`: each bucket's forward goes through `torch.compile` (inductor fuses transformers' small
        kernels; on a GPU before it is captured): tens of seconds per program once, then shorter steps where
        launches and Python, not arithmetic, bound them. Off by default (the compiling is the user's to choose).
        `features`: decoder layers (below the last: `graph_features`) whose outputs every forward also returns,
        concatenated (`TreeLogits.features`): what an EAGLE-3 head reads. `program`: the compiled forward to use
        (`bucket_steps.compiled_copy`; a sibling gets its maker's, so every row count shares one)."""
        self.model = model
        self.cache_name = cache_argument(model) or "past_key_values"
        self.layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.features = tuple(features)
        if graph_features(model, self.features) != self.features:
            raise ValueError(f"features are read from layers 0..{self.layers - 2}, got {list(features)}")
        if compiled and program is None:
            refuse_laid_out(model)
            program = compiled_copy(StaticBase.bucket_forward)
        self.program, self.compiled = program, program is not None
        self.step_forward: Callable[[int, torch.Tensor, bool], Outputs] = (
            self.bucket_forward if program is None else MethodType(program, self)
        )
        # one program for every row count: a base per count compiling its own made a 16-row server's warm-up
        # compile ~26 programs (the GPU benchmark's; 6 this way), each tens of seconds on a card's host
        self.rows_program = program if places > 1 or program is None else compiled_copy(StaticBase.bucket_forward)
        """The compiled forward this base's siblings share (a single row's base keeps its own apart)."""
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] != 1:
            raise ValueError(f"buckets must include 1, got {list(buckets)}")
        if places < 1:
            raise ValueError(f"places must be >= 1, got {places}")
        self.places = places
        self.row_buckets = (*(b for b in ROW_BUCKETS if b < places), places)
        self.lone_placed = self.compiled and places > 1
        """A lone row at place 0 is fed as a placed row (its place read by index), not by a program of its own:
        dynamo always specialises a row count of 1, so a batch's compiled forwards would otherwise make three
        families of programs (one row, one placed row, many rows), each one for a single node and one for more."""
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"graphs=True needs a CUDA device; the model is on {self.device}")
        self.attention = getattr(model.config, "_attn_implementation", None) or "eager"
        self.length = 0
        self.slots = Slots(self.layers, places, 0)
        self.cache: Cache | None = None
        self.steps: dict[tuple[int, int, bool], BucketStep] = {}
        self.capture_seconds = 0.0
        """Seconds spent warming and capturing graphs so far (once per bucket and cache size)."""
        self.capture_error: str | None = None
        """Why a capture failed (that bucket then runs eagerly), if one did."""
        self.siblings: dict[int, StaticBase] = {}
        self.supported = -1
        """The longest text `begin` found this model can verify trees for (-1: none checked yet)."""

    def sibling(self, places: int) -> StaticBase:
        """A base like this one holding `places` rows (a batch's), made once per count and kept."""
        if places == self.places:
            return self
        if places not in self.siblings:
            self.siblings[places] = StaticBase(
                self.model, self.buckets, self.graphs, self.compiled, places, self.features, self.rows_program
            )
        return self.siblings[places]

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The bucket a tree of `n` nodes is fed as."""
        for size in self.buckets:
            if n <= size:
                return size
        raise ValueError(f"a tree of {n} nodes exceeds the largest bucket ({self.largest})")

    def row_bucket(self, rows: int) -> int:
        """The row count a forward over places 0..rows-1 is fed as."""
        for size in self.row_buckets:
            if rows <= size:
                return size
        raise ValueError(f"{rows} rows exceed this base's {self.places} places")

    def begin(self, max_len: int) -> str | None:
        if max_len > self.supported:  # what serves a text serves any shorter one (a window only limits length)
            reason = static_support(self.model, max_len)
            if reason is not None:
                return reason
            self.supported = max_len  # checking builds a cache of every layer: ~2 ms a row on a card's host
        needed = max_len + self.largest  # the last `largest` slots are the warm-ups' scratch region
        if needed > self.length:
            self.allocate(LENGTH_STEP * math.ceil(needed / LENGTH_STEP))
        return None

    def allocate(self, length: int) -> None:
        """A cache of `length` slots, holding what the old one held; graphs captured on the old one are dropped
        (they point at its buffers)."""
        old, self.length, self.steps = self.slots, length, {}
        self.slots = Slots(self.layers, self.places, length)
        if old.kv is not None:  # rows held while a longer one joins keep their slots
            self.slots.kv = old.kv.new_zeros((*old.kv.shape[:4], length, old.kv.shape[5]))
            self.slots.kv[..., : old.length, :] = old.kv
        elif self.places > 1 and self.cache is not None and any(layer.is_initialized for layer in self.cache.layers):
            raise ValueError("a static cache with separate key and value widths cannot grow while it holds rows")
        self.cache = Cache(layers=[SlotLayer(length, self.slots, i) for i in range(self.layers)])
        self.columns = torch.arange(length, device=self.device)
        self.offsets = torch.arange(self.largest, device=self.device)

    def warm(self, max_len: int, rows: Sequence[int] = (1,), placed: bool = False) -> float:
        """Make every bucket's graph (and compiled program) now, for texts of up to `max_len` tokens and forwards
        of each of `rows`, instead of at each one's first use; returns the seconds it took. `placed`: also the
        forwards that feed one joining row's prompt into its own place (a batch's). A server calls it once before
        taking requests."""
        started = time.perf_counter()
        reason = self.begin(max_len)
        if reason is not None:
            raise ValueError(f"this model cannot verify trees on the static cache: {reason}")
        wanted = [self.key_of(count, size, False) for count in rows for size in self.buckets]
        wanted += [(1, size, True) for size in self.buckets] if placed else []
        for key in wanted:
            if key not in self.steps:
                self.prepare(*key)
        return time.perf_counter() - started

    def seed(self, prefixes: Prefixes | None, tokens: list[int]) -> int:
        return seed_place(self, prefixes, tokens, 0)

    def store(self, prefixes: Prefixes | None, tokens: list[int], length: int) -> None:
        store_place(self, prefixes, tokens, length, 0)

    def forward(self, tree: TokenTree, prefix_len: int, lead: Sequence[int], place: int = 0) -> TreeLogits:
        """The tree's logits and argmaxes after `prefix_len` committed tokens of `place`, of which `lead` (a
        prefill's prompt) is fed first, through the buckets (`forerun.base.prompt_feed`): in chunks of the
        largest, then its rest with the tree in one. An eager forward of a shape seen once costs a card its
        launches and a fresh attention plan per prompt length, many steps' worth (the benchmarks page, GPU); only
        a tree wider than every bucket runs one."""
        return feed_places(self, {place: (tree, prefix_len, lead)})[place]

    def forward_places(self, items: Fed) -> dict[int, TreeLogits]:
        """`forward` of several places at once (rows joining together), in the same forwards (`feed_places`)."""
        return feed_places(self, items)

    def forward_rows(self, fed: Mapping[int, tuple[TokenTree, int]]) -> tuple[torch.Tensor, list[list[int]]]:
        """One forward of a batch's rows, `fed` {place: (tree, prefix_len)}: logits [R, B, vocab] (row r: place
        r, rows past the last place fed dropped) and every node's argmax, in the step's one copy to the host."""
        logits, choices, _ = self.run(fed, placed=False)
        rows, nodes = max(fed) + 1, max(len(tree) for tree, _ in fed.values())
        return logits[:rows, :nodes].clone(), choices[:rows, :nodes].tolist()

    def run(self, fed: Mapping[int, tuple[TokenTree, int]], placed: bool) -> Outputs:
        """One bucketed forward of `fed` {place: (tree of at most `largest` nodes, prefix_len)}: logits [R, B,
        vocab], argmaxes [R, B] and the `features` [R, B, F], on the device, none of it copied to the host (the
        step does that once, `forerun.host_copy`). Row r is place r; `placed`: one place fed alone, row 0 (the
        other places are neither fed nor read). The inputs travel in a non-blocking copy from a pinned buffer,
        which is refilled only once that copy has been made (`BucketStep.copied`), whatever ran since."""
        rows, size, placed = self.step_key(fed, placed)
        step = self.steps.get((rows, size, placed)) or self.prepare(rows, size, placed)
        if step.copied is not None:
            step.copied.synchronize()
        host = step.host.numpy()
        for r, place in enumerate(fed if placed else range(rows)):
            if place in fed:
                host[r, 0] = place
                fill_host(host[r, 1:], fed[place][0], fed[place][1], size)
            else:
                host[r] = step.idle
                host[r, 0] = place
        step.inputs.copy_(step.host, non_blocking=True)
        if step.copied is not None:
            step.copied.record()
        if step.graph is not None:
            step.graph.replay()
            return step.logits, step.choices, step.features
        return self.step_forward(size, step.inputs, placed)

    def step_key(self, fed: Mapping[int, tuple[TokenTree, int]], placed: bool) -> tuple[int, int, bool]:
        """The (rows, bucket, placed) step `run` feeds `fed` through (`key_of`)."""
        size = self.bucket(max(len(tree) for tree, _ in fed.values()))
        return self.key_of(1 if placed else self.row_bucket(max(fed) + 1), size, placed)

    def key_of(self, rows: int, size: int, placed: bool) -> tuple[int, int, bool]:
        """The (rows, bucket, placed) step that feeds `rows` rows of `size` nodes: a lone row of a compiled batch
        base as a placed one (`lone_placed`)."""
        placed = placed or (rows == 1 and self.lone_placed)
        return (1 if placed else rows), size, placed

    def bucket_forward(self, size: int, inputs: torch.Tensor, placed: bool = False) -> Outputs:
        """The forward of one (rows, bucket) from its input buffer (module docstring): logits [R, B, vocab],
        argmax [R, B], features [R, B, F] or None. Every shape is fixed by the buffer and the cache length, and
        nothing waits for the host: capturable."""
        rows = inputs.shape[0]
        places, prefix = inputs[:, 0], inputs[:, 1:2]  # [R], [R, 1]
        ids, depths = inputs[:, 2 : 2 + size], inputs[:, 2 + size : 2 + 2 * size]
        ancestry = inputs[:, 2 + 2 * size :].view(rows, size, size).bool()  # [R, B, B]
        self.slots.point(places, prefix + self.offsets[:size], contiguous=not placed)
        relative = self.columns - prefix  # [R, length]: column j holds node j - prefix, or the prefix where < 0
        in_tree = (relative >= 0) & (relative < size)
        where = relative.clamp(0, size - 1)[:, None, :].expand(rows, size, -1)
        visible = ancestry.gather(2, where) & in_tree[:, None, :]  # [R, B, length]
        visible = visible | (relative < 0)[:, None, :]
        logits, features = self.call(ids, prefix + depths, visible[:, None])
        return logits, logits.argmax(-1), features

    def call(
        self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One call of the unmodified model; `visible` [R, 1, q, length] bool. Returns logits [R, q, vocab] and the
        `features` layers' outputs [R, q, F] (hidden state i + 1 is layer i's output), or None."""
        if self.attention == "eager":  # eager adds the mask to the scores
            dtype = self.model.dtype
            mask = torch.zeros((), dtype=dtype, device=self.device).masked_fill(~visible, torch.finfo(dtype).min)
        else:
            mask = visible
        # only the layers read are kept (transformers returns None for the others): a captured graph's memory pool
        # would otherwise hold every layer's hidden states at once
        selected = [i + 1 for i in self.features] if self.features else False
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, output_hidden_states=selected,
            **{self.cache_name: self.cache},
        )  # fmt: skip
        if not self.features:
            return out.logits, None
        return out.logits, torch.cat([out.hidden_states[i + 1] for i in self.features], dim=-1)

    def prepare(self, rows: int, size: int, placed: bool) -> BucketStep:
        """The (rows, bucket)'s buffers, and on a GPU its graph (`bucket_steps.capture`), all its warm-up forwards
        writing into the scratch slots at the end of the cache. Compiled without graphs (a CPU), one warm-up
        forward compiles it."""
        if self.compiled and size > 1 and (rows, 1, placed) not in self.steps:
            # one node first (a program of its own anyway): dynamo then takes every later count as symbolic, where a
            # first call with more nodes compiles a program for that count alone (three programs, not two)
            self.prepare(rows, 1, placed)
        started = time.perf_counter()
        scratch = self.length - self.largest
        step = new_step(rows, size, placed, scratch, self.device, idle=self.graphs or self.compiled)
        # The slot count stays a static size: marked symbolic from the first program on, each program took 2-3x
        # as long to compile (a 30-layer llama on this CPU: a single row's two programs 297 s against 109 s), and a
        # warm-up compiles up to 6. A text longer than the warm-up's cache compiles again, once (dynamo then makes the
        # slot count symbolic itself); `Decoder.warm_up(max_len)` sizes the cache for the longest expected.
        if self.compiled and rows > 1:
            # every count of many rows in one program from the first: left to dynamo, the first count seen compiles
            # as a static size and the next one again, symbolic
            torch._dynamo.maybe_mark_dynamic(step.inputs, 0)
        if self.compiled and not self.cache.layers[0].is_initialized:
            # the layers allocate at their first forward: eagerly, so that no program traces it (a variant guarded
            # on an empty cache and on each sibling's place count took the shared program past dynamo's 8)
            self.bucket_forward(size, step.inputs, placed)
        if self.graphs:
            error = capture(step, self.step_forward)
            if error is not None:
                self.capture_error = f"{type(self.model).__name__}: {error}"
                logger.warning("forerun: bucket %d runs eagerly, its capture failed: %s", size, self.capture_error)
        elif self.compiled:
            self.step_forward(size, step.inputs, placed)
        self.steps[rows, size, placed] = step
        self.capture_seconds += time.perf_counter() - started
        return step

    def settings(self) -> dict[str, object]:
        """What a latency curve measured on this base depends on beyond the model (part of its stored key)."""
        return {"base": "static", "graphs": self.graphs, "buckets": list(self.buckets)} | (
            {"compiled": True} if self.compiled else {}
        )

    def measure_curve(self, context: int = 256, repeats: int = 3) -> LatencyCurve:
        """Seconds per step at each bucket (`forerun.base.static_timing.measure_curve`)."""
        return static_timing.measure_curve(self, context, repeats)

    def measure_rows(
        self, rows: Sequence[int], sizes: Sequence[int], context: int = 256, repeats: int = 2
    ) -> tuple[tuple[int, LatencyCurve], ...]:
        """Seconds per batched step of each row count, on the siblings (`static_timing.measure_rows`)."""
        return static_timing.measure_rows(self, rows, sizes, context, repeats)

    def commit(self, prefix_len: int, kept_nodes: list[int], place: int = 0) -> None:
        self.commit_rows([(place, prefix_len, kept_nodes)])

    def commit_rows(self, kept: Sequence[tuple[int, int, list[int]]]) -> None:
        """Each (place, prefix_len, kept nodes): keep the path, gathered to the front of the place's new slots,
        all places in one gather (a path already in place moves nothing)."""
        gather_paths(self.slots, self.cache.layers, kept, self.device)

    def move(self, source: int, target: int, length: int) -> None:
        """Copy place `source`'s first `length` slots to place `target` (a batch packing its rows to the front)."""
        copy_place(self.slots, self.cache.layers, source, target, length)
