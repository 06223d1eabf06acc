"""Sibling layers that read the same input (a layer's q, k and v projections; its gate and up projections) laid out
as one matrix: one oneDNN product where there were three or two.

Each laid-out product costs oneDNN a part of its own on a CPU whatever its size, and a small model's decode step
calls ~200 of them: stacking the siblings' matrices (their rows one after another) takes 90 calls off
SmolLM2-135M's step, and its 1-token forward is measurably faster (docs/benchmarks.md, "Siblings in one product").
Each output column of the stacked product is the dot product of the same input row with the same matrix row as the
sibling's own, so each sibling's columns are the numbers its own product gives; each stack is checked on a product
before it is used (`agrees`), and the tests check every family in fp32 and bf16. Plain generate of a model loaded
this way runs the same layers, so forerun's text is still compared with the same model's. (4- and 8-bit siblings
stacked the same way measured no faster: their kernels' calls cost little beside their products. They stay apart.)

The siblings stay in the model's tree as `StackedLinear` layers under their own names: the first one called with a
new input computes the stacked product (`Stack.columns`), the others take their columns of it, and the product is
let go once each has (a sibling fed another input computes the product again: slower, never wrong). A stacked model
holds one copy of each matrix, saves, loads, copies and pickles as before (its state dict holds each sibling's own
matrix, dense), and a cast or a move that changes anything gives each sibling its own matrix again;
`unstack_siblings` gives them their own products back.

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
    """One product over the siblings' matrices stacked [sum of outs, in] and laid out (`layer`, a PackedLinear
    outside the model's tree), and the product of the last input it multiplied, kept until each of its `members`
    has taken its columns.

    `last` is one tuple (the input, its version, the product, the siblings yet to take it), read and replaced whole:
    forwards of one model in several threads at once may compute a product again, never take another input's."""

    def __init__(self, layer: PackedLinear, members: int) -> None:
        self.layer = layer
        self.members = members
        self.last: tuple[torch.Tensor, int, torch.Tensor, int] | None = None

    def columns(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of the stacked product of x [..., in]: [..., end - start], contiguous (as the
        sibling's own product is: an elementwise operator after it, GELU's tanh approximation, rounds a strided
        view's elements otherwise, 1 ulp apart)."""
        last, version = self.last, input_version(x)
        if last is not None and last[0] is x and last[1] == version:
            output, left = last[2], last[3] - 1
        else:
            output, left = self.layer(x), self.members - 1
        # every sibling has its columns: the product (a prompt's can be large) is let go
        self.last = (x, version, output, left) if left > 0 else None
        return output[..., start:end].contiguous()


def input_version(x: torch.Tensor) -> int:
    """x's count of in-place changes (an input changed in place is another input); 0 for an inference tensor, which
    keeps none, and inside a compiled graph, which cannot trace it (the input's identity is what tells there)."""
    if torch.compiler.is_compiling() or x.is_inference():
        return 0
    return x._version


def stand_in(siblings: list[PackedLinear], weight: torch.Tensor) -> torch.nn.Linear:
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
    """Whether `layer`'s product gives each sibling's own numbers in its columns (1 and 3 rows of a seeded input):
    oneDNN picks its kernel by the matrix's shape, so this is checked, not assumed (a stack that disagrees is not
    used; 4-bit codes, stacked, came out wrong where a sibling did not fill whole blocks of the layout's rows)."""
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

    `weight` (and `bias`) are the stack's, shared by the siblings (the model holds them once); everything that
    reads or changes a layer's own matrix (a state dict written or loaded, a cast or move, a copy, a pickle) sees
    the sibling's own rows of it, exactly the matrix it had before it was stacked."""

    def __init__(self, layer: PackedLinear, stack: Stack, start: int) -> None:
        torch.nn.Linear.__init__(self, layer.in_features, layer.out_features, bias=False, device="meta")
        self.weight = stack.layer.weight
        self.bias = stack.layer.bias  # shared as the matrix is: the model's parameters hold each once
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
    """Stack, in place, each set of `SIBLINGS` of `model` laid out alike (`stackable`) whose stacked product
    agrees with theirs; returns how many stacks."""
    stacks = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            siblings = [getattr(parent, name, None) for name in names]
            if not stackable(siblings):
                continue
            stack, start = packed_stack(siblings), 0  # type: ignore[arg-type]
            if stack is None:
                continue
            for name, layer in zip(names, siblings, strict=True):
                setattr(parent, name, StackedLinear(layer, stack, start))  # type: ignore[arg-type]
                start += layer.out_features  # type: ignore[union-attr]
            stacks += 1
    return stacks


def stackable(layers: list[object]) -> bool:
    """Whether `layers` are PackedLinear layers (not stacked yet) with laid-out matrices of one dtype over inputs of
    one width, and a bias on all or none."""
    if not all(type(layer) is PackedLinear for layer in layers):
        return False
    alike: list[PackedLinear] = layers  # type: ignore[assignment]
    weights = [layer.weight for layer in alike]
    return (
        all(weight.layout == torch._mkldnn for weight in weights)
        and len({weight.dtype for weight in weights}) == 1
        and len({layer.in_features for layer in alike}) == 1
        and len({layer.bias is None for layer in alike}) == 1
    )


def unstack_siblings(model: torch.nn.Module) -> int:
    """Give every stacked sibling of `model` its own laid-out matrix again (a PackedLinear, copied out of the
    stack's); returns how many. The numbers stay the same."""
    siblings = [module for module in model.modules() if isinstance(module, StackedLinear)]
    for sibling in siblings:
        sibling.unstack()
    return len(siblings)


def stacked(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s sibling layers are stacked."""
    return any(isinstance(module, StackedLinear) for module in model.modules())
