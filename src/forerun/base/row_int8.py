"""8-bit weights and 8-bit activations on the CPU (`quantize="w8a8"`): every product an integer one.

PyTorch's 4-bit CPU kernel unpacks each weight to bf16 and multiplies in fp32: compute-bound for one row, and a
tree's rows cost it nearly a row's time each. fbgemm's u8 x s8 product (in every x86 wheel of PyTorch, behind
`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`) reads one byte per weight and sums in int32, bound by
reading the weights: a tree of a few nodes costs about what one token does (docs/benchmarks.md, "8-bit
activations").

- Weights: int8, one scale per output row (symmetric), from the fp32 weights.
- Activations: each row quantized on its own (symmetric, its largest |x| / 127) before the call, whose own scale
  is then 1. Integer sums are exact, so a row's output never depends on the rows beside it: a tree's rows give
  what the same rows fed one at a time give, as forerun's exactness needs.
- Outliers: a language model's activations carry a few channels 10-100x the rest, which a row's one scale would
  crush. As SmoothQuant does, measured activations (`activation_ranges`, over `forerun/assets/calibration/`)
  move part of each channel's range into the weights: x / m and W m, m = sqrt(max|x| / max|W|) per channel.
  (Quantizing the 32 widest channels apart, in a second narrow product, cost ~1/3 more time a layer and did not
  bring Qwen2.5-1.5B nearer the fp32 model: docs/benchmarks.md.)

On a CPU with AMX's int8 tiles, products of `TILE_ROWS` rows or more go through oneDNN's u8 x s8 product instead
(`torch.ops.onednn.qlinear_pointwise`, packed from fbgemm's codes at first use): the same integer sums scaled by the
same fp32 scales, so the same numbers, for a cost that hardly grows with the rows.

Every other operation (attention, norms, the embedding) stays fp32. An activation that falls within fp32's rounding
of a quantization step may round either way in a tree's forward and in plain generate's, so forerun on such a
model is held to the tie contract at bf16's resolution (about an 8-bit activation's), not fp32 token for token.

Example (a [64, 32] layer: 64 outputs, 32 inputs; rows computed together equal rows computed alone):
    >>> layer = RowInt8Linear(torch.nn.Linear(32, 64))
    >>> x = torch.randn(5, 32)
    >>> torch.equal(layer(x), torch.cat([layer(row[None]) for row in x])), tuple(layer(x).shape)
    (True, (5, 64))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib import resources

import torch

from forerun.base.kernels import NamedProduct, plain_linear
from forerun.measured import cpuinfo

TILE_ROWS = 4
"""Products of at least this many rows go through oneDNN's integer product where the CPU has AMX's int8 tiles:
there 16 rows cost it little more than one, where fbgemm's cost grows with the rows; fbgemm's stays faster for one
or two, and a 1.5B model's forward of 4 tokens measured faster through oneDNN (docs/benchmarks.md, "8-bit
activations")."""
LEVELS = 127
"""A row's codes lie in [-127, 127]: u8 values 1..255 around fbgemm's zero point 128."""
MIGRATION = 0.5
"""SmoothQuant's alpha: m = max|x|^alpha / max|W|^(1 - alpha) moves that share of a channel's range (in logs) into
its weights."""


class RowInt8Linear(NamedProduct, torch.nn.Module):
    """y [..., out] = q(x / m) @ q(W m)^T + bias: an integer product, q a row's own scale (activations) or an output
    row's (weights), m [in] the smoothing (`ranges`: each input channel's largest |x| measured; None: m = 1)."""

    def __init__(self, linear: torch.nn.Linear, ranges: torch.Tensor | None = None, tiles: bool | None = None) -> None:
        super().__init__()
        self.tiles = int8_tiles() if tiles is None else tiles  # products of TILE_ROWS rows or more through oneDNN
        self.tiled: tuple | None = None  # (the fbgemm packing it was made from, `tile_packing` of it)
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inverse = None
        if ranges is not None:
            reach = weight.abs().amax(0).clamp_min(1e-5)
            smooth = ranges.float().clamp_min(1e-5) ** MIGRATION / reach ** (1 - MIGRATION)
            weight, self.inverse = weight * smooth, 1 / smooth
        self.packed, self.product = packed_rows(weight), product()
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.inverse is not None:
            flat = flat * self.inverse
        scale = flat.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / LEVELS
        codes = (flat / scale).round_()
        if self.tiles and codes.shape[0] >= TILE_ROWS:
            out = self.tiled_product(codes) * scale
        else:
            out = self.product(codes, 1.0, LEVELS + 1, self.packed) * scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def tiled_product(self, codes: torch.Tensor) -> torch.Tensor:
        """oneDNN's product of `codes` [rows, in] (integers in [-127, 127], in fp32) by the same int8 weights as
        fbgemm's packing: the same integer sums, scaled by the same fp32 weight scales, so the same numbers. Packed
        for oneDNN at first use, from fbgemm's packing (again if that was replaced)."""
        if self.tiled is None or self.tiled[0] is not self.packed:
            self.tiled = (self.packed, tile_packing(self.packed))
        return tile_product(codes, self.tiled[1])

    def __getstate__(self) -> dict:
        """Pickled and deep-copied without oneDNN's packing (a tensor with no storage): made again at first use."""
        return {**super().__getstate__(), "tiled": None}

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # the codes are an fbgemm object, no parameter: a checkpoint would silently hold no weights for this layer
        raise ValueError(
            f"{prefix.rstrip('.')}: a w8a8 layer's weights are fbgemm's packed codes, which no checkpoint holds "
            "(state_dict, save_pretrained); save the model before quantizing it (forerun.load_model without quantize=)"
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, smoothed={self.inverse is not None}"


def product() -> Callable[..., torch.Tensor]:
    """fbgemm's product of fp32 rows x (integer-valued here) by packed int8 weights: (x, x's scale, x's zero
    point, packed) -> x quantized to u8 at that scale and zero point, times the weights, summed in int32, scaled
    back to fp32 (looked up when used: PyTorch builds without fbgemm have no such operator)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32


def packed_rows(weight: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packing of `weight` [out, in] (fp32) in int8, one symmetric scale per output row."""
    scale = weight.abs().amax(1).clamp_min(1e-12) / 127
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated (torch 2.13), the packing still takes one
        warnings.simplefilter("ignore", UserWarning)
        codes = torch.quantize_per_channel(weight, scale.double(), zeros, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(codes, None)


def tile_packing(packed: torch.ScriptObject) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """oneDNN's packing of the int8 weights in fbgemm's `packed`, with their fp32 scales and zero points [out]."""
    weights = torch.ops.quantized.linear_unpack(packed)[0]
    scales = weights.q_per_channel_scales().float()
    zeros = torch.zeros(scales.shape, dtype=torch.int32)
    return torch.ops.onednn.qlinear_prepack(weights.int_repr(), None), scales, zeros


def tile_product(codes: torch.Tensor, tiled: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """oneDNN's product of `codes` [rows, in] (integers in [-127, 127], in fp32) by the weights `tiled`
    (`tile_packing`): exact integer sums times each output row's fp32 scale, [rows, out] in fp32."""
    weights, scales, zeros = tiled
    rows = (codes + (LEVELS + 1)).to(torch.uint8)  # u8 around the zero point, as fbgemm's product takes them
    return torch.ops.onednn.qlinear_pointwise(
        rows, 1.0, LEVELS + 1, weights, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )


def int8_tiles() -> bool:
    """Whether this CPU has AMX's int8 tiles and PyTorch oneDNN's integer product for them."""
    has_op = torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
    return has_op and "amx_int8" in cpuinfo("flags").split()


def exact_sums() -> bool:
    """Whether this CPU's integer product sums u8 x s8 pairs without saturating (AVX-512 VNNI, AMX: yes; fbgemm's
    AVX2 kernels add pairs in 16 bits, which the extreme codes overflow)."""
    out = product()(torch.full((1, 64), 127.0), 1.0, LEVELS + 1, packed_rows(torch.full((16, 64), -1.0)))
    return torch.allclose(out, torch.full_like(out, -127.0 * 64), rtol=1e-4)  # codes -127 at scale 1/127


def activation_ranges(model: torch.nn.Module, texts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per plain linear layer of `model` (by name): each input channel's largest |x| [in] over one forward of each
    token-id tensor [1, n] of `texts`."""
    found: dict[str, torch.Tensor] = {}

    def recorder(name: str):
        def record(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            seen = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(0).float()
            found[name] = seen if name not in found else torch.maximum(found[name], seen)

        return record

    handles = [m.register_forward_pre_hook(recorder(n)) for n, m in model.named_modules() if plain_linear(m)]
    try:
        with torch.inference_mode():
            for ids in texts:
                model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found


def quantize_w8a8(model: torch.nn.Module, texts: list[torch.Tensor]) -> torch.nn.Module:
    """Replace, in place, every plain linear layer of fp32 `model` (its output matrix too: a tied embedding stays
    the dense one it looks up) by a RowInt8Linear smoothed on the activations `texts` give (`activation_ranges`)."""
    if model.dtype != torch.float32:
        raise ValueError(f"quantize='w8a8' computes in fp32 around its integer products, got {model.dtype}")
    if not exact_sums():
        raise ValueError("quantize='w8a8' needs AVX-512 VNNI or AMX: this CPU's integer product saturates its sums")
    ranges = activation_ranges(model, texts)
    places = [(name, child) for name, parent in model.named_modules() for child, layer in parent.named_children()
              if plain_linear(layer)]  # fmt: skip
    tiles = int8_tiles()
    for name, child in places:  # one at a time, by name: each fp32 matrix is let go as its codes are made
        parent = model.get_submodule(name)
        full = f"{name}.{child}" if name else child
        setattr(parent, child, RowInt8Linear(getattr(parent, child), ranges.get(full), tiles))  # a tied one: untied
    return model


def calibration_texts(tokenizer) -> list[torch.Tensor]:
    """The texts activations are measured on (`forerun/assets/calibration/texts.txt`: prose, code, arithmetic and a
    chat exchange, apart), each as token ids [1, n].

    Example:
        >>> class Letters:
        ...     def __call__(self, text, return_tensors): return type("T", (), {"input_ids": torch.ones(1, len(text))})
        >>> len(calibration_texts(Letters())), calibration_texts(Letters())[0].shape[0]
        (4, 1)
    """
    text = resources.files("forerun").joinpath("assets/calibration/texts.txt").read_text(encoding="utf-8")
    return [tokenizer(part.strip("\n"), return_tensors="pt").input_ids.long() for part in text.split("\n=====\n")]
