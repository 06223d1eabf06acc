"""The exactness contract, measured: where two greedy outputs first differ, was it a numerical tie?

fp32: forerun's greedy output is token for token plain `model.generate`'s. bf16/fp16: a verification forward over
a tree rounds differently from a 1-token forward (other matrix shapes, other summation orders), as in every
speculative decoder, and so does plain generate itself in a batch of two. The contract there: any first
difference from plain generate happens at a tie, i.e. plain generate's own logits for its token and for the other
token differ by at most `TIE_ULPS` units in the last place of the dtype at that magnitude.

Example (bf16 has 8 significant bits: one unit in the last place at 20.0 is 2**4 * 2**-7 = 0.125):
    >>> ulp(20.0, torch.bfloat16)
    0.125
    >>> logits = torch.zeros(2, 4); logits[1, 1], logits[1, 2] = 20.0, 19.875
    >>> d = first_divergence([7, 1], [7, 2], logits, torch.bfloat16)    # step 0 agrees, step 1 differs
    >>> d.position, d.reference_token, d.token, d.ulps, d.is_tie
    (1, 1, 2, 1.0, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from forerun.base.weights import weights_kind
from forerun.forward_inputs import cache_argument
from forerun.kvcache import keep_accepted
from forerun.tree import TokenTree, pack, tree_support

TIE_ULPS = 2.0
"""Most units in the last place between the two logits for a first difference to count as a tie."""


W8A8_EPS = 2.0**-6
"""The relative spacing ties are judged at around 8-bit activations (`forerun.base.row_int8`): an 8-bit step at half a
row's largest value, twice bf16's. An activation within fp32's rounding of a quantization step rounds either way in
a tree's forward and in generate's (and in generate's own batch of two), moving the logits by up to ~2.3 bf16 ulps
on Qwen2.5-1.5B (docs/exactness.md)."""


def resolution(model: torch.nn.Module) -> torch.dtype | float:
    """What `model`'s ties are judged in (`ulp`): its dtype, but `W8A8_EPS` for fp32 around 8-bit activations.

    Example:
        >>> resolution(torch.nn.Linear(2, 2)), resolution(torch.nn.Linear(2, 2).to(torch.float16))
        (torch.float32, torch.float16)
    """
    dtype = next(model.parameters()).dtype
    return W8A8_EPS if dtype == torch.float32 and weights_kind(model) == "w8a8" else dtype


def ulp(value: float, dtype: torch.dtype | float) -> float:
    """One unit in the last place of `dtype` at the magnitude of `value` (the spacing of representable numbers); a
    float `dtype` is a relative spacing itself (`W8A8_EPS`).

    Example:
        >>> ulp(3.0, torch.bfloat16), ulp(3.0, W8A8_EPS)
        (0.015625, 0.03125)
    """
    magnitude = abs(float(value))
    eps = dtype if isinstance(dtype, float) else torch.finfo(dtype).eps
    if magnitude == 0.0:
        return torch.finfo(torch.float32 if isinstance(dtype, float) else dtype).tiny
    return 2.0 ** math.floor(math.log2(magnitude)) * eps


@dataclass(frozen=True)
class Divergence:
    """The first position where an output left the reference, judged on the reference's own logits."""

    position: int
    """Index among the new tokens."""
    reference_token: int
    token: int
    margin: float
    """reference logit of its own token - reference logit of the other token (>= 0 for greedy)."""
    ulps: float
    """`margin` in units in the last place of the dtype at the larger logit's magnitude."""

    @property
    def is_tie(self) -> bool:
        return self.ulps <= TIE_ULPS


def first_divergence(
    reference: Sequence[int],
    other: Sequence[int],
    reference_logits: torch.Tensor | Sequence[torch.Tensor],
    dtype: torch.dtype | float,
) -> Divergence | None:
    """None when `other` follows `reference` (new tokens only) as far as both go; else the first difference.

    `reference_logits[i]`: the reference's raw logits [vocab] when it chose its i-th new token (what
    `model.generate(..., output_logits=True)` returns). A shorter output that stops early (EOS) is no difference.
    """
    for position, (expected, got) in enumerate(zip(reference, other, strict=False)):
        if expected != got:
            row = reference_logits[position].float().reshape(-1)
            high, low = float(row[expected]), float(row[got])
            margin = high - low
            return Divergence(position, int(expected), int(got), margin, margin / ulp(max(abs(high), abs(low)), dtype))
    return None


def judged_by_one_forward(
    model: torch.nn.Module, prompt: torch.Tensor, reference: Sequence[int], divergence: Divergence
) -> Divergence:
    """The same first difference judged on the model's logits from one forward over the prompt and the reference's
    tokens before it (how the model computes a prompt's positions), instead of generate's step by step.

    A reference margin is one rounding of many: the same text computed by other matrix shapes moves it by an ulp
    or two (docs/exactness.md shows one). A difference that is a tie on either reading is one
    the model's arithmetic cannot tell apart from generate's choice; a chosen second-best token is not a tie on
    either (tested with a verifier that takes the second choice).

    `prompt` [1, P] ids; `reference` plain generate's new tokens; `divergence` as `first_divergence` found it.
    """
    text = torch.tensor([list(reference[: divergence.position])], dtype=prompt.dtype, device=prompt.device)
    with torch.inference_mode():
        logits = model(torch.cat([prompt, text], dim=1)).logits[0, -1]
    found = first_divergence([divergence.reference_token], [divergence.token], [logits], resolution(model))
    assert found is not None  # the two tokens differ
    # a negative margin: one forward ranks the other token first, which is a tie by any reading
    return replace(found, position=divergence.position)


COMPANY = (1, 3, 7)
"""How many other tokens share the forward of `judged_in_company`'s readings: trees of 2, 4 and 8 nodes."""


def judged_in_company(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    reference: Sequence[int],
    divergence: Divergence,
    company: Sequence[int] = COMPANY,
) -> Divergence:
    """The same first difference judged where the token before it is fed as a verification forward feeds it: the
    root of a tree whose other nodes (`k` tokens for each k in `company`, unrelated to the text: drawn from a fixed
    seed) hang below it, after one forward over the text before it. The reading nearest a tie is returned.

    Beside a tree's other nodes a token's own numbers round otherwise: its products have more rows, and a mixture
    of experts computes each expert's tokens as one group. Where a router's scores for the token tie, its experts
    can change. The random search found a tiny Mixtral with 4-bit weights take a token 11 ulps below generate's
    after an exact tie of a router's second and third scores; fed so, beside 3 or 7 other tokens, the model itself
    writes that token over generate's own text. The other nodes see the root and themselves only, so the root's
    logits are what the model computes for generate's text: no draft of forerun's, no mask but the model's tree.
    Models that cannot verify trees (recurrent states) are judged as they were.

    `prompt` [1, P] ids; `reference` plain generate's new tokens; `divergence` as `first_divergence` found it.
    """
    text = torch.tensor([list(reference[: divergence.position])], dtype=prompt.dtype, device=prompt.device)
    text = torch.cat([prompt, text], dim=1)
    if tree_support(model) is not None or text.shape[1] < 2:  # no tree, or no text before the root to cache
        return divergence
    readings, draw = [], torch.Generator().manual_seed(0)
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    vocab, argument = model.get_input_embeddings().num_embeddings, cache_argument(model) or "past_key_values"
    head = text.shape[1] - 1
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(text[:, :-1], **{argument: cache}, use_cache=True)  # once: each tree is dropped again after it
        for k in company:
            tree = TokenTree.rooted_at(int(text[0, -1]))
            for token in torch.randint(0, vocab, (k,), generator=draw).tolist():
                tree.add(0, token, role="probe")  # never fused: k nodes
            packed = pack(tree, head, attention, model.dtype, text.device)
            inputs = {"attention_mask": packed.attention_mask, "position_ids": packed.position_ids, argument: cache}
            logits = model(input_ids=packed.input_ids, use_cache=True, **inputs).logits[0, 0]
            keep_accepted(cache, head, [])
            found = first_divergence([divergence.reference_token], [divergence.token], [logits], resolution(model))
            assert found is not None  # the two tokens differ
            readings.append(found)
    return replace(min(readings, key=lambda found: found.ulps), position=divergence.position)


READINGS = {"one forward": judged_by_one_forward, "in company": judged_in_company}
"""The readings after generate's own logits, in the order `tie_reading` tries them."""


def tie_reading(
    model: torch.nn.Module, prompt: torch.Tensor, reference: Sequence[int], divergence: Divergence
) -> str | None:
    """The first reading that calls a first difference a tie: "generate" (its own logits), "one forward"
    (`judged_by_one_forward`) or "in company" (`judged_in_company`); None where none does.

    `prompt` [1, P] ids; `reference` plain generate's new tokens; `divergence` as `first_divergence` found it."""
    if divergence.is_tie:
        return "generate"
    ties = (name for name, judged in READINGS.items() if judged(model, prompt, reference, divergence).is_tie)
    return next(ties, None)
