"""Dense weights laid out once for the CPU's matrix kernels: each linear layer multiplies by oneDNN with its matrix
already in the kernel's blocked layout, instead of PyTorch's `F.linear` laying it out on every call.

On a CPU with AVX-512, PyTorch's bf16 `F.linear` hands oneDNN's kernel the plain matrix on every call, and its fp32
one runs MKL, whose paths for a few rows (a tree of 2 to 16 tokens) read the matrix slowly. A small model's forward is
bound by reading its weights, so laying them out once (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's CPU
freezing does) makes every forward cheaper, and a tree's forward the most (docs/benchmarks.md). The numbers: in bf16
the products `F.linear` computes (a bias is added before the one rounding to bf16, where `F.linear` rounds twice); in
fp32 within float rounding of MKL's. forerun on a packed model is compared with plain generate of the same packed
model (`load_model(pack=False)` gives transformers' own layers).

`weight` becomes the laid-out tensor itself (layout `torch._mkldnn`, same shape, dtype and bytes), so the model
holds no second copy of its linear layers; an output matrix tied to the input embedding gets a laid-out copy of its
own (the embedding stays dense, looked up by row). `.to_dense()` gives the original matrix back exactly
(`dense_matrix`). A packed model saves, loads, copies and pickles as any model (its state dict holds the matrices
dense); cast to another dtype or moved off the CPU, they become dense again. It does not train: under autocast or
with gradients the layer multiplies its dense matrix.

Example (a [64, 32] layer: 64 outputs, 32 inputs):
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64))
    >>> pack_weights(model), type(model[0]).__name__, tuple(model[0](torch.ones(3, 32)).shape)
    (1, 'PackedLinear', (3, 64))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from forerun.base.kernels import plain_linear, replace_linears
from forerun.base.packed_rows import rows_for
from forerun.measured import DEFAULT_CACHE_DIR

PACKED_ROWS = 16
"""The rows a product is laid out for (oneDNN's hint): a tree or a batch of a few to 16 tokens."""
DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(torch.nn.Linear):
    """A linear layer whose matrix oneDNN has laid out once: x [..., in] -> [..., out], in the weight's dtype.

    `rows`: per row count m (index m), the rows a product of m rows is computed as (`forerun.base.packed_rows`:
    zero rows added, the first m kept); empty: as many as asked."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = lay_out(linear.weight)
        self.bias = linear.bias
        self.rows: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.layout != torch._mkldnn:  # tied again to a dense matrix (transformers' `tie_weights`)
            return F.linear(x, weight, self.bias)
        if x.dtype != weight.dtype or torch.is_autocast_enabled("cpu") or x.requires_grad:
            return F.linear(x, weight.to_dense(), self.bias)  # autocast's casts and autograd's graph are F.linear's
        count = x.numel() // self.in_features
        return self.product(x, self.rows[count] if count < len(self.rows) else 0)

    def product(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """oneDNN's product of x [..., in] with the laid-out matrix; where `rows` is more than x's m rows, computed
        as `rows` rows (zeros after x's) and the first m kept."""
        count = x.numel() // self.in_features if rows else 0
        if rows > count:
            flat = x.reshape(count, self.in_features)
            padded = torch.cat([flat, flat.new_zeros(rows - count, self.in_features)])
            return self.product(padded)[:count].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    # What any nn.Module does (save, load, copy, pickle, cast, move) works on the matrix as it is dense: a laid-out
    # tensor has no storage, and oneDNN's layout casts to nothing else. The layout stays where the matrix does.

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = dense_matrix(self)  # a checkpoint any Linear loads

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        with dense_weight(self):
            super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PackedLinear:
        with dense_weight(self):
            return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        """Pickled and deep-copied with its matrix dense (`__setstate__` lays the copy's out again); a matrix tied
        again to a dense one (`forward`'s first case) as it is, still tied in the copy."""
        state = self.__dict__.copy()
        if self.weight.layout == torch._mkldnn:
            state["_parameters"] = {**self._parameters, "weight": torch.nn.Parameter(self.weight.to_dense(), False)}
            state["laid_out"] = True
        return state

    def __setstate__(self, state: dict) -> None:
        laid_out = state.pop("laid_out", False)
        super().__setstate__(state)
        if laid_out:
            self.weight = lay_out(self.weight)


def lay_out(matrix: torch.Tensor) -> torch.nn.Parameter:
    """`matrix` [out, in] in oneDNN's blocked layout, as a frozen parameter (`PackedLinear.weight`)."""
    return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(matrix.detach(), PACKED_ROWS), False)


@contextmanager
def dense_weight(layer: PackedLinear) -> Iterator[None]:
    """`layer`'s matrix dense inside; after, laid out again if it was and still can be: on the CPU in its dtype (cast
    or moved, it stays dense, and `forward` multiplies it as `F.linear` does)."""
    weight = layer.weight
    if weight.layout != torch._mkldnn:
        yield
        return
    layer.weight = torch.nn.Parameter(weight.to_dense(), False)
    try:
        yield
    finally:
        now = layer.weight
        if now.device.type == "cpu" and now.dtype == weight.dtype and now.layout == torch.strided:
            layer.weight = lay_out(now)


def packable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `load_model` may lay out a model on `device` in `dtype` by default: a CPU with AVX-512, fp32, or
    bf16 where oneDNN has bf16 kernels for it; it does where a row passes through the layers no slower laid out
    (`forerun.base.pack_choice.pack_pays`, measured on this CPU)."""
    if torch.device(device).type != "cpu" or dtype not in DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # AVX2 only: trees cheaper, 1 token dearer, `auto` level
        return False
    return dtype == torch.float32 or bf16_kernels()


def bf16_kernels() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT): without them a bf16
    matrix cannot be laid out at all."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_pack(pack: bool, device: torch.device | str, dtype: torch.dtype) -> None:
    """A ValueError naming what stands in the way unless the weights of a model on `device` in `dtype` can be
    laid out (`pack=True` asks for it on any CPU oneDNN runs on)."""
    if not pack:
        return
    if torch.device(device).type != "cpu":
        raise ValueError(f"pack=True lays weights out for the CPU's kernels; the model is on {device}")
    if dtype not in DTYPES:
        raise ValueError(f"pack=True takes fp32 or bf16 weights, got {dtype}")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("pack=True needs PyTorch built with oneDNN (mkldnn); this build has none")
    if dtype == torch.bfloat16 and not bf16_kernels():
        capability = torch.backends.cpu.get_cpu_capability()
        raise ValueError(
            f"pack=True in bf16 needs oneDNN's bf16 kernels, which this CPU lacks ({capability}, no AVX-512 BW/VL/DQ"
            " or AVX-NE-CONVERT): use fp32, or pack=False"
        )


def pack_weights(model: torch.nn.Module, stack: bool = True) -> int:
    """Replace, in place, every dense fp32/bf16 linear layer of `model` by a PackedLinear over its matrix laid
    out; returns how many. Quantized layers (`forerun.base.weights`) stay as they are. `stack`: sibling layers
    reading the same input laid out as one matrix too (`forerun.base.stacked`: one product where there were
    several, the same numbers). Layers whose matrix the model's own code reads stay dense (`read_by_hand`)."""
    by_hand = read_by_hand(model)
    count = replace_linears(model, lambda layer: PackedLinear(layer) if layable(layer, by_hand) else None)
    if stack:
        from forerun.base.stacked import stack_siblings  # it builds on PackedLinear

        stack_siblings(model)
    return count


def layable(layer: torch.nn.Module, by_hand: set[int]) -> bool:
    """Whether `pack_weights` lays `layer` out: a plain `torch.nn.Linear` (`kernels.plain_linear`) with a dense
    fp32/bf16 matrix on the CPU, not among the ids `by_hand` (`read_by_hand`)."""
    if not plain_linear(layer) or id(layer) in by_hand:
        return False
    weight = layer.weight
    dense = type(weight) is torch.nn.Parameter and weight.layout == torch.strided
    return dense and weight.dtype in DTYPES and weight.device.type == "cpu"


def read_by_hand(model: torch.nn.Module) -> set[int]:
    """The ids of `model`'s linear layers whose matrix the code of the module holding them reads itself, not through
    the layer (Mamba's and Jamba's mixers compute `self.dt_proj.weight @ time_step`): a laid-out matrix has no
    storage such code could read.

    Example (transformers' Mamba mixer multiplies its `dt_proj` by hand; a Sequential reads nothing so):
        >>> from transformers import MambaConfig, MambaForCausalLM
        >>> mamba = MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, state_size=4, vocab_size=32))
        >>> read_by_hand(mamba) >= {id(mamba.backbone.layers[0].mixer.dt_proj)}, read_by_hand(torch.nn.Sequential())
        (True, set())
    """
    sources: dict[type, str] = {}
    found = set()
    for parent in model.modules():
        kind = type(parent)
        if kind not in sources:
            try:
                sources[kind] = inspect.getsource(kind)
            except (OSError, TypeError):  # defined where no source is kept: nothing known to read by hand
                sources[kind] = ""
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and f"self.{name}.weight" in sources[kind]:
                found.add(id(child))
    return found


def lay_out_rows(model: torch.nn.Module, cache_dir: Path | str | None = DEFAULT_CACHE_DIR) -> tuple[int, ...]:
    """Give every laid-out fp32 layer of `model` the row table measured for them on this CPU
    (`packed_rows.rows_for`, stored under `cache_dir`); returns it (empty where no fp32 layer is laid out).

    fp32 only: in bf16 on the AVX-512 EPYC the layers alone measured 2 rows cheaper computed as 4, but end to end
    generate gained nothing and `auto` lost 4-5% (`benchmarks/packed_rows.py`), where fp32 generate gained 5-10%."""
    layers = [layer for layer in products(model) if layer.weight.layout == torch._mkldnn]
    if not layers or any(layer.weight.dtype != torch.float32 for layer in layers):
        return ()
    table = rows_for(layers, cache_dir)
    for layer in layers:
        layer.rows = table
    return table


def row_table(model: torch.nn.Module) -> tuple[int, ...]:
    """The row table `model`'s laid-out layers compute by (empty: as many rows as asked)."""
    return next((layer.rows for layer in products(model)), ())


def products(model: torch.nn.Module) -> list[PackedLinear]:
    """The laid-out products a forward of `model` computes: each stack's once (`forerun.base.stacked`), and every
    layer not stacked."""
    found: dict[int, PackedLinear] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            stack = getattr(module, "stack", None)  # a stacked sibling computes its stack's product
            layer = module if stack is None else stack.layer
            found.setdefault(id(layer), layer)
    return list(found.values())


def packed(model: torch.nn.Module) -> bool:
    """Whether `model`'s linear layers are laid out (`pack_weights`)."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


def dense_matrix(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's matrix [out, in] as a plain tensor (a laid-out one brought back, exactly)."""
    weight = layer.weight
    return weight.to_dense() if weight.layout == torch._mkldnn else weight
