"""Sibling layers that read the same input (a layer's q, k and v projections; its gate and up projections) laid out
as one matrix: one oneDNN product where there were three or two.

Each laid-out product costs oneDNN some 20 microseconds of its own on a CPU, whatever its size, and a small model's
decode step calls ~200 of them: stacking the siblings' matrices (their rows one after another) takes 90 calls off
SmolLM2-135M's step (docs/benchmarks.md). Each output column of the stacked product is the dot product of the same
input row with the same matrix row as the sibling's own, so each sibling's columns are the numbers its own product
gives (checked by the tests in fp32 and bf16, 1 to 130 rows). Plain generate of a model loaded this way runs the
same layers, so forerun's text is still compared with the same model's.

The siblings stay in the model's tree as `StackedLinear` layers under their own names: the first one called with a
new input computes the stacked product (`Stack.columns`), the others take their columns of it, and the product is
let go once each has (a sibling fed another input computes the product again: slower, never wrong). A stacked model
holds one copy of each matrix, saves, loads, copies and pickles as before (its state dict holds each sibling's own
matrix, dense), and a cast or a move that changes anything gives each sibling its own matrix again.

Example (a block whose q, k and v read the same input; stacked: one laid-out matrix of 4 + 2 + 2 rows):
    >>> from forerun.base.packed import pack_weights
    >>> block = torch.nn.Module()
    >>> block.q_proj, block.k_proj, block.v_proj = (torch.nn.Linear(8, n, bias=False) for n in (4, 2, 2))
    >>> x = torch.randn(3, 8)
    >>> pack_weights(block, stack=False)
    3
    >>> expected = [layer(x) for layer in (block.q_proj, block.k_proj, block.v_proj)]
    >>> stack_siblings(block), tuple(block.k_proj.weight.shape)
    (1, (8, 8))
    >>> all(torch.equal(layer(x), e) for layer, e in zip((block.q_proj, block.k_proj, block.v_proj), expected))
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forerun.base.packed import PackedLinear, dense_matrix, lay_out

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of linear layers that transformers' families call one after another on the same input (attention's
projections; a gated MLP's two)."""


class Stack:
    """The siblings' matrices stacked [sum of outs, in] and laid out as one (`layer`, a PackedLinear outside the
    model's tree), and the product of the last input it multiplied, kept until each sibling has taken its columns."""

    def __init__(self, siblings: list[PackedLinear]) -> None:
        biases = [layer.bias for layer in siblings]
        rows = sum(layer.out_features for layer in siblings)
        stacked = torch.nn.Linear(siblings[0].in_features, rows, bias=False, device="meta")
        stacked.weight = torch.nn.Parameter(torch.cat([dense_matrix(layer) for layer in siblings]), False)
        if any(bias is not None for bias in biases):
            own = [
                torch.zeros(layer.out_features) if b is None else b.detach()
                for layer, b in zip(siblings, biases, strict=True)
            ]
            stacked.bias = torch.nn.Parameter(torch.cat(own).to(stacked.weight.dtype), False)
        self.layer = PackedLinear(stacked)
        self.layer.rows = siblings[0].rows
        self.members = len(siblings)
        self.input: torch.Tensor | None = None
        self.version = 0
        self.output: torch.Tensor | None = None
        self.left = 0

    def columns(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of the stacked product of x [..., in]: [..., end - start], contiguous (as the
        sibling's own product is: an elementwise operator after it, GELU's tanh approximation, rounds a strided
        view's elements otherwise, 1 ulp apart)."""
        version = 0 if x.is_inference() else x._version  # an input changed in place is another input
        if x is not self.input or version != self.version or not self.left:
            self.input, self.version, self.output, self.left = x, version, self.layer(x), self.members
        output = self.output
        self.left -= 1
        if not self.left:  # every sibling has its columns: the product (a prompt's can be large) is let go
            self.input = self.output = None
        return output[..., start:end].contiguous()


class StackedLinear(PackedLinear):
    """One sibling of a Stack: x [..., in] -> [..., out], columns [start, start + out) of the stack's product.

    `weight` is the stack's laid-out matrix, shared by the siblings (the model holds it once); everything that
    reads or changes a layer's own matrix (a state dict written or loaded, a cast or move, a copy, a pickle) sees
    the sibling's own rows of it, exactly the matrix it had before it was stacked."""

    def __init__(self, layer: PackedLinear, stack: Stack, start: int) -> None:
        torch.nn.Linear.__init__(self, layer.in_features, layer.out_features, bias=False, device="meta")
        self.weight = stack.layer.weight
        self.bias = None
        self.stack = stack
        self.start = start

    @property
    def rows(self) -> tuple[int, ...]:  # type: ignore[override]
        """The row table the stack's product computes by (`forerun.base.packed_rows`)."""
        return self.stack.layer.rows

    @rows.setter
    def rows(self, table: tuple[int, ...]) -> None:
        self.stack.layer.rows = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.columns(x, self.start, self.start + self.out_features)

    def product(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
        return self.stack.layer.product(x, rows)[..., self.start : self.start + self.out_features].contiguous()

    def own(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this sibling's matrix [out, in], dense, its bias or None): its rows of the stack's."""
        end = self.start + self.out_features
        bias = self.stack.layer.bias
        matrix = dense_matrix(self.stack.layer)[self.start : end].clone()
        return matrix, None if bias is None else bias[self.start : end]

    def unstack(self) -> None:
        """Become the PackedLinear this sibling was: its own laid-out matrix, off the stack."""
        matrix, bias = self.own()
        table = self.rows
        del self.stack, self.start
        self.__class__ = PackedLinear
        self.weight = lay_out(matrix)
        self.bias = None if bias is None else torch.nn.Parameter(bias.clone(), False)
        self.rows = table

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        matrix, bias = self.own()
        destination[prefix + "weight"] = matrix
        if bias is not None:
            destination[prefix + "bias"] = bias.clone()

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        self.unstack()
        self._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PackedLinear:
        probe = torch.empty(0, dtype=self.weight.dtype)
        if fn(probe) is probe:  # `.float()` of an fp32 model, `.to("cpu")` on the CPU: nothing changes
            return self
        self.unstack()
        return self._apply(fn, recurse)

    def __getstate__(self) -> dict:
        """Pickled and deep-copied as the PackedLinear it was (`unstack`): the copy holds its own matrix."""
        matrix, bias = self.own()
        state = {key: value for key, value in self.__dict__.items() if key not in ("stack", "start")}
        own = {"weight": torch.nn.Parameter(matrix, False), "bias": None if bias is None else bias.clone()}
        return {**state, "_parameters": own, "laid_out": True, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        self.__class__ = PackedLinear
        self.__setstate__(state)


def stack_siblings(model: torch.nn.Module) -> int:
    """Stack, in place, each set of `SIBLINGS` of `model` laid out alike (PackedLinear layers with their matrices
    laid out, the same inputs and dtype, biases all or none); returns how many stacks."""
    stacks = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            siblings = [getattr(parent, name, None) for name in names]
            if not stackable(siblings):
                continue
            stack, start = Stack(siblings), 0  # type: ignore[arg-type]
            for name, layer in zip(names, siblings, strict=True):
                setattr(parent, name, StackedLinear(layer, stack, start))  # type: ignore[arg-type]
                start += layer.out_features  # type: ignore[union-attr]
            stacks += 1
    return stacks


def stackable(layers: list[object]) -> bool:
    """Whether `layers` are PackedLinear layers (not stacked yet) with laid-out matrices of one dtype over the same
    inputs, and a bias on all or none."""
    if not all(type(layer) is PackedLinear for layer in layers):
        return False
    weights = [layer.weight for layer in layers]  # type: ignore[attr-defined]
    return (
        all(weight.layout == torch._mkldnn for weight in weights)
        and len({weight.dtype for weight in weights}) == 1
        and len({layer.in_features for layer in layers}) == 1  # type: ignore[attr-defined]
        and len({layer.bias is None for layer in layers}) == 1  # type: ignore[attr-defined]
    )


def stacked(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s sibling layers are stacked."""
    return any(isinstance(module, StackedLinear) for module in model.modules())
