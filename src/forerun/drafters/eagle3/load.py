"""Read an EAGLE-3 head from a folder in SpecForge's export layout and check it against its target.

The folder holds `config.json` (`"architectures": ["LlamaForCausalLMEagle3"]`, the Llama sizes, `draft_vocab_size`,
optionally `target_hidden_size`, `fc_norm`, `norm_output` and `eagle_config.eagle_aux_hidden_state_layer_ids`) and
safetensors with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, the maps `d2t`/`t2d`, and
`embed_tokens.weight` where the head ships its own embedding. Anything that would make a head draft garbage
silently is a ValueError naming the file and the key: sizes that do not fit the target, a vocabulary that is not
the target's, maps out of range or inconsistent, missing or unknown weights.

Example:
    >>> head = load_head("smollm2-135m", model)  # the shipped head, or a folder    # doctest: +SKIP
    >>> head.aux_layers                                                 # doctest: +SKIP
    (1, 14, 26)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from forerun.base.weights import quantizable, quantize_weights, vocabulary_rows, weights_kind
from forerun.drafters.eagle3.head import Eagle3Head, default_aux_layers

ARCHITECTURE = "LlamaForCausalLMEagle3"
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size")


SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "heads"
"""Heads that ship with forerun, one folder each, named as their target's alias (`smollm2-135m`)."""


def head_folder(path: Path | str) -> Path:
    """`path` as a folder, or the shipped head of that name where no such folder exists.

    Example:
        >>> head_folder("smollm2-135m").name, head_folder("heads/mine").as_posix()
        ('smollm2-135m', 'heads/mine')
    """
    folder = Path(path).expanduser()
    if not folder.is_dir() and str(path) and (SHIPPED / str(path)).is_dir():
        return SHIPPED / str(path)
    return folder


def head_dtype(target_dtype: torch.dtype, device_type: str, bf16_units: bool | None = None) -> torch.dtype:
    """The dtype a head computes in: its target's, except under an fp32 target on a CPU that computes bf16
    (`bf16_units`; None: ask oneDNN). The head only guesses, so its precision never changes what is written, while
    its forwards are time the target's are not: bf16 halves the bytes its output matrix reads (measured: the
    benchmarks page, "EAGLE-3").

    Example:
        >>> head_dtype(torch.float32, "cpu", bf16_units=True), head_dtype(torch.float32, "cpu", bf16_units=False)
        (torch.bfloat16, torch.float32)
        >>> head_dtype(torch.float32, "cuda"), head_dtype(torch.float16, "cpu", bf16_units=True)
        (torch.float32, torch.float16)
    """
    if target_dtype != torch.float32 or device_type != "cpu":
        return target_dtype
    if bf16_units is None:
        bf16_units = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if bf16_units else target_dtype


def head_weights(target_kind: str | None, dtype: torch.dtype, device_type: str, torchao: bool) -> str | None:
    """The kind of weights a head's linear layers take (None: dense): the target's where it holds 4- or 8-bit
    weights; int4 for another target where the head computes in bf16 on a CPU and torchao is installed. On a CPU a
    head forward is bound by reading its weights, as a small target's is: int4 reads a quarter of bf16's bytes, and
    torchao's int4 products of a few rows are no slower than bf16's (the benchmarks page, "EAGLE-3", measures both).

    Example:
        >>> head_weights(None, torch.bfloat16, "cpu", torchao=True), head_weights("int8", torch.bfloat16, "cpu", True)
        ('int4', 'int8')
        >>> head_weights(None, torch.float32, "cpu", True), head_weights(None, torch.bfloat16, "cuda", True)
        (None, None)
    """
    if target_kind is not None and target_kind != "w8a8":  # a head's few rows gain nothing from 8-bit activations
        return target_kind
    return "int4" if torchao and device_type == "cpu" and dtype == torch.bfloat16 else None


def load_head(
    path: Path | str, target: torch.nn.Module, dtype: torch.dtype | None = None, quantized: bool = True
) -> Eagle3Head:
    """The head in folder `path` (or the shipped head of that name), on the target's device, in eval mode, in
    `dtype` (None: `head_dtype`). A head that reads the target's embedding leaves it as it is: the head casts
    what it looks up; its rotary frequencies stay fp32.

    `quantized`: the head's linear layers in fewer bits where that pays (`head_weights`): as the target's where
    those hold 4- or 8-bit weights (`load_model(..., quantize=)`), else int4 where the head computes in bf16 on a
    CPU. A head forward reads its weights as the target's forward reads its own, so on a CPU its time is about its
    bytes (`forerun.base.weights.read_bytes`); its few-row products then run on the target's kernels. Its guesses
    move a little; what is written never does. False: dense, in `dtype`."""
    folder = head_folder(path)
    if not folder.is_dir():
        shipped = sorted(p.name for p in SHIPPED.iterdir() if p.is_dir()) if SHIPPED.is_dir() else []
        raise FileNotFoundError(f"EAGLE-3 head folder not found: {folder} (shipped heads: {', '.join(shipped)})")
    config_file = folder / "config.json"
    raw = read_config(config_file)
    config = LlamaConfig.from_dict(raw)
    target_config = target.config.get_text_config()
    target_hidden = raw.get("target_hidden_size", raw["hidden_size"])
    vocab = vocabulary_rows(target)
    check(
        target_hidden == target_config.hidden_size,
        config_file,
        "target_hidden_size",
        f"the head reads {target_hidden}-wide hidden states; the target's are {target_config.hidden_size}",
    )
    check(
        raw["vocab_size"] in (vocab, target_config.vocab_size),
        config_file,
        "vocab_size",
        f"{raw['vocab_size']}, but the target's vocabulary has {vocab} tokens (a head for another model?)",
    )
    layers = aux_layers(raw, config_file, target_config.num_hidden_layers)
    weights_file, state = read_weights(folder)
    embed = target.get_input_embeddings()
    if "embed_tokens.weight" in state:
        embed = torch.nn.Embedding(*state["embed_tokens.weight"].shape)
    else:
        check(
            embed.weight.shape[1] == raw["hidden_size"],
            weights_file,
            "embed_tokens.weight",
            f"missing, and the target's embedding is {embed.weight.shape[1]} wide, not the head's {raw['hidden_size']}",
        )
    head = Eagle3Head(config, embed, layers)
    check_state(head, state, weights_file)
    check_maps(state["d2t"], state["t2d"], raw["vocab_size"], weights_file)
    head.load_state_dict(state, strict=False)
    parameter = next(target.parameters())
    dtype = dtype or head_dtype(parameter.dtype, parameter.device.type)
    for module in head.children():
        # the target's embedding stays the target's; the rotary frequencies stay fp32, as in training
        if module is not target.get_input_embeddings() and module is not head.rotary:
            module.to(device=parameter.device, dtype=dtype)
    kind = head_weights(weights_kind(target), dtype, parameter.device.type, quantizable())
    if quantized and kind is not None:
        quantize_weights(head, kind)
    return head.to(device=parameter.device).eval()


def check(condition: bool, file: Path, key: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{file}: {key}: {message}")


def read_config(config_file: Path) -> dict:
    """config.json as a dict, with the keys a head cannot do without."""
    if not config_file.is_file():
        raise ValueError(f"{config_file}: missing (an EAGLE-3 head folder holds config.json and safetensors)")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file}: not JSON ({error})") from error
    check(isinstance(raw, dict), config_file, "(top level)", "not an object")
    check(
        ARCHITECTURE in (raw.get("architectures") or []),
        config_file,
        "architectures",
        f"{raw.get('architectures')!r}, expected [{ARCHITECTURE!r}]",
    )
    for key in REQUIRED:
        value = raw.get(key)
        check(type(value) is int and value > 0, config_file, key, f"must be a positive integer, got {value!r}")
    return raw


def aux_layers(raw: dict, config_file: Path, layers: int) -> tuple[int, int, int]:
    """The target layers the head reads: as the config names them, else SpecForge's default choice (low, middle,
    high: 1, L/2 - 1, L - 4, kept within a shallow target's layers)."""
    named = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = named if named is not None else list(default_aux_layers(layers))
    valid = isinstance(ids, list) and len(ids) == 3 and all(type(i) is int and 0 <= i < layers for i in ids)
    check(
        valid,
        config_file,
        "eagle_config.eagle_aux_hidden_state_layer_ids",
        f"needs 3 layer ids in [0, {layers}) (the target has {layers} layers), got {ids!r}",
    )
    return tuple(ids)


def read_weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files (one file, or a sharded export)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors file (an EAGLE-3 head folder holds config.json and safetensors)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as error:  # safetensors raises its own error types on a cut or foreign file
            raise ValueError(f"{file}: cannot read it as safetensors ({error})") from error
    return files[0] if len(files) == 1 else folder, state


def check_state(head: Eagle3Head, state: dict[str, torch.Tensor], file: Path) -> None:
    """Every weight the head needs is there with its shape; nothing else is."""
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items() if not name.startswith("rotary.")}
    if "embed_tokens.weight" not in state:
        expected = {k: v for k, v in expected.items() if not k.startswith("embed_tokens.")}
    for key in sorted(expected):
        check(key in state, file, key, "missing")
        check(
            tuple(state[key].shape) == expected[key],
            file,
            key,
            f"shape {tuple(state[key].shape)}, but the config makes it {expected[key]}",
        )
    unknown = sorted(set(state) - set(expected))
    check(not unknown, file, unknown[0] if unknown else "", f"not part of an {ARCHITECTURE} head ({len(unknown)} such)")


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, file: Path) -> None:
    """d2t holds offsets (draft id k is target id k + d2t[k]) within the vocabulary; t2d marks exactly those."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    check(d2t.dtype in (torch.int32, torch.int64), file, "d2t", f"must hold integers, got {d2t.dtype}")
    check(
        bool(((ids >= 0) & (ids < vocab)).all()),
        file,
        "d2t",
        f"maps draft ids outside the target's vocabulary [0, {vocab})",
    )
    check(t2d.numel() == vocab, file, "t2d", f"has {t2d.numel()} entries for a {vocab}-token vocabulary")
    selected = torch.nonzero(t2d.bool()).flatten()
    check(torch.equal(selected, ids), file, "t2d", "does not mark exactly the target ids d2t maps to")
