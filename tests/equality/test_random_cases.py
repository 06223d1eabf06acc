"""Random cases (family, attention, method, base, rows, lengths, greedy or seeded sampling; fp32, bf16 or 4-bit
weights) on the tiny models: every greedy row is plain generate's text, or first differs at a tie of a few ulps;
every sampled row is its own seed's undrafted text (`random_case`; `benchmarks/random_cases.py` searches thousands
of them).

fp32 rounds too: a tree's or a padded batch's forward sums in other orders than a 1-token forward, so a near-tie of
generate's two best logits can flip (one found in ~36,000 rows: 3 ulps, docs/exactness.md). A logic error moves
logits by far more: the negative control below shows that a second-choice token is thousands of ulps from a tie.
"""

from __future__ import annotations

import random

import pytest
import torch
from random_case import draw_case, in_dtype, run_case

from tiny_models import FAMILIES, STATEFUL_FAMILIES, prompts, tiny_model

FP32_TIE_ULPS = 4.0
"""Most ulps between generate's two logits for a first difference to count as rounding in fp32 (the largest found
in the searches: 3)."""
FLIPPED = {"family": "mixtral", "attention": "eager", "method": "draft_model", "static": False, "rows": 2, "new": 33,
           "length": 3, "prompt_seed": 335, "draft": "phi3", "slots": False}  # fmt: skip
"""The one case the searches found differing (on an AVX-512 EPYC): row 0 takes generate's second token at 3 ulps."""
ROUTER_TIE = {"family": "mixtral", "attention": "sdpa", "method": "prompt_lookup", "static": False, "rows": 1,
              "new": 20, "length": 10, "prompt_seed": 388, "sampled": False, "dtype": "int4", "follow": True,
              "eos_at": 6}  # fmt: skip
"""A case found on an AVX2 EPYC: its second turn takes a token 11 ulps below generate's. The token before it is
routed where layer 0's router scores its second and third experts exactly alike; fed as a tree's root beside 3 or
7 other nodes (`forerun.exactness.judged_in_company`), the model itself writes forerun's token over generate's own
text."""
ROUTED = frozenset({"mixtral"})
"""Families whose tokens go to experts chosen by a router: in low precision a router's near-tie can go the other way
under another forward's rounding, and another expert moves the output logits past a tie (5 ulps, once in ~33,000
low-precision rows of the searches; docs/exactness.md). Other machines round other near-ties."""
ROUTED_ULPS = 8.0


def cases(
    seed: int,
    count: int,
    dtypes: tuple[str, ...] = ("fp32",),
    follow_ups: bool = False,
    stops: bool = False,
    stateful: bool = False,
    penalties: bool = False,
    formats: bool = False,
) -> list[dict]:
    """`stateful`: targets among the hybrids too (`STATEFUL_FAMILIES`), drafts among the families without states,
    and half the greedy cases predicted (`draw_case`'s `predictions`); `penalties`: half the fp32 cases under
    OpenAI's frequency and presence penalties; `formats`: half the fp32 cases answering JSON (`FORMATS`)."""
    rng, families = random.Random(seed), tuple(sorted(FAMILIES))
    targets = tuple(sorted({*families, *STATEFUL_FAMILIES})) if stateful else families
    return [
        draw_case(rng, dtypes, follow_ups, stops, targets, families, stateful, penalties, formats) for _ in range(count)
    ]


def check(case: dict) -> None:
    for row, verdict in enumerate(run_case(case)):
        if verdict["identical"]:
            continue
        assert not case.get("sampled"), (case, row, verdict)  # a seed fixes a sampled text exactly
        if "dtype" in case:  # bf16 or 4-bit weights: a first difference is a tie (forerun.exactness)
            routed = case["family"] in ROUTED and verdict["ulps"] <= ROUTED_ULPS
            assert verdict["tie"] or routed, (case, row, verdict)
        else:
            assert verdict["ulps"] <= FP32_TIE_ULPS, (case, row, verdict)


@pytest.mark.parametrize("seed", range(4))
def test_random_cases_keep_generates_text(seed):
    for case in cases(2026 + seed, 15):
        check(case)


@pytest.mark.parametrize("seed", range(2))
def test_random_low_precision_cases_differ_from_generate_only_at_ties(seed):
    """bf16 and 4-bit weights (bf16 activations): every first difference from plain generate of the same model is a
    tie. Falcon is among the draws (its linear layers stay dense under quantization, its output matrix does not)."""
    for case in cases(4026 + seed, 20, ("bf16", "int4")):
        check(case)


@pytest.mark.parametrize("seed", range(2))
def test_random_second_turns_keep_generates_text(seed):
    """Half the cases decode a second turn on the same Decoder (each row's text so far and 4 more tokens: the prefix
    cache serves its head, on either base, in batches): judged as the first turn, in every dtype."""
    drawn = cases(5026 + seed, 15, ("fp32", "bf16", "int4"), follow_ups=True)
    assert any(case["follow"] for case in drawn)
    for case in drawn:
        check(case)


@pytest.mark.parametrize("seed", range(2))
def test_random_rows_end_where_generate_ends(seed):
    """Half the cases end at an end-of-text token (the one generate writes at a drawn position of row 0), so a
    batch's rows leave it at different steps, on either base, with second turns: every row ends where the
    reference does, with the same text."""
    drawn = cases(6026 + seed, 15, ("fp32", "bf16", "int4"), follow_ups=True, stops=True)
    assert any("eos_at" in case for case in drawn)
    for case in drawn:
        check(case)


@pytest.mark.parametrize("seed", range(2))
def test_random_penalised_cases_keep_generates_text(seed):
    """Half the cases under OpenAI's frequency and presence penalties (`forerun.penalties`, each drawn in [-2, 2]),
    with second turns, rows ending at different steps and predictions: greedy rows write what plain generate writes
    with the processor, sampled rows what the row alone writes with its seed."""
    drawn = cases(9026 + seed, 15, follow_ups=True, stops=True, stateful=True, penalties=True)
    assert sum("penalties" in case for case in drawn) >= 4
    for case in drawn:
        check(case)


@pytest.mark.parametrize("seed", range(2))
def test_random_formatted_cases_keep_generates_text(seed):
    """Half the cases answer JSON (`random_case.FORMATS`: any object, or one of two schemas), beside penalties,
    second turns, rows ending at different steps and predictions, hybrids among the targets: greedy rows write what
    plain generate writes with the mask, sampled rows what the row alone writes with its seed."""
    drawn = cases(7026 + seed, 15, follow_ups=True, stops=True, stateful=True, penalties=True, formats=True)
    assert sum("format" in case for case in drawn) >= 4
    for case in drawn:
        check(case)


@pytest.mark.parametrize("seed", range(2))
def test_random_hybrid_cases_keep_generates_text(seed):
    """Targets among the hybrids too (recurrent or convolution states: chains a step, one token a row beside others
    in a batch, LFM2's rows drafting together, the static base falling back to the growing cache), in every dtype,
    with second turns, rows ending at different steps and predictions wrong every few tokens (chains accepted in
    part): judged as every other case, a hybrid's greedy fp32 rows by their logprobs too (`STATE_GAP`)."""
    drawn = cases(8026 + seed, 20, ("fp32", "bf16", "int4"), follow_ups=True, stops=True, stateful=True)
    hybrids = [case for case in drawn if case["family"] in STATEFUL_FAMILIES]
    assert len(hybrids) >= 5 and any("predict_every" in case and "dtype" not in case for case in hybrids)
    for case in drawn:
        check(case)


def test_negative_control_a_row_that_ends_early_is_caught():
    """A row cut one token short of generate's text (a row that left its batch a step early) is caught: a difference
    no rounding explains, judged beyond any tie."""
    from random_case import judge, plain_greedy

    case = {"family": "llama", "attention": "sdpa", "new": 8, "rows": 1}
    model, prompt = tiny_model("llama", "sdpa", 0), prompts(1, length=10, seed=3)[0]
    full = plain_greedy(model, prompt, 8)
    assert judge(model, prompt, full, case, {}, 0) == {"identical": True}
    short = judge(model, prompt, full[:, :-1], case, {}, 0)
    assert short["position"] == 7 and not short["identical"] and not short["tie"]


def test_negative_control_a_hybrids_logprobs_off_by_a_little_are_caught():
    """A hybrid row whose text is generate's but whose logprobs stand 1e-3 off at one position (a state slightly
    wrong) differs there; its logprobs as generate reads them pass."""
    from random_case import judge, plain_greedy

    case = {"family": "lfm2", "attention": "sdpa", "new": 8, "rows": 1}
    model, prompt = tiny_model("lfm2", "sdpa", 0), prompts(1, length=10, seed=3)[0]
    out = plain_greedy(model, prompt, 8, output_logits=True, return_dict_in_generate=True)
    text = out.sequences[0, prompt.shape[1] :].tolist()
    read = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, text, strict=True)]
    assert judge(model, prompt, out.sequences, case, {}, 0, read) == {"identical": True}
    off = judge(model, prompt, out.sequences, case, {}, 0, [v - 1e-3 * (k == 3) for k, v in enumerate(read)])
    assert off["position"] == 3 and not off["identical"] and off["logprob_gap"] > 9e-4


def test_the_case_found_flipping_is_a_tie():
    check(FLIPPED)


def test_a_routers_tie_is_a_tie_in_company():
    check(ROUTER_TIE)


def test_the_company_reading_reads_generates_own_text():
    """`judged_in_company` reads the root's logits over generate's text: the other nodes, which only they see, change
    the arithmetic and nothing else, so in fp32 each reading's margin is one forward's to rounding (a mask that let
    the root see them would move it by the size of a logit); generate's runner-up stays as far from a tie."""
    from forerun.exactness import first_divergence, judged_by_one_forward, judged_in_company

    model, prompt = tiny_model("llama", "sdpa", 0), prompts(1, length=12, seed=5)[0]
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    text, logits = out.sequences[0, prompt.shape[1] :].tolist(), [step[0] for step in out.logits]
    for position in (2, 5):
        runner_up = int(logits[position].topk(2).indices[1])
        found = first_divergence(text, [*text[:position], runner_up], logits, torch.float32)
        alone = judged_by_one_forward(model, prompt, text, found)
        for company in ((1,), (3,), (7,)):
            read = judged_in_company(model, prompt, text, found, company)
            assert abs(read.margin - alone.margin) <= 1e-5 * max(1.0, abs(alone.margin)), (position, company)
            assert read.ulps > 1000 * FP32_TIE_ULPS, (position, company, read)


def test_negative_control_a_second_choice_is_far_from_a_tie():
    """The ulps bound discriminates on these models: generate's second choice at a random position of each drawn
    text lies thousands of ulps below its first (a logic error's differences are of that size, not 4)."""
    from forerun.exactness import first_divergence

    margins = []
    for case in cases(7, 8):
        model = tiny_model(case["family"], case["attention"], 0)
        prompt = prompts(1, length=case["length"], seed=case["prompt_seed"])[0]
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        text = out.sequences[0, prompt.shape[1] :].tolist()
        second = int(out.logits[3][0].topk(2).indices[1])
        found = first_divergence(text, [*text[:3], second], [logits[0] for logits in out.logits], torch.float32)
        margins.append(found.ulps)
    assert sorted(margins)[len(margins) // 2] > 1000 * FP32_TIE_ULPS, margins


def test_negative_control_a_second_choice_in_low_precision_is_rarely_a_tie():
    """The same control in bf16 and with 4-bit weights, whose ulps are 2^16 times wider: generate's runner-up at each
    of the first 8 positions of the drawn texts lies ~20 ulps below its choice (median), and within the 2-ulp tie
    bound in under a fifth of the positions, so a verifier that took it would fail the cases above."""
    from forerun.exactness import TIE_ULPS, first_divergence

    margins = []
    for case in cases(7, 8, ("bf16", "int4")):
        model = in_dtype(tiny_model(case["family"], case["attention"], 0), case["dtype"])
        prompt = prompts(1, length=case["length"], seed=case["prompt_seed"])[0]
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        text, logits = out.sequences[0, prompt.shape[1] :].tolist(), [step[0] for step in out.logits]
        for position in range(8):
            best = logits[position].topk(2).indices.tolist()
            other = best[1] if best[0] == text[position] else best[0]
            found = first_divergence(text, [*text[:position], other], logits, model.dtype)
            margins.append(0.0 if found is None else found.ulps)
    assert sorted(margins)[len(margins) // 2] > 4 * TIE_ULPS and sum(m <= TIE_ULPS for m in margins) < len(margins) / 5
