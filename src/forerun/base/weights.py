"""Weights kept in 4 or 8 bits on the CPU: every linear layer's matrix but the output matrix quantized (torchao's
tensor subclasses).

A CPU forward of a small model is bound by reading its weights: bf16 reads 16 bits per weight, int4 four (and a
scale and zero per group of 32). torchao's CPU int4 layout (`PrototypeInt4WeightOnlyConfig`, tinygemm's
`_weight_int4pack_mm_for_cpu` behind a tensor subclass) keeps activations in bf16; "int8" holds one code per
weight and one scale per row (`forerun.base.int8`, PyTorch's `_weight_int8pack_mm`), closer to the bf16 model.
forerun on a quantized model is compared with plain generate of the same quantized model: first differences sit
on numerical ties, as for bf16 (`forerun.exactness`).

The output matrix (the vocabulary's logits) stays dense, as transformers' own quantizers leave it and as llama.cpp
keeps it in 6 or 8 bits in a 4-bit file: in 4 bits it moved SmolLM2-135M's next-token choice off the fp32 model's
on 11% of the positions of real text, where every other matrix in 4 bits moves 3% (bf16 weights alone: 2.6%;
docs/benchmarks.md, "How far 4 bits sit from the file's model"). Dense and laid out for oneDNN it also multiplies
a tree's rows faster than the 4-bit kernel does.

Example:
    >>> model, tokenizer = load_model("smollm2-135m", quantize="int4")      # doctest: +SKIP
    >>> weights_kind(model)                                                                             # doctest: +SKIP
    'int4'
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from forerun.base.kernels import direct_kernels, plain_linear
from forerun.base.row_int8 import RowInt8Linear, exact_sums, quantize_w8a8
from forerun.defaults import QUANTIZATIONS

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
"""Weights per scale and zero point: the group of a GGUF Q4 block."""
INT4_ROWS = 16
"""The CPU int4 layout packs output rows in sixteens: a layer with another count stays dense."""


def check_quantize(quantize: str | None, device: str, dtype: torch.dtype) -> None:
    """A ValueError naming the value unless `quantize` can run on `device` in `dtype`."""
    if quantize is None:
        return
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)} or None, got {quantize!r}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantize={quantize!r} runs on the CPU's kernels; the model is on {device}")
    if quantize == "w8a8":
        check_w8a8(dtype)
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"quantize={quantize!r} computes in bf16 (give dtype='bf16' or 'auto'), got {dtype}")
    if not quantizable():
        raise ValueError(f"quantize={quantize!r} needs torchao: pip install 'forerun[quantize]' (torchao==0.18.0)")


def check_w8a8(dtype: torch.dtype) -> None:
    """A ValueError naming what is missing unless 8-bit activations run here in `dtype` (`forerun.base.row_int8`)."""
    if dtype != torch.float32:
        given = f"give dtype='fp32' or 'auto', got {dtype}"
        raise ValueError(f"quantize='w8a8' computes in fp32 around its integer products ({given})")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("quantize='w8a8' needs fbgemm's integer product, which this PyTorch (not x86) lacks")
    if not exact_sums():
        raise ValueError("quantize='w8a8' needs AVX-512 VNNI or AMX: this CPU's integer product saturates its sums")


def quantizable() -> bool:
    """Whether torchao (the `quantize` extra) is installed."""
    return importlib.util.find_spec("torchao") is not None


def quantize_weights(
    model: torch.nn.Module, quantize: str, calibration: list[torch.Tensor] | None = None
) -> torch.nn.Module:
    """Quantize `model`'s dense linear layers in place (`plain_linear` ones; for int4, those whose input width is a
    multiple of GROUP_SIZE and whose output count a multiple of INT4_ROWS) but its output matrix (`output_matrix`);
    layers already holding quantized weights (a GGUF file's kept codes: `forerun.base.gguf_codes`) stay as they are.
    Every quantized layer then calls its kernel directly (`forerun.base.kernels`: the same numbers, less Python).
    "w8a8": every layer, the output matrix too, smoothed on the activations of `calibration` (token ids [1, n]
    each; `forerun.base.row_int8.calibration_texts`)."""
    if quantize == "w8a8":
        if not calibration:
            raise ValueError("quantize='w8a8' measures activations on calibration texts: none were given")
        return quantize_w8a8(model, calibration)
    output = output_matrix(model)
    if quantize == "int8":
        from forerun.base.int8 import quantize_int8

        quantize_int8(model, skip=() if output is None else (output,))
    else:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_

        def fits(module: torch.nn.Module, _: str) -> bool:
            return plain_linear(module) and module is not output and int4_fits(module)

        config = PrototypeInt4WeightOnlyConfig(group_size=GROUP_SIZE, set_inductor_config=False)
        quantize_(model, config, filter_fn=fits)
    direct_kernels(model)
    if weights_kind(model) is None:  # e.g. Falcon: its own linear classes, and the output matrix stays dense
        logger.warning("quantize=%r: no linear layer of %s can hold it; it stays dense", quantize, type(model).__name__)
    return model


def output_matrix(model: torch.nn.Module) -> torch.nn.Module | None:
    """The layer computing a language model's logits (transformers' `get_output_embeddings`), which
    `quantize_weights` leaves dense; None for a module that names none (an EAGLE-3 head: a drafter, all quantized).

    Example:
        >>> output_matrix(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None
        True
    """
    named = getattr(model, "get_output_embeddings", None)
    return named() if callable(named) else None


def vocabulary_rows(model: torch.nn.Module) -> int:
    """How many logits `model`'s output matrix gives (its rows; an 8-bit-activation layer holds no `weight`).

    Example:
        >>> vocabulary_rows(type("M", (), {"get_output_embeddings": lambda self: torch.nn.Linear(4, 9)})())
        9
    """
    matrix = model.get_output_embeddings()
    rows = getattr(matrix, "out_features", None)
    return int(rows) if rows is not None else int(matrix.weight.shape[0])


def int4_fits(layer: torch.nn.Linear) -> bool:
    """Whether the CPU int4 layout can hold `layer`'s weights (dense now, shaped in whole groups and row packs)."""
    return dense(layer.weight) and layer.in_features % GROUP_SIZE == 0 and layer.out_features % INT4_ROWS == 0


def dense(weight: torch.Tensor) -> bool:
    """Whether `weight` is a plain tensor (not one of torchao's quantized tensor subclasses)."""
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


BYTES_PER_WEIGHT = {"int4": 0.5 + 4 / GROUP_SIZE, "int8": 1.0}
"""What a quantized weight reads: int4 half a byte and a bf16 scale and zero per group; int8 one byte (its scale
per row is negligible)."""


def read_bytes(module: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> float:
    """The bytes one forward of `module` reads of its parameters (each counted once, tied ones too; those of the
    modules in `skip` left out: an embedding is looked up, not read). Quantized linear layers count at
    `BYTES_PER_WEIGHT`: a CPU forward of a small model costs about what it reads.

    Example:
        >>> layer = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
        >>> read_bytes(layer), read_bytes(torch.nn.Sequential(layer, layer)), read_bytes(layer, skip=(layer,))
        (4096.0, 4096.0, 0.0)
    """
    quantized = {
        id(m.weight): m.in_features * m.out_features * BYTES_PER_WEIGHT[kind_of(m)]
        for m in module.modules()
        if isinstance(m, torch.nn.Linear) and not dense(m.weight)
    }
    skipped = {id(p) for m in skip for p in m.parameters()}
    return float(
        sum(quantized.get(id(p), p.numel() * p.element_size()) for p in module.parameters() if id(p) not in skipped)
    )


def looked_up(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The model's input embedding where only looked up (not tied to its output matrix, which a forward reads)."""
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output is not None and output.weight is embedding.weight
    return () if tied else (embedding,)


def kind_of(layer: torch.nn.Module) -> str:
    """'int8' or 'int4': the kind of a quantized linear layer's weights."""
    return "int8" if type(layer.weight).__name__ == "Int8RowTensor" else "int4"


def weights_kind(model: torch.nn.Module) -> str | None:
    """'int4', 'int8' or 'w8a8' where the model's linear layers hold quantized weights (any of them: some may stay
    dense, `quantize_weights`), else None (part of a latency curve's key)."""
    for module in model.modules():
        if isinstance(module, RowInt8Linear):
            return "w8a8"
        if isinstance(module, torch.nn.Linear) and not dense(module.weight):
            return kind_of(module)
    return None
