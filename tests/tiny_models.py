"""Tiny random causal LMs of many families, built from configs (no download), for exact-equality tests.

Each is a few layers wide enough to have non-trivial attention; weights come from a fixed seed, so runs repeat.
Sliding windows are set larger than any test sequence (beyond the window forerun falls back to plain decoding).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96

COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

FAMILIES: dict[str, dict] = {
    "llama": LLAMA_LIKE,
    "mistral": {**LLAMA_LIKE, "sliding_window": 4096},
    "mixtral": {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2": LLAMA_LIKE,
    "qwen3": {**LLAMA_LIKE, "head_dim": 16},
    "gemma": {**LLAMA_LIKE, "head_dim": 16},
    "gemma2": {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 4096},
    "phi3": {**LLAMA_LIKE, "num_key_value_heads": 4},
    "stablelm": {**LLAMA_LIKE, "num_key_value_heads": 4},
    "olmo2": LLAMA_LIKE,
    "granite": LLAMA_LIKE,
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8),
    "opt": dict(
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
    ),
    "gpt_neox": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    ),
    "falcon": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=False,
        alibi=False,
        max_position_embeddings=512,
    ),
}

MLA = dict(
    LLAMA_LIKE,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)
"""Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash): keys and values from a low-rank projection."""

MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
"""A small mixture of experts, under the names the families' configs use."""

MORE_FAMILIES: dict[str, dict] = {
    **{name: LLAMA_LIKE for name in ("cohere", "olmo", "starcoder2", "smollm3", "glm", "glm4", "exaone4")},
    **{name: LLAMA_LIKE for name in ("ernie4_5", "seed_oss", "apertus", "arcee")},
    "gemma3_text": {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 4096},
    "nemotron": {**LLAMA_LIKE, "head_dim": 16},
    "phi": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512
    ),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_ctx=512, rotary_dim=8),
    "qwen2_moe": {
        **LLAMA_LIKE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {
        **LLAMA_LIKE,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "olmoe": {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {**LLAMA_LIKE, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4096},
    "deepseek_v3": MLA,
    "glm4_moe_lite": MLA,
    "cohere2": {**LLAMA_LIKE, "sliding_window": 4096},
    "glm4_moe": {
        **LLAMA_LIKE,
        "head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "llama4_text": {
        **LLAMA_LIKE,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 96,
    },
    "ministral3": {**LLAMA_LIKE, "head_dim": 16},
    "minimax_m2": {**LLAMA_LIKE, "head_dim": 16, **MOE},
    "olmo3": {**LLAMA_LIKE, "sliding_window": 4096},
    "phimoe": {**LLAMA_LIKE, **MOE, "sliding_window": None},
    "ernie4_5_moe": {**LLAMA_LIKE, **MOE, "moe_num_experts": 4, "moe_k": 2},
}
"""More families, checked with `auto` alone and batched (`tests/equality/test_more_families.py`)."""


SSM = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
STATEFUL_FAMILIES: dict[str, dict] = {
    "jamba": {
        **LLAMA_LIKE,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 2,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
    },
    "bamba": {**LLAMA_LIKE, "attn_layer_indices": [1], **SSM, "mamba_chunk_size": 16},
    "granitemoehybrid": {
        **LLAMA_LIKE,
        "layer_types": ["mamba", "attention"],
        **SSM,
        "mamba_chunk_size": 16,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
    },
    "nemotron_h": {**LLAMA_LIKE, "head_dim": 16, "hybrid_override_pattern": "M*", **SSM, "mamba_chunk_size": 16},
    "qwen3_next": {
        **LLAMA_LIKE,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        **LINEAR,
    },
    "qwen3_5_text": {**LLAMA_LIKE, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"], **LINEAR},
    "olmo_hybrid": LLAMA_LIKE,
    "lfm2": {**LLAMA_LIKE, "full_attn_idxs": [1]},
    "falcon_h1": {
        **LLAMA_LIKE,
        "head_dim": 16,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
    },
    "zamba": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_hidden_size=128,
        mamba_d_state=8,
        mamba_dt_rank=8,
        n_mamba_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
    ),
    "zamba2": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_head_dim=16,
        mamba_d_state=8,
        mamba_headdim=16,
        n_mamba_heads=8,
        mamba_ngroups=1,
        hybrid_layer_ids=[1],
        layers_block_type=["mamba", "hybrid"],
    ),
    "recurrent_gemma": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        lru_width=64,
        block_types=["recurrent", "attention"],
        attention_window_size=512,
    ),
}
"""Hybrid models whose recurrent or convolution states (state-space, linear-attention or short-convolution layers)
cannot step back to a rejected guess: they verify one chain a step, or decode one token per forward where a chain
is another computation (`tests/equality/test_stateful_families.py`)."""

STATE_SPACE_FAMILIES: dict[str, dict] = {
    "mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8),
    "falcon_mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8),
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, state_size=8, num_heads=8, head_dim=16, n_groups=1, expand=2),
}
"""State-space models without attention layers, whose transformers cache holds their states from transformers 5.24
on (`tests/equality/test_stateful_families.py`)."""

NO_SDPA = frozenset({"gemma2", "gptj", "codegen", "gpt_oss"})
"""Families transformers has no sdpa attention for: eager only."""


GROUPED = [f for f, c in FAMILIES.items() if c.get("num_key_value_heads", 0) not in (0, c.get("num_attention_heads"))]
"""Families whose query heads share key/value heads (the ones forerun's grouped attention reads in place)."""


def register_grouped() -> str:
    """forerun's grouped sdpa attention, registered with transformers: its name for `attn_implementation`."""
    from forerun.attention import SDPA_GROUPED, register

    register()
    return SDPA_GROUPED


REMEMBERING = frozenset(STATEFUL_FAMILIES) - {"lfm2", "recurrent_gemma"}
"""Hybrids whose recurrent states `tiny_model` makes matter: initialised as transformers does, a tiny model's states
barely reach its logits (halving Qwen3.5's, Nemotron-H's or Falcon-H1's moved them by under 1e-6 of their spread),
so a state put or cut back wrong would pass every test. Larger weights (`initializer_range` 0.1) and slow decay
(`remember`) move them by 2e-3 to 0.3 (Zamba's by 2e-4)."""


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **config: object) -> torch.nn.Module:
    """A seeded random model of `family` in fp32, eval mode (`config`: settings over the family's own); a hybrid
    with recurrent states remembers its text (`REMEMBERING`)."""
    own = (FAMILIES | MORE_FAMILIES | STATEFUL_FAMILIES)[family]
    memory = {"initializer_range": 0.1} if family in REMEMBERING else {}
    config = AutoConfig.for_model(family, **(COMMON | own | memory | config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return remember(model).eval() if family in REMEMBERING else model.eval()


def remember(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every recurrent layer's decay rates (`A_log`) drawn between 0.01 and 0.5 a token, seeded: its
    states carry the text back over many tokens (transformers draws Qwen3.5's up to 16: a state forgets at once)."""
    draws = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            rates = getattr(module, "A_log", None)
            if isinstance(rates, torch.nn.Parameter):
                rates.copy_(torch.empty(rates.shape).uniform_(0.01, 0.5, generator=draws).log())
    return model


def embedded_tokenizer():
    """The embedded SmolLM2-135M's own tokenizer, read offline from its GGUF file."""
    from transformers import AutoTokenizer

    from forerun.models import resolve

    location, gguf_file = resolve("smollm2-135m")
    return AutoTokenizer.from_pretrained(location, gguf_file=gguf_file, local_files_only=True)


def real_vocab_llama(tokenizer, **config: object) -> torch.nn.Module:
    """A tiny random llama (2 layers, hidden 32) over `tokenizer`'s whole vocabulary, fp32, seeded 0, eval mode:
    what the benchmark's tests run the real chat template through (`config`: settings over these)."""
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **settings | config), dtype=torch.float32)
    return model.eval()


def prompts(count: int, length: int = 24, seed: int = 0) -> list[torch.Tensor]:
    """Random prompts [1, length] over ids 3..VOCAB-1, with repeats so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        half = torch.randint(3, VOCAB, (1, length // 2), generator=generator)
        out.append(torch.cat([half, half[:, : length - length // 2]], dim=1))
    return out


class LetterTokenizer:
    """Token i decodes to chr(ord('a') + i % 26): enough for stop strings on a tiny model."""

    def __len__(self) -> int:
        return VOCAB

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def byte_tokenizer():
    """A fast (Rust) byte-level BPE tokenizer: the 256 bytes, a few JSON merges ('{"', '":', ', ', ' "') and an
    EOS: what llguidance reads for response_format (`forerun.structured`), small enough for a tiny model's
    vocabulary (`tiny_model(family, vocab_size=len(tokenizer))`)."""
    from tokenizers import pre_tokenizers

    vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("{", '"'), ('"', ":"), (",", "Ġ"), ("Ġ", '"'), ("Ġ", "Ġ")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = fast_tokenizer(vocab, merges)
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    return tokenizer


def fast_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], **special: str):
    """A transformers fast tokenizer over a byte-level BPE of `vocab` and `merges` (`special`: its named tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=rust, **special)


CHARACTERS = ["<pad>", "<bos>", "<eos>", *'{}[]":,Ġ', *"abcdefghijklmnopqrstuvwxyz0123456789",
              *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"-.+_!?;'()/\\<>=@#$%&*|~"]  # fmt: skip
"""A character tokenizer's tokens: pad, bos and eos at the ids `COMMON` gives them, JSON's punctuation (Ġ: a
space, in byte-level spelling), then letters, digits and more punctuation: VOCAB of them in all."""


def char_tokenizer(size: int = VOCAB):
    """A fast (Rust) tokenizer of the first `size` CHARACTERS, one character a token: what llguidance reads for
    response_format (`forerun.structured`) over a tiny model's own vocabulary."""
    vocab = {token: i for i, token in enumerate(CHARACTERS[:size])}
    return fast_tokenizer(vocab, [], bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def quantized_tiny(family: str, bits: str) -> torch.nn.Module:
    """A tiny model of `family` with forerun's `bits` weights: int4 / int8 over bf16, or w8a8 (fp32 around integer
    products) smoothed on three random texts' activations."""
    from forerun.base.weights import quantize_weights

    if bits == "w8a8":
        texts = [torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        return quantize_weights(tiny_model(family, "sdpa"), bits, texts)
    return quantize_weights(tiny_model(family, "sdpa").to(torch.bfloat16), bits)
