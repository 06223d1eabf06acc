"""transformers' sdpa attention, with grouped key/value heads read in place under a mask, and computed in fp32 for
half-precision models on the CPU.

Grouped heads: a model whose query heads share key/value heads (SmolLM2: 9 over 3) runs sdpa on the shared heads
only where no mask is given; under a mask (every tree forerun verifies, every row of a batch, every step of a
compiled static cache) transformers copies the keys and values once per query head that reads them, the whole
cache, in every layer, every forward. `SDPA_GROUPED` folds each group's query heads into the query length instead
(one kernel call per key/value head, the mask repeated per folded query), so the cache is read where it lies and
the products are the same ones.

Half precision on the CPU:

PyTorch's CPU flash-attention kernel in bf16 costs a fixed ~0.1 ms a call whatever the query's length on an
AVX-512 EPYC (a decode step of a 30-layer model pays it 30 times), while the same kernel in fp32 costs a fifth of
that for one query and about the same for a tree of 32. Casting the query, keys and values up (a few hundred cached
rows of 64 values per head) and the output back down is cheaper than the difference; forerun's own growing cache
keeps such a model's entries in fp32 already (`kvcache.RoomyLayer`'s `upcast`), so only the new ones are cast. The
products before and after stay in the model's dtype; only the softmax(QK^T)V in between is computed in fp32, which
is also the more accurate of the two.

It is registered with transformers' own extension points (`AttentionInterface`, `AttentionMaskInterface`) under
one name, so a model loaded with it runs it in `model.generate` as in forerun: forerun's text is compared with
plain generate of the same model, as always. `forerun.load_model(attn_implementation="auto")` picks it for bf16 and
fp16 on a CPU that measured it faster than the model's own dtype (`forerun.attention_choice`: on an Intel Xeon with
AMX the bf16 kernel has no such fixed cost and is the faster; docs/benchmarks.md has both).

Example:
    >>> model, tokenizer = load_model("smollm2-135m", dtype="bf16")               # doctest: +SKIP
    >>> model.config._attn_implementation                                         # doctest: +SKIP
    'forerun_sdpa_fp32'
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_FP32 = "forerun_sdpa_fp32"
"""The fp32 implementation's name (grouped heads folded too), as `attn_implementation=` takes it once `register()`
has run."""
SDPA_GROUPED = "forerun_sdpa"
"""sdpa with grouped heads folded under a mask, in the model's dtype."""


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention; where `groups` query heads share each key/value head and a mask [b, 1, q, k]
    is given, query [b, kv * groups, q, d] is read as [b, kv, groups * q, d] against key/value [b, kv, k, d] as they
    are, with the mask's rows repeated per group. The output is [b, q, heads, d], as transformers' is.

    Example (9 query heads over 3 key/value heads, 5 queries under a mask: the same output as the copies give):
        >>> class Attention(torch.nn.Module): num_key_value_groups, is_causal = 3, True
        >>> q, k, v = torch.randn(1, 9, 5, 8), torch.randn(1, 3, 12, 8), torch.randn(1, 3, 12, 8)
        >>> mask = torch.ones(1, 1, 5, 12, dtype=torch.bool).tril(7)
        >>> got, _ = grouped_sdpa(Attention(), q, k, v, mask)
        >>> copied, _ = sdpa_attention_forward(Attention(), q, k, v, mask)
        >>> tuple(got.shape), torch.allclose(got, copied, atol=1e-6)
        ((1, 5, 9, 8), True)
    """
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, queries, dim = query.shape
    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None and kwargs.get("softcap") is None
    if groups == 1 or attention_mask is None or attention_mask.shape[1] != 1 or not plain:
        # unmasked: sdpa's own grouped kernels (transformers folds one query itself too, but not while compiling:
        # a compiled static cache's 1-token step would copy the cache)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    folded = query.reshape(batch, heads // groups, groups * queries, dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        folded,
        key,
        value,
        attn_mask=attention_mask.repeat(1, 1, groups, 1),
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
    )
    return output.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


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
        return grouped_sdpa(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    upcast = (query.float(), key.float(), value.float())
    output, weights = grouped_sdpa(module, *upcast, attention_mask, **kwargs)
    return output.to(dtype), weights


KEYS_PER_CALL = 256
"""What one more sdpa call costs, in keys one query row reads (a call's fixed cost against a key's, measured on a
CPU core in fp32: docs/benchmarks.md, "A long document beside short questions"): a batch is attended row by row
only where the padding skipped pays for the extra calls twice over."""


def row_starts(attention_mask: torch.Tensor | None, batch: int) -> list[int] | None:
    """Per row of a batch's bool mask [batch, 1, queries, keys]: the first key any of its queries sees, where
    attending row by row from there skips enough padding to pay for its extra calls (`KEYS_PER_CALL`); else None.

    A batch's rows share one cache as long as its longest row, left-padded: beside a 2000-token row, a 300-token
    row's every query reads 2000 keys, most of them masked. Only on a CPU outside compiling: the starts are read
    on the host (a captured or compiled forward cannot), and a GPU's step reads its padding for free.

    Example (two rows of 8 keys; the second sees only its last 2):
        >>> mask = torch.ones(2, 1, 1, 8, dtype=torch.bool); mask[1, ..., :6] = False
        >>> row_starts(mask, 2), row_starts(mask[:, :, :, :4], 2)
        (None, None)
        >>> wide = torch.ones(2, 1, 1, 2048, dtype=torch.bool); wide[1, ..., :1700] = False
        >>> row_starts(wide, 2)
        [0, 1700]
    """
    if (
        attention_mask is None
        or batch < 2
        or attention_mask.dtype != torch.bool
        or attention_mask.dim() != 4
        or attention_mask.shape[:2] != (batch, 1)
        or attention_mask.device.type != "cpu"
        or torch.compiler.is_compiling()
    ):
        return None
    starts = attention_mask[:, 0].any(dim=1).to(torch.uint8).argmax(dim=-1).tolist()
    skipped = sum(starts) * attention_mask.shape[2]
    return starts if skipped >= 2 * KEYS_PER_CALL * (batch - 1) else None


def by_rows(attend: Callable[..., tuple[torch.Tensor, None]]) -> Callable[..., tuple[torch.Tensor, None]]:
    """`attend` (an sdpa attention function) run row by row from each row's first visible key where `row_starts`
    says so; as it is otherwise. Each row reads its own keys and values where they lie (views, no copies); what it
    computes is what the same row attended alone over the same visible keys computes."""

    def attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
        whole = attention_mask is None or attention_mask.shape[-1] != key.shape[-2]  # a mask over other slots
        starts = None if whole else row_starts(attention_mask, query.shape[0])
        if starts is None:
            return attend(module, query, key, value, attention_mask, **kwargs)
        rows = [
            attend(
                module,
                query[row : row + 1],
                key[row : row + 1, :, start:],
                value[row : row + 1, :, start:],
                attention_mask[row : row + 1, :, :, start:],
                **kwargs,
            )[0]
            for row, start in enumerate(starts)
        ]
        return torch.cat(rows), None

    attention.__name__ = attention.__qualname__ = f"{attend.__name__}_by_rows"
    return attention


ROWS_GROUPED = by_rows(grouped_sdpa)
ROWS_FP32 = by_rows(sdpa_in_fp32)


def register() -> str:
    """Make SDPA_FP32 and SDPA_GROUPED names transformers knows (idempotent: the same functions under the same
    names); returns SDPA_FP32. Both attend a batch row by row where its padding is wide (`by_rows`).

    The mask is sdpa's own (a bool mask, True = visible), so padding, sliding windows and forerun's tree masks
    reach the kernel exactly as with `attn_implementation="sdpa"`.
    """
    for name, function in ((SDPA_FP32, ROWS_FP32), (SDPA_GROUPED, ROWS_GROUPED)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    return SDPA_FP32


def pick_attention(attn_implementation: str, device: str, dtype: torch.dtype) -> str:
    """The implementation `load_model` asks transformers for: "auto" is SDPA_FP32 for bf16/fp16 on the CPU, else
    SDPA_GROUPED (`load_model` then keeps SDPA_FP32 only where this CPU measured it faster than SDPA_GROUPED in the
    model's dtype: `forerun.attention_choice`); any other name is passed through (forerun's are registered first
    when asked for by name).

    Example:
        >>> pick_attention("auto", "cpu", torch.bfloat16), pick_attention("auto", "cpu", torch.float32)
        ('forerun_sdpa_fp32', 'forerun_sdpa')
        >>> pick_attention("eager", "cpu", torch.bfloat16), pick_attention("sdpa", "cpu", torch.float32)
        ('eager', 'sdpa')
    """
    half = dtype in (torch.bfloat16, torch.float16)
    if attn_implementation == "auto":
        attn_implementation = SDPA_FP32 if half and torch.device(device).type == "cpu" else SDPA_GROUPED
    if attn_implementation in (SDPA_FP32, SDPA_GROUPED):
        register()
    return attn_implementation


def sdpa_like(attn_implementation: str | None) -> bool:
    """Whether the implementation is transformers' sdpa underneath (takes bool masks, grouped heads alike)."""
    return attn_implementation in ("sdpa", SDPA_FP32, SDPA_GROUPED)


PLANLESS_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""A drafter's attention backends on a CUDA device: every one but cuDNN's."""


def planless_attention(device: torch.device) -> AbstractContextManager:
    """Where a drafter's own eager attention may run (an EAGLE-3 head's, a draft model's): on a CUDA device,
    anywhere but cuDNN. A drafter reads a cache that grows by a few positions every step, in shapes that change
    every step; cuDNN's attention builds (and keeps) an execution plan per new shape on the host, so a drafter let
    onto it spends most of each step planning (docs/benchmarks.md, the GPU section: an EAGLE-3 head). The other
    kernels need no plan. Elsewhere (a CPU) nothing changes. The target's own forwards are left as they are (what
    they compute is compared with plain generate's). The switch is torch's own scoped one (`sdpa_kernel`),
    restored on leaving.

    Example:
        >>> with planless_attention(torch.device("cuda")):
        ...     torch.backends.cuda.cudnn_sdp_enabled()
        False
    """
    return sdpa_kernel(PLANLESS_BACKENDS) if device.type == "cuda" else nullcontext()
