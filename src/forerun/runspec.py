"""One run specification for every command: model, device, dtype, method, knobs, draft model, budget, threads.

`forerun generate`, `chat`, `serve`, `bench`, `curve` and `trie build` parse their options into a `RunSpec`, which
checks everything it can before the (slow) model load, then loads the model once and builds Decoders the same way.

Example:
    >>> spec = RunSpec(method="auto", knobs={"trie.decoding_length": 16}, dtype="bf16")
    >>> spec.torch_dtype
    torch.bfloat16
    >>> RunSpec(dtype="fp64")
    Traceback (most recent call last):
    ...
    ValueError: dtype must be one of fp32, bf16, fp16, got 'fp64'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from forerun.attention import SDPA_FP32, SDPA_GROUPED
from forerun.base.packed import check_pack
from forerun.base.weights import check_quantize
from forerun.config import EngineConfig
from forerun.defaults import BF16_QUANTIZATIONS, DEFAULT_METHOD, DEFAULT_MODEL
from forerun.methods import MethodPlan, plan_method
from forerun.models import DTYPES

ATTENTIONS = ("auto", "sdpa", "eager", SDPA_FP32, SDPA_GROUPED)
"""What `--attention` takes (transformers' names, and forerun's two sdpa variants)."""
MAX_THREADS = 1024
PACKS = {"auto": None, "on": True, "off": False}
"""What `--pack` takes -> `load_model(pack=)`."""


def parse_device(text: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:1', 'mps' -> a device that exists here; anything else raises a ValueError."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be like cpu, cuda or cuda:1, got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r} asked for, but this machine has no CUDA device (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {text!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device type {device.type!r} is not supported; use cpu, cuda or mps")
    return device


@dataclass(frozen=True)
class RunSpec:
    """What to run, checked on construction (a ValueError names the bad value)."""

    model: str = DEFAULT_MODEL
    """Alias, local folder, .gguf file or cached hub id (forerun.load_model)."""
    method: str = DEFAULT_METHOD
    """A method expression: 'trie', 'prompt_lookup+trie', 'auto', 'plain' (forerun.methods)."""
    knobs: Mapping[str, object] = field(default_factory=dict)
    """Method knobs; dotted ('trie.decoding_length') when several methods are combined."""
    device: str = "cpu"
    dtype: str = "auto"
    """fp32 (token for token identical to generate), bf16 or fp16 (identical up to numerical ties); auto: bf16 on
    a CUDA device (a GPU's own precision; GGUF weights are dequantized to it), fp32 elsewhere. Resolved on
    construction, so `spec.dtype` always names the dtype that runs."""
    draft_model: str | None = None
    """The small model of method draft_model (a name for load_model)."""
    draft_head: str | None = None
    """The EAGLE-3 head of method eagle3 (a folder in SpecForge's layout); 'auto' drafts with it too."""
    max_tree_nodes: int | None = None
    threads: int = 0
    """torch threads (0 = torch's default), pinned before the model loads."""
    quantize: str | None = None
    """'int4' or 'int8': every linear layer's weights in 4 or 8 bits (CPU, bf16 activations; `forerun.base.weights`);
    'w8a8': 8-bit weights and activations, integer products, fp32 around them (`forerun.base.row_int8`)."""
    attention: str = "auto"
    """auto (sdpa with grouped heads read in place, computed in fp32 for bf16/fp16 on a CPU that measured that
    faster: `forerun.attention`, `forerun.attention_choice`),
    sdpa (transformers' own), eager, SDPA_FP32 or SDPA_GROUPED."""
    compile_buckets: bool = False
    """A CUDA device's single rows: each bucket's forward compiled before it is captured (`EngineConfig`)."""
    pack: str = "auto"
    """on | off | auto: dense linear layers laid out once for oneDNN's kernels (`forerun.base.packed`); auto: on a
    CPU with AVX-512 (fp32 or bf16) where one row through them measured no slower so (`forerun.base.pack_choice`)."""

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            bf16 = parse_device(self.device).type == "cuda" or self.quantize in BF16_QUANTIZATIONS
            object.__setattr__(self, "dtype", "bf16" if bf16 else "fp32")
        check_quantize(self.quantize, self.device, DTYPES.get(self.dtype, torch.float32))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        parse_device(self.device)
        if self.compile_buckets and parse_device(self.device).type != "cuda":
            raise ValueError(f"compile_buckets is for a CUDA device's captured graphs; the device is {self.device!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.pack not in PACKS:
            raise ValueError(f"pack must be one of {', '.join(PACKS)}, got {self.pack!r}")
        check_pack(bool(PACKS[self.pack]), self.device, self.torch_dtype)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 0 <= self.threads <= MAX_THREADS:
            raise ValueError(
                f"threads must be an integer in [0, {MAX_THREADS}] (this machine has {os.cpu_count()} "
                f"cores), got {self.threads!r}"
            )
        if self.max_tree_nodes is not None:
            EngineConfig(max_tree_nodes=self.max_tree_nodes)  # one check, one message: the engine's
        plan = self.plan()
        if self.draft_model and not plan.uses_model():
            raise ValueError(f"a draft model is for method draft_model, which is not part of {self.method!r}")
        if plan.uses_head() and not self.draft_head:
            raise ValueError("method eagle3 needs an EAGLE-3 head (--draft-head FOLDER, SpecForge's export layout)")
        if self.draft_head and not plan.uses_head():
            raise ValueError(f"a draft head is for method eagle3 or auto, which are not part of {self.method!r}")
        if plan.needs_draft() and not self.draft_model:
            raise ValueError(
                "method draft_model needs a draft model (--draft-model NAME, a model sharing the tokenizer) "
                "or the knob self_draft_layers=K"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def plan(self, method: str | None = None, knobs: Mapping[str, object] | None = None) -> MethodPlan:
        """The parsed method (this spec's, or another one on the same device: chat's /method, a server request)."""
        device_type = torch.device(self.device).type
        knobs = self.knobs if knobs is None else knobs
        return plan_method(method or self.method, knobs, device_type, head=bool(self.draft_head))

    def pin_threads(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def load(self):
        """(model, tokenizer, draft model or None), threads pinned first."""
        from forerun.drafters.draft_model import load_draft
        from forerun.models import load_model

        self.pin_threads()
        model, tokenizer = load_model(
            self.model, self.attention, self.torch_dtype, self.device, quantize=self.quantize, pack=PACKS[self.pack]
        )
        draft = load_draft(self.draft_model, model, tokenizer) if self.draft_model else None
        return model, tokenizer, draft

    def decoder(
        self, model, tokenizer, draft=None, method: str | None = None, knobs: Mapping[str, object] | None = None
    ):
        """A Decoder for this spec's method (or `method` with `knobs`), with the draft model where it is needed."""
        from forerun.decoder import Decoder

        plan = self.plan(method, knobs)
        if plan.needs_draft() and draft is None:
            raise ValueError("method draft_model needs a draft model: start with --draft-model NAME")
        draft = draft if plan.needs_draft() else None
        head = self.draft_head if plan.uses_head() else None
        return Decoder(model, tokenizer, plan, max_tree_nodes=self.max_tree_nodes, draft_model=draft, draft_head=head,
                       compile_buckets=self.compile_buckets)  # fmt: skip
