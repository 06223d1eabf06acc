"""A check, once per Decoder, that forerun's feed of a model of an untested family gives that model's own logits.

forerun feeds a model its text in pieces: a prefill, then each step's tokens after a cache, a tree's nodes side
by side at their depths under a 4-D mask, the accepted path gathered in the cache. The families its tests decode
(`TESTED_FAMILIES`) are known to give, that way, the logits of one plain forward over the whole text. A model of
another family might count positions its own way, read a state of its own, or attend both ways (an encoder
loaded as a causal LM without `is_decoder`): then forerun would write other text than `model.generate`. So for
those families a few short forwards compare both ways of feeding the same tokens before any request is decoded:
a model that gives other logits even a step at a time is refused; one that only misplaces a tree's nodes (its
positions counted its own way) decodes one token per forward, and a batch's rows one after another (their positions
are per row too).

Example:
    >>> check_feed(model, trees=True)  # None: feeds are the model's own (raises where steps differ)  # doctest: +SKIP
"""

from __future__ import annotations

import logging

import torch

from forerun.base.dynamic import DynamicBase
from forerun.base.weights import weights_kind
from forerun.forward_inputs import forward_parameters
from forerun.tree import TokenTree

logger = logging.getLogger("forerun")

TESTED_FAMILIES = frozenset(
    # tests/tiny_models.py: FAMILIES (every method), MORE_FAMILIES (auto alone and batched), STATEFUL_FAMILIES and
    # STATE_SPACE_FAMILIES (chains, or one token per forward), and the ALiBi and position fallbacks of the tests
    "llama mistral mixtral qwen2 qwen3 gemma gemma2 phi3 stablelm olmo2 granite gpt2 gptj opt gpt_neox falcon "
    "cohere olmo starcoder2 smollm3 glm glm4 exaone4 ernie4_5 seed_oss apertus arcee gemma3_text nemotron phi "
    "gpt_bigcode codegen qwen2_moe qwen3_moe olmoe granitemoe gpt_oss deepseek_v3 glm4_moe_lite cohere2 glm4_moe "
    "llama4_text ministral3 minimax_m2 olmo3 phimoe ernie4_5_moe jamba bamba granitemoehybrid nemotron_h qwen3_next "
    "qwen3_5_text olmo_hybrid recurrent_gemma lfm2 falcon_h1 zamba zamba2 mamba falcon_mamba mamba2 bloom mpt "
    "trocr".split()
)
"""Model types (`config.model_type`) whose decoding the tests compare with `model.generate`: not probed."""

PROBE_IDS = (11, 7, 19, 5, 23, 13, 29, 17, 31, 37)
"""The probe's text: ten token ids (any ids serve: the two feeds are compared on the same tokens)."""

TOLERANCE = {"exact": 1e-4, "rounded": 5e-2, "rounded states": 1.5e-2}
"""The largest difference allowed, as a share of the logits' spread: fp32 feeds differ by ~1e-6 of it (rounding in
another order), bf16 ones by ~6e-3 (SmolLM2-135M); a wrong position or mask moves logits by a large share. A model
with recurrent states is held closer in low precision: a chain or a batch row computed another way than its forward
moves logits by little (RecurrentGemma's: 3.5-4e-2 of the spread, in fp32 as in bf16) yet writes other text past
ties; the hybrids tested differ by at most 5e-3 in bf16 (Jamba's chains)."""


def allowed_share(model: torch.nn.Module, states: bool = False) -> float:
    """The `TOLERANCE` `model`'s probes are held to: exact in fp32 with dense weights, rounded otherwise (closer for
    the probes of a model's recurrent states, `states`)."""
    if model.dtype == torch.float32 and weights_kind(model) is None:
        return TOLERANCE["exact"]
    return TOLERANCE["rounded states" if states else "rounded"]


def check_feed(model: torch.nn.Module, trees: bool) -> str | None:
    """Raise ValueError naming the model where forerun's feed of a prefill and two steps gives other logits than
    the model's own forward over the same tokens; with `trees`, return why its trees cannot be verified where a
    tree and a gathered path after it give other logits (None: they can, or `trees` is False). Models of
    `TESTED_FAMILIES` are not probed."""
    kind = getattr(model.config, "model_type", None)
    if kind in TESTED_FAMILIES:
        return None
    logger.info("forerun: checking how %s takes a fed text (a family forerun's tests do not cover)", kind)
    allowed = allowed_share(model)
    with torch.inference_mode():
        share = steps_share(model)
        if share > allowed:
            raise ValueError(
                f"{type(model).__name__} ({kind}) gives other logits when fed a step at a time after its cache than "
                f"over the whole text at once ({share:.2g} of their spread): forerun cannot decode it exactly "
                "(an encoder loaded without is_decoder=True, or positions or state of its own); plain "
                "model.generate can"
            )
        share = tree_share(model) if trees else 0.0
    if share <= allowed:
        return None
    return (
        f"{type(model).__name__} ({kind}) gives a tree's tokens other logits than the same tokens in a row "
        f"({share:.2g} of their spread): one token per forward, and a batch's rows one after another"
    )


def own_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's own forward over `ids`, as plain generate's first step runs it: [len(ids), vocab] in fp32."""
    device = next(model.parameters()).device
    mask = torch.ones(1, len(ids), dtype=torch.long, device=device)
    inputs = {"input_ids": torch.tensor([ids], device=device), "attention_mask": mask}
    if "position_ids" in (forward_parameters(model) or ()):
        inputs["position_ids"] = torch.arange(len(ids), device=device)[None]
    return model(**inputs, use_cache=False).logits[0].float()


def share_of_spread(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of `got` from `want` ([n, vocab] each) over the narrowest spread of a row of `want`."""
    spread = (want.max(-1).values - want.min(-1).values).min().clamp_min(1e-6)
    return float((got.float() - want).abs().max() / spread)


def probe_ids(model: torch.nn.Module) -> list[int]:
    """`PROBE_IDS` within the model's vocabulary."""
    vocab = model.get_input_embeddings().weight.shape[0]
    return [token % vocab for token in PROBE_IDS]


def steps_share(model: torch.nn.Module) -> float:
    """forerun's prefill of the first 8 probe tokens and two one-token steps against one plain forward."""
    ids = probe_ids(model)
    base = DynamicBase(model)
    base.begin(len(ids) + 8)
    got = []
    for at in range(7, len(ids)):
        got.append(base.forward(TokenTree.rooted_at(ids[at]), at, ids[:at] if at == 7 else ()).logits[0])
        base.commit(at, [0])
    return share_of_spread(torch.stack(got), own_logits(model, ids)[7:])


def tree_share(model: torch.nn.Module) -> float:
    """A tree after 7 cached tokens (root, a path of two, a side branch) against plain forwards of each path,
    then a step after the side branch's path gathered into the cache."""
    ids = probe_ids(model)
    side, after = ids[2], ids[4]
    base = DynamicBase(model)
    base.begin(len(ids) + 8)
    base.forward(TokenTree.rooted_at(ids[6]), 6, ids[:6])
    base.commit(6, [0])
    tree = TokenTree.rooted_at(ids[7])
    tree.add(tree.add(0, ids[8]), ids[9])
    tree.add(0, side)
    logits = base.forward(tree, 7, ()).logits
    shares = [
        share_of_spread(logits[:3], own_logits(model, ids)[7:]),
        share_of_spread(logits[3:], own_logits(model, [*ids[:8], side])[-1:]),
    ]
    base.commit(7, [0, 3])
    step = base.forward(TokenTree.rooted_at(after), 9, ()).logits
    shares.append(share_of_spread(step, own_logits(model, [*ids[:8], side, after])[-1:]))
    return max(shares)
