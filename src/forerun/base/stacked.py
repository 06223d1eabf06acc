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

from forerun.base.int8 import Int8RowTensor
from forerun.base.kernels import KernelLinear, kernel_of
from forerun.base.packed import PackedLinear, dense_matrix, lay_out

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of linear layers that transformers' families call one after another on the same input (attention's
projections; a gated MLP's two)."""


class Stack:
    """One product over the siblings' matrices stacked [sum of outs, in] (`layer`, outside the model's tree: a
    PackedLinear, or a KernelLinear over 4- or 8-bit codes), and the product of the last input it multiplied, kept
    until each of its `members` has taken its columns."""

    def __init__(self, layer: torch.nn.Module, members: int) -> None:
        self.layer = layer
        self.members = members
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


def stand_in(siblings: list[torch.nn.Linear], weight: torch.Tensor) -> torch.nn.Linear:
    """A linear layer over `weight`, the siblings' matrices stacked, and their biases stacked (all or none)."""
    layer = torch.nn.Linear(siblings[0].in_features, int(weight.shape[0]), bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight, False)
    if siblings[0].bias is not None:
        layer.bias = torch.nn.Parameter(torch.cat([sibling.bias.detach() for sibling in siblings]), False)
    return layer


def packed_stack(siblings: list[PackedLinear]) -> Stack | None:
    """The siblings' matrices stacked and laid out as one, with their row table (None where it disagrees)."""
    layer = PackedLinear(stand_in(siblings, torch.cat([dense_matrix(sibling) for sibling in siblings])))
    layer.rows = siblings[0].rows
    return Stack(layer, len(siblings)) if agrees(layer, siblings, layer.weight.dtype) else None


@torch.inference_mode()
def agrees(layer: torch.nn.Module, siblings: list[torch.nn.Module], dtype: torch.dtype) -> bool:
    """Whether `layer`'s product gives each sibling's own numbers in its columns (1 and 3 rows of a seeded input).
    A kernel's packed layout may interleave rows in blocks (4-bit codes: 64 rows), so stacked codes are right only
    where each sibling but the last fills whole blocks: checked, not assumed."""
    for rows in (1, 3):
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out, start = layer(x), 0
        for sibling in siblings:
            if not torch.equal(out[:, start : start + sibling.out_features], sibling(x)):
                return False
            start += sibling.out_features
    return True


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


class StackedKernel(KernelLinear):
    """One sibling of a Stack over 4- or 8-bit codes: x [..., in] -> [..., out], columns [start, start + out) of the
    stack's product. It keeps its own quantized `weight` (saved, read and counted as before), whose codes and scales
    are views of the stack's: the model holds them once."""

    def __init__(self, layer: KernelLinear, stack: Stack, start: int) -> None:
        super().__init__(layer, layer.product, layer.operands, layer.wide)
        self.stack = stack
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.columns(x, self.start, self.start + self.out_features)


def kernel_stack(siblings: list[KernelLinear]) -> Stack | None:
    """The siblings' codes and scales stacked (rows one after another) into one quantized weight multiplied by the
    same kernel; each sibling's weight then holds views of them (`viewed`). None where it disagrees (`agrees`)."""
    weights = [sibling.weight for sibling in siblings]
    if type(weights[0]) is Int8RowTensor:
        weight: torch.Tensor = Int8RowTensor(
            torch.cat([w.qdata for w in weights]), torch.cat([w.scale for w in weights])
        )
    else:  # torchao's Int4OpaqueTensor: codes [out, in / 2], scales and zeros [in / group, out, 2]
        weight = type(weights[0])(
            torch.cat([w.qdata for w in weights]),
            torch.cat([w.scale_and_zero for w in weights], dim=1),
            weights[0].block_size,
            torch.Size([sum(w.shape[0] for w in weights), weights[0].shape[1]]),
        )
    product, operands, _ = kernel_of(weight)  # type: ignore[misc]
    layer = KernelLinear(stand_in(siblings, weight), product, operands, siblings[0].wide)
    if not agrees(layer, siblings, layer.activations):
        return None
    start = 0
    for sibling in siblings:
        viewed(sibling, weight, start)
        start += sibling.out_features
    return Stack(layer, len(siblings))


def viewed(sibling: KernelLinear, stacked: torch.Tensor, start: int) -> None:
    """Point `sibling`'s weight (and the operands its own product would take) at its rows of `stacked`."""
    rows, weight = slice(start, start + sibling.out_features), sibling.weight
    weight.qdata = stacked.qdata[rows]
    if isinstance(weight, Int8RowTensor):
        weight.scale = stacked.scale[rows]
    else:
        weight.scale_and_zero = stacked.scale_and_zero[:, rows]
    sibling.operands = kernel_of(weight)[1]  # type: ignore[index]


BUILDS = {"laid out": (packed_stack, StackedLinear), "kernel": (kernel_stack, StackedKernel)}
"""What a stack of each kind is built by, and its siblings' layer."""


def stack_siblings(model: torch.nn.Module) -> int:
    """Stack, in place, each set of `SIBLINGS` of `model` held alike (`stackable`); returns how many stacks."""
    stacks = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            siblings = [getattr(parent, name, None) for name in names]
            kind = stackable(siblings)
            if kind is None:
                continue
            build, sibling_layer = BUILDS[kind]
            stack, start = build(siblings), 0  # type: ignore[arg-type]
            if stack is None:
                continue
            for name, layer in zip(names, siblings, strict=True):
                setattr(parent, name, sibling_layer(layer, stack, start))  # type: ignore[operator]
                start += layer.out_features  # type: ignore[union-attr]
            stacks += 1
    return stacks


def stackable(layers: list[object]) -> str | None:
    """ "laid out" where `layers` are PackedLinear layers (not stacked yet) with laid-out matrices of one dtype,
    "kernel" where they are KernelLinear layers of one kind of codes and one kernel (groups, rows taken unpacked,
    activations); None otherwise, or where their inputs differ in width or some have a bias and others none."""
    kinds = {type(layer) for layer in layers}
    if kinds not in ({PackedLinear}, {KernelLinear}) or len({layer.in_features for layer in layers}) != 1:  # type: ignore[attr-defined]
        return None
    if len({layer.bias is None for layer in layers}) != 1:  # type: ignore[attr-defined]
        return None
    weights = [layer.weight for layer in layers]  # type: ignore[attr-defined]
    if kinds == {PackedLinear}:
        laid_out = all(weight.layout == torch._mkldnn for weight in weights)
        return "laid out" if laid_out and len({weight.dtype for weight in weights}) == 1 else None
    if len({type(weight) for weight in weights}) != 1:
        return None
    alike = {(layer.product, group(layer), layer.wide, layer.activations) for layer in layers}  # type: ignore[attr-defined]
    known = type(weights[0]) is Int8RowTensor or kernel_of(weights[0]) is not None
    return "kernel" if known and len(alike) == 1 and all(w.qdata.is_contiguous() for w in weights) else None


def unstack_siblings(model: torch.nn.Module) -> int:
    """Give every stacked sibling of `model` its own product again (a PackedLinear over its own laid-out matrix, a
    KernelLinear over its own codes, copied out of the stack's); returns how many. The numbers stay the same."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, StackedLinear):
                child.unstack()
            elif isinstance(child, StackedKernel):
                weight = child.weight
                for attribute in ("qdata", "scale", "scale_and_zero"):
                    if hasattr(weight, attribute):
                        setattr(
                            weight, attribute, getattr(weight, attribute).clone(memory_format=torch.contiguous_format)
                        )
                setattr(parent, name, KernelLinear(child, child.product, kernel_of(weight)[1], child.wide))  # type: ignore[index]
            else:
                continue
            count += 1
    return count


def group(layer: KernelLinear) -> int | None:
    """The weights a scale covers in `layer`'s 4-bit codes (its kernel's group size); None for 8-bit rows."""
    return next((operand for operand in layer.operands if isinstance(operand, int)), None)


def stacked(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s sibling layers are stacked."""
    return any(isinstance(module, (StackedLinear, StackedKernel)) for module in model.modules())
