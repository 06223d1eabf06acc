"""The GPU's base: a preallocated cache, trees padded to a few sizes, one captured forward per size.

A GPU runs a small model's forward in well under a millisecond, and an eager Python loop spends tens of
milliseconds launching its kernels. What makes it fast is what the field's GPU engines do: fix the shapes, capture
the forward once as a CUDA graph, and replay it.

- **Slots, not a growing cache.** Keys and values live in one buffer per layer of `length` slots
  (`SlotLayer`, a transformers `StaticLayer` that writes where its base says). A forward after `prefix_len`
  committed tokens writes its nodes at slots prefix_len, prefix_len + 1, ...; the commit gathers the accepted path
  to the front of that region in place; slots past the committed length are never visible, so nothing is cleared.
- **Buckets.** A tree of n nodes is fed as the smallest bucket B >= n (`BUCKETS`); the padding nodes repeat the
  root, see only the prefix and themselves, and write into slots that the next forward overwrites. The latency
  curve is measured per bucket (`measure_curve`), so the cost model prices a tree at its bucket's cost and fills it.
- **One graph per bucket**, captured at first use (warm-up forwards write only into a scratch region at the end of
  the cache) and replayed after: the step's inputs (prefix length, tokens, depths, ancestry) travel in one
  host-to-device copy into the graph's input buffer; the mask, positions and slots are computed inside the graph.
- **One device-to-host copy per step**: the target's argmax at every node, computed inside the graph.
- **The prompt through the same graphs**: a prefill feeds the prompt in chunks of the largest bucket (a chain is
  a tree), then the rest of it with the first tree; no eager forward of a shape seen once.

On a CPU the same bucketed forward runs without graphs, eagerly (what the CPU tests check token for token against
plain generate) or compiled (`compiled=True`, with `static_cache=True`: inductor fuses the small operators between
the products; docs/benchmarks.md says where that paid).

Example (a GPU):
    >>> base = StaticBase(model)                                         # doctest: +SKIP
    >>> base.begin(max_len=600)                                          # None: trees can be verified  # doctest: +SKIP
    >>> out = base.forward(tree, prefix_len=300, lead=())                # 5 nodes fed as bucket 8  # doctest: +SKIP
    >>> out.logits.shape, len(out.choices)                               # doctest: +SKIP
    (torch.Size([5, 49152]), 5)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FunctionType, MethodType

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from forerun.base.dynamic import TreeLogits
from forerun.base.step_inputs import behind, fill_host
from forerun.costmodel import LatencyCurve
from forerun.kvcache import UnsupportedCacheError, check_tree_cache
from forerun.measured import synchronize
from forerun.prefixcache import Prefixes
from forerun.tree import TokenTree, attention_mask_4d, tree_support

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Node counts a forward is padded to: each has its own captured graph and its own point on the latency curve."""
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


class Slots:
    """Where the forward in flight writes: `current` [tokens fed] slot indices, shared by every layer; and, once
    the first layer is allocated, every layer's keys and values in one buffer (one gather commits them all)."""

    def __init__(self, layers: int, length: int) -> None:
        self.layers, self.length = layers, length
        self.current: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        """[layers, 2, rows, heads, length, head_dim], where keys and values have one shape."""

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        if self.kv is None and keys.shape == values.shape:
            rows, heads, _, dim = keys.shape
            shape = (self.layers, 2, rows, heads, self.length, dim)
            self.kv = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
        return self.kv


class SlotLayer(StaticLayer):
    """A `StaticLayer` that writes a forward's keys and values at the slots `slots.current` names, not after a
    running length: a tree's nodes go where the base put them, and a rejected branch is simply overwritten."""

    def __init__(self, max_cache_len: int, slots: Slots, index: int) -> None:
        super().__init__(max_cache_len)
        self.slots, self.index = slots, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shared = self.slots.allocate(key_states, value_states)
        if shared is None:  # keys and values of different widths: a buffer each
            super().lazy_initialization(key_states, value_states)
            return
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = self.v_head_dim = key_states.shape[-1]
        self.keys, self.values = shared[self.index, 0], shared[self.index, 1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        where = self.slots.current[: key_states.shape[-2]]
        self.keys.index_copy_(2, where, key_states)
        self.values.index_copy_(2, where, value_states)
        return self.keys, self.values


@dataclass
class BucketStep:
    """One bucket's input buffer (device), its pinned host twin, and its graph with the outputs it writes."""

    size: int
    inputs: torch.Tensor
    """[1 + 2B + B*B] int64: prefix length, B tokens, B depths, the B x B ancestry (row i: the nodes i sees)."""
    host: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    choices: torch.Tensor | None = None


class StaticBase:
    """Verifies trees on slots in buckets (module docstring); `graphs` (None: on a CUDA device) captures each
    bucket's forward once and replays it."""

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: Sequence[int] = BUCKETS,
        graphs: bool | None = None,
        compiled: bool = False,
    ) -> None:
        """`compiled`: each bucket's forward goes through `torch.compile` (inductor fuses transformers' small
        kernels; on a GPU before it is captured): tens of seconds per program once, then shorter steps where
        launches and Python, not arithmetic, bound them. Off by default (the compiling is the user's to choose)."""
        self.model = model
        # the node count may become a symbolic size (dynamo's automatic dynamic shapes): the buckets past the
        # second share one compiled program (compiling each cost ~15 s on a card's host), and each is still
        # captured as its own graph. Without graphs (a CPU) every step runs the program's guards: those on the
        # model's modules (hundreds of weights that a decoder never changes) are left out. Programs are kept per
        # code object: this base's own copy of the function keeps another model's program from ever being reused
        skip_module_guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.step_forward = (
            torch.compile(own_code(self.bucket_forward), options=skip_module_guards)
            if compiled
            else self.bucket_forward
        )
        self.compiled = compiled
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] != 1:
            raise ValueError(f"buckets must include 1, got {list(buckets)}")
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"graphs=True needs a CUDA device; the model is on {self.device}")
        self.attention = getattr(model.config, "_attn_implementation", None) or "eager"
        self.layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.length = 0
        self.slots = Slots(self.layers, 0)
        self.cache: Cache | None = None
        self.steps: dict[int, BucketStep] = {}
        self.capture_seconds = 0.0
        """Seconds spent warming and capturing graphs so far (once per bucket and cache size)."""
        self.capture_error: str | None = None
        """Why a capture failed (that bucket then runs eagerly), if one did."""

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The bucket a tree of `n` nodes is fed as."""
        for size in self.buckets:
            if n <= size:
                return size
        raise ValueError(f"a tree of {n} nodes exceeds the largest bucket ({self.largest})")

    def begin(self, max_len: int) -> str | None:
        reason = static_support(self.model, max_len)
        if reason is not None:
            return reason
        needed = max_len + self.largest  # the last `largest` slots are the warm-ups' scratch region
        if needed > self.length:
            self.allocate(LENGTH_STEP * math.ceil(needed / LENGTH_STEP))
        return None

    def allocate(self, length: int) -> None:
        """A cache of `length` slots; graphs captured on the old one are dropped (they point at its buffers)."""
        self.length, self.steps = length, {}
        self.slots = Slots(self.layers, length)
        self.cache = Cache(layers=[SlotLayer(length, self.slots, i) for i in range(self.layers)])
        self.columns = torch.arange(length, device=self.device)
        self.offsets = torch.arange(self.largest, device=self.device)

    def warm(self, max_len: int) -> float:
        """Make every bucket's graph (and compiled program) now, for texts of up to `max_len` tokens, instead of
        at each bucket's first use; returns the seconds it took. A server calls it once before taking requests."""
        started = time.perf_counter()
        reason = self.begin(max_len)
        if reason is not None:
            raise ValueError(f"this model cannot verify trees on the static cache: {reason}")
        for size in self.buckets:
            if size not in self.steps:
                self.prepare(size)
        return time.perf_counter() - started

    def seed(self, prefixes: Prefixes | None, tokens: list[int]) -> int:
        return 0  # the prefix cache holds DynamicCache layers; this base prefills in full

    def store(self, prefixes: Prefixes | None, tokens: list[int], length: int) -> None:
        pass

    def forward(self, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        """The tree's logits and argmaxes after `prefix_len` committed tokens, of which `lead` (a prefill's prompt)
        is fed first. The lead goes through the buckets too: in chunks of the largest, then its rest with the tree
        in one. An eager forward of a shape seen once costs a card its launches and a fresh attention plan per
        prompt length, many steps' worth (the benchmarks page, GPU); only a tree wider than every bucket runs one.
        """
        n = len(tree)
        if n > self.largest:
            return self.prefill(tree, prefix_len, lead)
        start, lead = prefix_len - len(lead), list(lead)
        while len(lead) + n > self.largest:  # the prompt's head: no logits wanted, nothing copied back
            chunk, lead = lead[: self.largest], lead[self.largest :]
            self.run(behind(chunk[:-1], TokenTree.rooted_at(chunk[-1])), start, wait=True)
            start += len(chunk)
        logits, choices = self.run(behind(lead, tree), start)
        first = len(lead)  # the tree's nodes follow the lead's
        return TreeLogits(logits[first : first + n].clone(), choices[first : first + n].tolist())  # the one copy

    def run(self, tree: TokenTree, prefix_len: int, wait: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One bucketed forward of `tree` (at most `largest` nodes) after `prefix_len` slots: the bucket's logits
        [B, vocab] and argmaxes [B], on the device. `wait`: the input copy returns only once done, so the pinned
        host buffer may be refilled at once (a prefill's chunks; a step's next fill follows its copy-back)."""
        step = self.steps.get(self.bucket(len(tree))) or self.prepare(self.bucket(len(tree)))
        fill_host(step.host.numpy(), tree, prefix_len, step.size)
        step.inputs.copy_(step.host, non_blocking=not wait)
        if step.graph is not None:
            step.graph.replay()
            return step.logits, step.choices
        return self.step_forward(step.size, step.inputs)

    def prefill(self, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        """An eager forward of `lead` then `tree`: a tree wider than every bucket, and the curve's context."""
        n, start = len(tree), prefix_len - len(lead)
        ids = torch.tensor([[*lead, *tree.tokens]], device=self.device)
        depths = torch.tensor(tree.depths, device=self.device) + prefix_len
        positions = torch.cat([torch.arange(start, prefix_len, device=self.device), depths])[None]
        bools = attention_mask_4d(tree.ancestors(), prefix_len, "sdpa", self.model.dtype, len(lead))
        visible = torch.zeros((*bools.shape[:3], self.length), dtype=torch.bool)
        visible[..., : bools.shape[-1]] = bools
        self.slots.current = torch.arange(start, start + ids.shape[1], device=self.device)
        logits = self.call(ids, positions, visible.to(self.device))[-n:]  # its own tensor: no graph rewrites it
        return TreeLogits(logits, logits.argmax(-1).tolist())

    def bucket_forward(self, size: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of one bucket from its input buffer (module docstring): logits [B, vocab], argmax [B].
        Every shape is fixed by `size` and the cache length, and nothing waits for the host: capturable."""
        prefix, ids, depths = inputs[0], inputs[1 : 1 + size], inputs[1 + size : 1 + 2 * size]
        ancestry = inputs[1 + 2 * size :].view(size, size).bool()  # [B, B]
        self.slots.current = prefix + self.offsets[:size]
        relative = self.columns - prefix  # [length]: column j holds node j - prefix, or the prefix where < 0
        in_tree = (relative >= 0) & (relative < size)
        visible = ancestry.index_select(1, relative.clamp(0, size - 1)) & in_tree  # [B, length]
        visible = visible | (relative < 0)
        logits = self.call(ids[None], (prefix + depths)[None], visible[None, None])
        return logits, logits.argmax(-1)

    def call(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One call of the unmodified model; `visible` [1, 1, q, length] bool. Returns logits [q, vocab]."""
        if self.attention == "eager":  # eager adds the mask to the scores
            dtype = self.model.dtype
            mask = torch.zeros((), dtype=dtype, device=self.device).masked_fill(~visible, torch.finfo(dtype).min)
        else:
            mask = visible
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache, use_cache=True
        )
        return out.logits[0]

    def prepare(self, size: int) -> BucketStep:
        """The bucket's buffers, and on a GPU its graph: two warm-up forwards on a side stream (the compiled
        program is made by the first), then the capture, all writing into the scratch slots at the end of the
        cache. Compiled without graphs (a CPU), one warm-up forward compiles it."""
        started = time.perf_counter()
        count = 1 + 2 * size + size * size
        host = torch.zeros(count, dtype=torch.long, pin_memory=self.device.type == "cuda")
        step = BucketStep(size, torch.zeros(count, dtype=torch.long, device=self.device), host)
        if self.graphs or self.compiled:
            fill_host(host.numpy(), TokenTree.rooted_at(0), self.length - self.largest, size)
            step.inputs.copy_(host)
        if self.graphs:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.step_forward(size, step.inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.capture(step)
            torch.cuda.synchronize(self.device)
        elif self.compiled:
            self.step_forward(size, step.inputs)
        self.steps[size] = step
        self.capture_seconds += time.perf_counter() - started
        return step

    def capture(self, step: BucketStep) -> None:
        """Capture `step`'s forward as a CUDA graph (its outputs stay in `step`); a model whose forward waits for
        the host cannot be captured: that bucket then runs eagerly, still exact."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step.logits, step.choices = self.step_forward(step.size, step.inputs)
            step.graph = graph
        except RuntimeError as error:
            self.capture_error = f"{type(self.model).__name__}: {error}"
            logger.warning("forerun: bucket %d runs eagerly, its capture failed: %s", step.size, self.capture_error)

    def settings(self) -> dict[str, object]:
        """What a latency curve measured on this base depends on beyond the model (part of its stored key)."""
        return {"base": "static", "graphs": self.graphs, "buckets": list(self.buckets)} | (
            {"compiled": True} if self.compiled else {}
        )

    @torch.inference_mode()
    def measure_curve(self, context: int = 256, repeats: int = 3) -> LatencyCurve:
        """Seconds per step at each bucket after `context` cached tokens, host work and the step's one transfer
        included (the fastest of `repeats` rounds after a warm-up round), as a curve over every size 1..largest:
        n nodes cost their bucket."""
        self.begin(context + 1)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        tokens = torch.randint(0, vocab, (context + self.largest,), generator=torch.Generator().manual_seed(0))
        self.prefill(TokenTree.rooted_at(int(tokens[context])), context, tokens[:context].tolist())
        samples: dict[int, list[float]] = {size: [] for size in self.buckets}
        for _ in range(repeats + 1):
            for size in self.buckets:
                tree = TokenTree.rooted_at(int(tokens[context]))
                tree.add_chain(0, tokens[context + 1 : context + size].tolist())
                synchronize(self.device)
                started = time.perf_counter()
                self.forward(tree, context, ())
                samples[size].append(time.perf_counter() - started)
        cost = {size: min(times[1:]) for size, times in samples.items()}
        return LatencyCurve(
            tuple(range(1, self.largest + 1)), tuple(cost[self.bucket(n)] for n in range(1, self.largest + 1))
        )

    def commit(self, prefix_len: int, kept_nodes: list[int]) -> None:
        if kept_nodes == list(range(len(kept_nodes))):
            return  # the path is already where it belongs
        source = torch.tensor(kept_nodes, device=self.device) + prefix_len
        target = self.offsets[: len(kept_nodes)] + prefix_len
        if self.slots.kv is not None:  # every layer's keys and values in one gather
            self.slots.kv.index_copy_(4, target, self.slots.kv.index_select(4, source))
            return
        for layer in self.cache.layers:
            layer.keys.index_copy_(2, target, layer.keys.index_select(2, source))
            layer.values.index_copy_(2, target, layer.values.index_select(2, source))


def own_code(method: MethodType) -> MethodType:
    """`method` bound to a function with a code object of its own (an equal copy). torch.compile keeps its
    programs and their guards on the code object, so each copy compiles, and is reused, apart from the others."""
    function = method.__func__
    copy = FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                        function.__defaults__, function.__closure__)  # fmt: skip
    return MethodType(copy, method.__self__)
