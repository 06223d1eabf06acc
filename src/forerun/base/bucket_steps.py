"""One (rows, bucket) of the static base: its input buffers and, on a GPU, its forward captured as a CUDA graph.

A step's inputs travel in one host-to-device copy into `BucketStep.inputs`; the captured graph reads them there and
writes its outputs (logits, argmaxes, features) into tensors that every replay rewrites in place.

Example (what `StaticBase.prepare` does with a bucket of 8 nodes for 1 row, on a card):
    >>> step = new_step(1, 8, False, scratch=1024, device=torch.device("cuda"))      # doctest: +SKIP
    >>> capture(step, base.step_forward)                                            # doctest: +SKIP
    >>> step.inputs.copy_(step.host); step.graph.replay(); step.choices.shape       # doctest: +SKIP
    torch.Size([1, 8])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import FunctionType
from typing import TypeVar

import numpy as np
import torch

from forerun.base.step_inputs import fill_host
from forerun.tree import TokenTree

T = TypeVar("T")

IDLE = TokenTree.rooted_at(0)
"""What a place no row holds is fed in a batch's forward: a root in the scratch slots, seen by no one."""

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""One bucketed forward's logits [R, B, vocab], argmaxes [R, B] and features [R, B, F] (None: none asked for)."""

Forward = Callable[[int, torch.Tensor, bool], Outputs]
"""A bucketed forward: (bucket size, input buffer, placed) -> its outputs (`StaticBase.bucket_forward`)."""


@dataclass
class BucketStep:
    """One (rows, bucket) input buffer (device), its pinned host twin, and its graph with the outputs it writes."""

    rows: int
    size: int
    placed: bool
    """One row fed into a place given in its inputs (a joining row), not rows 0..R-1 as places 0..R-1."""
    inputs: torch.Tensor
    """[rows, 2 + 2B + B*B] int64, per row: place, prefix length, B tokens, B depths, the B x B ancestry (row i:
    the nodes i sees)."""
    host: torch.Tensor
    idle: np.ndarray
    """A place no row holds, filled once: a padding root in the scratch slots."""
    copied: torch.cuda.Event | None = None
    """Recorded after each copy out of `host` (a card): the next fill waits for it alone, not for the forward.
    A step copies its outputs to the host long after, so on the usual path it has passed when asked."""
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    choices: torch.Tensor | None = None
    features: torch.Tensor | None = None


def new_step(rows: int, size: int, placed: bool, scratch: int, device: torch.device, idle: bool = False) -> BucketStep:
    """The buffers of a (rows, bucket), pinned on the host where the device is a card; `scratch`: the first slot of
    the scratch region its idle places write into. `idle`: every row starts as an idle place (a warm-up's or a
    capture's inputs, writing only into the scratch slots)."""
    count = 2 + 2 * size + size * size
    host = torch.zeros(rows, count, dtype=torch.long, pin_memory=device.type == "cuda")
    padding = np.zeros(count, dtype=np.int64)
    fill_host(padding[1:], IDLE, scratch, size)
    step = BucketStep(rows, size, placed, torch.zeros(rows, count, dtype=torch.long, device=device), host, padding)
    if device.type == "cuda":
        step.copied = torch.cuda.Event()
    if idle:
        host.numpy()[:] = padding
        host.numpy()[:, 0] = np.arange(rows)
        step.inputs.copy_(host)
    return step


def capture(step: BucketStep, forward: Forward) -> str | None:
    """`step`'s forward captured as a CUDA graph (`graph_of`; its outputs stay in `step`); returns None, or why the
    capture failed (a model whose forward waits for the host cannot be captured: that bucket then runs eagerly,
    still exact)."""
    try:
        step.graph, (step.logits, step.choices, step.features) = graph_of(
            lambda: forward(step.size, step.inputs, step.placed), step.inputs.device
        )
        return None
    except RuntimeError as error:
        return str(error)


def graph_of(run: Callable[[], T], device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """Two warm-up calls of `run` on a side stream (a compiled program is made by the first), then its capture as
    a CUDA graph; returns the graph and the outputs of the captured call, which every replay rewrites in place.
    `run` reads its inputs from buffers of its own, filled before each replay. Raises RuntimeError where `run`
    cannot be captured (it waits for the host)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = run()
        return graph, outputs
    finally:
        torch.cuda.synchronize(device)


def own_function(function: FunctionType) -> FunctionType:
    """An equal copy of `function` with a code object of its own. torch.compile keeps its programs and their guards
    on the code object, so each copy compiles, and is reused, apart from the others."""
    return FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                        function.__defaults__, function.__closure__)  # fmt: skip


def compiled_copy(function: FunctionType) -> Callable[..., Outputs]:
    """`function` (`StaticBase.bucket_forward`, called with its base first) through `torch.compile`, on a copy of its
    own (`own_function`): its programs serve only the bases handed it, one model's (the guards on the model's
    modules, hundreds of weights that a decoder never changes, are left out; without graphs (a CPU) every step runs
    the rest). The node and row counts may become symbolic sizes (dynamo's automatic dynamic shapes): past the first
    sizes every (rows, bucket) shares one program (compiling each cost ~15 s on a card's host), and each is still
    captured as its own graph.

    Example (a base's siblings share one, apart from the single row's):
        >>> base = StaticBase(model, compiled=True)                                  # doctest: +SKIP
        >>> base.sibling(4).program is base.sibling(8).program is not base.program   # doctest: +SKIP
        True
    """
    skip_module_guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    return torch.compile(own_function(function), options=skip_module_guards)


def refuse_laid_out(model: torch.nn.Module) -> None:
    """Raise ValueError where `model` holds weights laid out for oneDNN (`forerun.base.packed`: what `load_model`
    does by default on a CPU with AVX-512): inductor reads every weight as a dense tensor, and would fail on the
    first compiled step, minutes in, on tensors without storage. Loaded with `pack=False` the same model compiles.

    Example:
        >>> refuse_laid_out(torch.nn.Linear(4, 4))  # dense weights: nothing to refuse
    """
    laid_out = next((name for name, p in model.named_parameters() if p.layout == torch._mkldnn), None)
    if laid_out is not None:
        raise ValueError(
            f"compile_buckets cannot compile a model whose weights are laid out for oneDNN ({laid_out}: "
            "forerun.load_model does that on CPUs with AVX-512); load it with forerun.load_model(..., pack=False)"
        )
