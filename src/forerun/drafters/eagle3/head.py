"""An EAGLE-3 draft head: one Llama decoder layer that reads the target's own hidden states (EAGLE-3, Li et al.
2025), in the layout SpecForge trains and exports (`LlamaForCausalLMEagle3`) and SGLang and vLLM serve.

What it computes, for a target position i whose next token x_{i+1} is known:

    g_i   = fc([h_low_i ; h_mid_i ; h_high_i])          the target's three auxiliary layers, [3 * Ht] -> [H]
    a_i   = midlayer(emb(x_{i+1}), g_i)                 attention reads [norm(emb) ; norm(g)], 2 * H wide
    p     = softmax(lm_head(norm(a_i)))                 over the draft vocabulary; draft id k is target id
                                                        k + d2t[k]
Deeper guesses feed the head its own output: a_i stands in for g at position i + 1 with the guessed token's
embedding, and so on down the tree. The head keeps its own keys and values of every position it has read
(`HeadCache`), as the target keeps its own.

The modules are transformers' Llama pieces (RMSNorm, MLP, rotary embedding) configured by the head's own
config.json; only the layer's wiring (two inputs, a 2H-wide attention input) is EAGLE-3's. `forerun.drafters.eagle3
.load` reads a head from disk and checks it against its target.

Example (a random head over a tiny target; shapes only):
    >>> config = head_config(hidden_size=32, heads=4, kv_heads=2, vocab=100, draft_vocab=20, target_hidden=48)
    >>> head = Eagle3Head(config, torch.nn.Embedding(100, 32)).eval()
    >>> cache = HeadCache()
    >>> g = head.project(torch.randn(3, 3 * 48))                      # 3 positions' target features
    >>> out = head(torch.tensor([5, 6, 7]), g, torch.arange(3), cache)
    >>> tuple(out.shape), tuple(head.draft_logits(out).shape), cache.length
    ((3, 32), (3, 20), 3)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from forerun.attention import planless_attention


def head_config(
    hidden_size: int, heads: int, kv_heads: int, vocab: int, draft_vocab: int, target_hidden: int | None = None
) -> LlamaConfig:
    """A head's config as SpecForge writes it (for tests and `forerun train-head`): a LlamaConfig with
    `draft_vocab_size` and `target_hidden_size` beside the usual sizes."""
    return LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden or hidden_size,
        max_position_embeddings=4096,
    )


def default_aux_layers(layers: int) -> tuple[int, int, int]:
    """SpecForge's choice of the target layers a head reads when its config names none: low, middle and high
    (1, L/2 - 1, L - 4), kept within a shallow target's `layers`.

    Example:
        >>> default_aux_layers(30), default_aux_layers(2)
        ((1, 14, 26), (1, 0, 0))
    """
    return tuple(min(max(i, 0), layers - 1) for i in (1, layers // 2 - 1, layers - 4))


@dataclass
class HeadCache:
    """The head's keys and values [kv_heads, positions, head_dim] of every position it has read, in order (training
    reads through it; a drafter keeps its entries in preallocated slots instead: `forerun.drafters.eagle3.runner`)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values; returns every entry's (what the new positions attend to)."""
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=1)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=1)
        return self.keys, self.values


class HeadSlots:
    """The head's keys and values in preallocated slots [kv_heads, capacity, head_dim]: a forward writes its new
    positions' at the slots `where` names (a device tensor, set before it) and attends over every slot, its mask
    showing each position the ones it may see. Nothing moves when a drafted branch is rejected (its slots are
    written over later), and the buffers keep their addresses: a captured graph can write and read them.

    Example:
        >>> slots = HeadSlots(2, 8, capacity=16, dtype=torch.float32, device=torch.device("cpu"))
        >>> slots.where = torch.tensor([3, 4])
        >>> keys, values = slots.extend(torch.ones(2, 2, 8), torch.ones(2, 2, 8))
        >>> tuple(keys.shape), keys[0, :, 0].tolist()[2:6]
        ((2, 16, 8), [0.0, 1.0, 1.0, 0.0])
    """

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.where = torch.zeros(0, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values [kv_heads, n, head_dim] at slots `where` [n]; returns every slot's."""
        self.keys.index_copy_(1, self.where, keys.to(self.keys.dtype))
        self.values.index_copy_(1, self.where, values.to(self.values.dtype))
        return self.keys, self.values


class Eagle3Attention(nn.Module):
    """Self-attention whose input is [norm(embedding) ; norm(hidden)], 2 * hidden_size wide."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        wide = 2 * config.hidden_size
        self.q_proj = nn.Linear(wide, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: HeadCache | HeadSlots,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [n, 2H] at new positions; `visible` [n, entries] bool over every entry `cache.extend` returns, the new
        ones included (None, a `HeadCache` only: causal among the new ones). Returns [n, H]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)[None]  # [1, heads, n, d]
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        cos, sin = rotary
        q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
        keys, values = cache.extend(k[0], v[0])
        if visible is None:  # every new position sees the cache and the new ones before it
            past = keys.shape[1] - n
            visible = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)
        with planless_attention(x.device):  # in the slots' dtype (fp32 on a CPU: `runner.slots_dtype`)
            out = F.scaled_dot_product_attention(
                q.to(keys.dtype), keys[None], values[None], attn_mask=visible[None, None], enable_gqa=True
            )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1).to(x.dtype))


class Eagle3Layer(nn.Module):
    """SpecForge's `midlayer`: attention over [norm(embedding) ; norm(hidden)], then an MLP, both residual on
    the hidden input."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embedded, hidden, rotary, cache, visible):  # shapes: see Eagle3Attention.forward
        wide = torch.cat([self.input_layernorm(embedded), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(wide, rotary, cache, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The head (module docstring); `embed` is its own embedding, or the target's where the head ships none."""

    def __init__(self, config: LlamaConfig, embed: nn.Embedding, aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.config = config
        self.aux_layers = tuple(aux_layers)
        """The target's layers whose outputs the head reads (hidden_states[i + 1] in transformers' numbering)."""
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.embed_tokens = embed
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        norms = [LlamaRMSNorm(target_hidden, eps=config.rms_norm_eps) for _ in range(3)]
        self.fc_norm = nn.ModuleList(norms) if getattr(config, "fc_norm", False) else None
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_output = bool(getattr(config, "norm_output", True))
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three auxiliary hidden states [n, 3 * Ht], concatenated, -> g [n, H]."""
        if self.fc_norm is not None:
            features = torch.cat(
                [norm(part) for norm, part in zip(self.fc_norm, features.chunk(3, -1), strict=True)], dim=-1
            )
        return self.fc(features)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache | HeadSlots,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [n] (x_{i+1}), hidden [n, H] (g_i, or the head's own output one level up), positions [n] (i)
        -> the head's output a [n, H], its keys and values appended to `cache`."""
        cos, sin = self.rotary(hidden[None], positions[None])
        embedded = self.embed_tokens(tokens).to(hidden.dtype)
        return self.midlayer(embedded, hidden, (cos[0], sin[0]), cache, visible)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, draft vocabulary] logits."""
        return self.lm_head(self.norm(out) if self.norm_output else out)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> the target's token ids (d2t holds the offsets)."""
        return draft_ids + self.d2t[draft_ids]
