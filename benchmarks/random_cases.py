"""Exactness under random cases: tiny models of every family, every method, single rows and batches.

Each case draws a family, an attention implementation, a method (a draft model of another family on slots or a
growing cache among them), the growing or the static base, 1-3 rows, a prompt length, a number of new tokens and
greedy or sampled decoding, decodes with a fresh Decoder and compares every row:
- greedy, with plain `model.generate` of that row alone. A first difference is judged on generate's own logits
  (`forerun.exactness`): its margin in units in the last place. A logic error (a wrong mask, position or commit)
  moves logits by far more than rounding does, so its differences are not ties; a verification forward over a
  tree or a padded batch rounds differently from a 1-token forward, which can flip only a near-tie of a few ulps.
- sampled (temperature 0.8, top-p 0.9, a seed; row i of a batch seeded seed + i), with forerun's undrafted
  decoding of that row alone and its seed: a seed fixes the text whatever drafts it (docs/exactness.md), so a
  difference is reported with its position (a draw at another position's noise, a wrong walk).
- in bf16 or with 4-bit weights (`--dtypes fp32,bf16,int4`: each case draws one; those decode greedily), with
  plain generate of the same model: a first difference must be a tie (`forerun.exactness`: within 2 ulps on
  generate's logits, on one forward's, or on a verification forward's, where the token before it is a tree's root
  beside other nodes); `not at a tie` counts those that are not, `a tie only in company` those only the last
  reading calls one (a mixture of experts' router tie, say).
- with `--follow-ups`, half the cases then decode each row's text so far with 4 more tokens on the same Decoder
  (a conversation's next turn: the prefix cache serves its head), judged alike.
- with `--stops`, half the cases end at an end-of-text token (a batch's rows at different steps, leaving it one by
  one): each row must end where the reference ends.
- with `--more-families`, targets and drafts are drawn among `tiny_models.MORE_FAMILIES` too.
- with `--stateful`, targets are drawn among `tiny_models.STATEFUL_FAMILIES` too (hybrids with recurrent or
  convolution states: chains, one token a row in a batch, LFM2's rows drafting together; the static base falls back
  to the growing cache for them); drafts stay among the families without states; a hybrid's greedy fp32 rows are
  judged by their logprobs too (within `random_case.STATE_GAP` of generate's).
- with `--predictions`, half the greedy cases give each row a prediction: generate's own text with every k-th token
  wrong (drafts accepted in part, step after step).
- with `--penalties`, half the fp32 cases decode under OpenAI's frequency and presence penalties, each drawn in
  [-2, 2] (`forerun.penalties`); the greedy reference is plain generate with that processor.
- with `--formats`, half the fp32 cases answer to a response format (JSON, or one of two schemas:
  `random_case.FORMATS`, over `tiny_models.char_tokenizer`); the greedy reference is plain generate with the mask.

Usage:
    .venv/bin/python benchmarks/random_cases.py --seed 0 --budget-s 600 --out benchmarks/results/random-cases.json

Reproduce a reported case with `--case '<its "case" object as JSON>'`.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from random_case import draw_case, run_case  # noqa: E402

from tiny_models import FAMILIES, MORE_FAMILIES, STATEFUL_FAMILIES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--case", type=json.loads, help="run this one case (a reported case's JSON) and print it")
    parser.add_argument("--dtypes", default="fp32", help="drawn per case among these: fp32,bf16,int4")
    parser.add_argument("--follow-ups", action="store_true", help="half the cases decode a second turn too")
    parser.add_argument("--stops", action="store_true", help="half the cases stop at an end-of-text token")
    parser.add_argument("--more-families", action="store_true", help="draw among tiny_models.MORE_FAMILIES too")
    parser.add_argument("--stateful", action="store_true", help="targets among tiny_models.STATEFUL_FAMILIES too")
    parser.add_argument("--predictions", action="store_true", help="half the greedy cases predicted, every k-th wrong")
    parser.add_argument("--penalties", action="store_true", help="half the fp32 cases penalised (OpenAI)")
    parser.add_argument("--formats", action="store_true", help="half the fp32 cases answer JSON (response_format)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.case is not None:
        print(json.dumps({"case": args.case, "rows": run_case(args.case)}))
        return
    rng, deadline = random.Random(args.seed), time.monotonic() + args.budget_s
    drafts = tuple(sorted(FAMILIES | MORE_FAMILIES if args.more_families else FAMILIES))
    families = tuple(sorted({*drafts, *STATEFUL_FAMILIES})) if args.stateful else drafts
    cases, rows, sampled, differences, failures = 0, 0, 0, [], []
    tally: Counter[str] = Counter()  # per dtype: cases, rows, rows differing, of them not at a tie
    while time.monotonic() < deadline:
        dtypes = tuple(args.dtypes.split(","))
        case = draw_case(rng, dtypes, args.follow_ups, args.stops, families, drafts, args.predictions, args.penalties,
                         args.formats)  # fmt: skip
        try:
            verdicts = run_case(case)
        except Exception as error:  # noqa: BLE001 - recorded, and the search goes on to find the others
            failures.append({"case": case, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(json.dumps(failures[-1]), flush=True)
            continue
        cases, rows, sampled = cases + 1, rows + len(verdicts), sampled + bool(case["sampled"])
        dtype = case.get("dtype", "fp32")
        tally.update({f"{dtype} cases": 1, f"{dtype} rows": len(verdicts),
                      f"{dtype} second turns": case.get("follow", 0)})  # fmt: skip
        for row, verdict in enumerate(verdicts):
            if not verdict["identical"]:
                differences.append({"case": case, "row": row} | verdict)
                in_company = verdict.get("tie_reading") == "in company"
                tally.update({f"{dtype} rows differing": 1, f"{dtype} not at a tie": not verdict.get("tie", False),
                              f"{dtype} a tie only in company": in_company})  # fmt: skip
                print(json.dumps(differences[-1]), flush=True)
    summary = {"cases": cases, "rows": rows, "by_dtype": dict(sorted(tally.items())), "differences": differences,
               "failures": failures, "sampled_cases": sampled,
               "largest_ulps": max((d.get("ulps", 0) for d in differences), default=None), "seed": args.seed,
               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "differences"}))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
