"""Attention for half-precision models on the CPU: transformers' sdpa, computed in fp32.

PyTorch's CPU flash-attention kernel in bf16 costs a fixed ~0.1 ms a call whatever the query's length (a decode
step of a 30-layer model pays it 30 times), while the same kernel in fp32 costs a fifth of that for one query and
about the same for a tree of 32. Casting the query, keys and values up (a few hundred cached rows of 64 values per
head) and the output back down is cheaper than the difference. The products before and after stay in the model's
dtype; only the softmax(QK^T)V in between is computed in fp32, which is also the more accurate of the two.

It is registered with transformers' own extension points (`AttentionInterface`, `AttentionMaskInterface`) under
one name, so a model loaded with it runs it in `model.generate` as in forerun: forerun's text is compared with
plain generate of the same model, as always. `forerun.load_model(attn_implementation="auto")` picks it for bf16 and
fp16 on the CPU (docs/benchmarks.md has the latency curves both ways).

Example:
    >>> model, tokenizer = load_model("smollm2-135m", dtype="bf16")               # doctest: +SKIP
    >>> model.config._attn_implementation                                         # doctest: +SKIP
    'forerun_sdpa_fp32'
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_FP32 = "forerun_sdpa_fp32"
"""The attention implementation's name, as `attn_implementation=` takes it once `register()` has run."""


def sdpa_in_fp32(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention on fp32 copies of query [b, heads, q, d] and key/value [b, kv_heads, k, d];
    the output [b, q, heads, d] comes back in the query's dtype. A float mask is cast up with them (a bool mask,
    forerun's tree mask, is kept as it is)."""
    dtype = query.dtype
    if dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    upcast = (query.float(), key.float(), value.float())
    output, weights = sdpa_attention_forward(module, *upcast, attention_mask, **kwargs)
    return output.to(dtype), weights


def register() -> str:
    """Make SDPA_FP32 a name transformers knows (idempotent: the same function under the same name); returns it.

    The mask is sdpa's own (a bool mask, True = visible), so padding, sliding windows and forerun's tree masks
    reach the kernel exactly as with `attn_implementation="sdpa"`.
    """
    AttentionInterface.register(SDPA_FP32, sdpa_in_fp32)
    AttentionMaskInterface.register(SDPA_FP32, sdpa_mask)
    return SDPA_FP32


def pick_attention(attn_implementation: str, device: str, dtype: torch.dtype) -> str:
    """The implementation `load_model` asks transformers for: "auto" is SDPA_FP32 for bf16/fp16 on the CPU, else
    "sdpa"; any other name is passed through (SDPA_FP32 is registered first when asked for by name).

    Example:
        >>> pick_attention("auto", "cpu", torch.bfloat16), pick_attention("auto", "cpu", torch.float32)
        ('forerun_sdpa_fp32', 'sdpa')
        >>> pick_attention("eager", "cpu", torch.bfloat16)
        'eager'
    """
    half = dtype in (torch.bfloat16, torch.float16)
    if attn_implementation == "auto":
        attn_implementation = SDPA_FP32 if half and torch.device(device).type == "cpu" else "sdpa"
    if attn_implementation == SDPA_FP32:
        register()
    return attn_implementation


def sdpa_like(attn_implementation: str | None) -> bool:
    """Whether the implementation is transformers' sdpa underneath (takes bool masks, grouped heads alike)."""
    return attn_implementation in ("sdpa", SDPA_FP32)
