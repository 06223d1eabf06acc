"""fp32 exactness under random cases: tiny models of every family, every method, single rows and batches.

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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import forerun  # noqa: E402
from forerun.config import DraftModelConfig  # noqa: E402
from forerun.drafters.draft_model import DraftModelDrafter  # noqa: E402
from forerun.exactness import first_divergence  # noqa: E402

from tiny_models import FAMILIES, VOCAB, prompts, tiny_model  # noqa: E402

METHODS = ("plain", "prompt_lookup", "trie", "jacobi", "prompt_lookup+trie", "auto", "draft_model")
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}


def draw_case(rng: random.Random) -> dict:
    """One random case's settings (JSON-able, so a reported case can be run again with `--case`)."""
    case = {"family": rng.choice(sorted(FAMILIES)), "attention": rng.choice(["sdpa", "eager"]),
            "method": rng.choice(METHODS), "static": rng.random() < 0.5, "rows": rng.choice([1, 1, 2, 3]),
            "new": rng.choice([8, 20, 33]), "length": rng.choice([3, 10, 24, 40]),
            "prompt_seed": rng.randrange(1000), "sampled": rng.random() < 0.3}  # fmt: skip
    if case["method"] == "draft_model":
        case |= {"draft": rng.choice(sorted(FAMILIES)), "slots": rng.random() < 0.5}
    return case


def decoder_for(case: dict, target: torch.nn.Module) -> forerun.Decoder:
    if case["method"] != "draft_model":
        return forerun.Decoder(target, None, case["method"], static_cache=case["static"])
    draft = tiny_model(case["draft"], "sdpa", 1)
    drafter = DraftModelDrafter(DraftModelConfig(confidence=0.0, gamma=3), draft, VOCAB, slots=case["slots"])
    return forerun.Decoder(target, None, "draft_model", draft_model=draft, drafters=[drafter], gamma=3,
                           static_cache=case["static"])  # fmt: skip


def run_case(case: dict) -> list[dict]:
    """Each row's verdict: identical, or its first difference (greedy: with generate's margin in ulps)."""
    target = tiny_model(case["family"], case["attention"], 0)
    rows = prompts(case["rows"], length=case["length"], seed=case["prompt_seed"])
    options = dict(SAMPLING, seed=case["prompt_seed"]) if case.get("sampled") else {}
    decoder = decoder_for(case, target)
    if len(rows) == 1:
        outputs = [decoder.generate(rows[0], case["new"], eos_token_id=[], **options).sequences]
    else:
        outputs = [result.sequences for result in decoder.generate(rows, case["new"], eos_token_id=[], **options)]
    verdicts = []
    for i, (prompt, output) in enumerate(zip(rows, outputs, strict=True)):
        start, text = prompt.shape[1], output[0, prompt.shape[1] :].tolist()
        if options:  # the row alone, undrafted, with its own seed
            own = options | {"seed": options["seed"] + i}
            alone = forerun.Decoder(target, None, "plain").generate(prompt, case["new"], eos_token_id=[], **own)
            expected = alone.sequences[0, start:].tolist()
            differs = next((k for k, (a, b) in enumerate(zip(expected, text, strict=True)) if a != b), None)
            verdicts.append({"identical": True} if differs is None else {"identical": False, "position": differs})
            continue
        reference = target.generate(prompt, max_new_tokens=case["new"], do_sample=False, eos_token_id=None,
                                    pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        found = first_divergence(reference.sequences[0, start:].tolist(), text,
                                 [logits[0] for logits in reference.logits], torch.float32)  # fmt: skip
        verdicts.append({"identical": True} if found is None else
                        {"identical": False, "position": found.position, "ulps": round(found.ulps, 2)})  # fmt: skip
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--case", type=json.loads, help="run this one case (a reported case's JSON) and print it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.case is not None:
        print(json.dumps({"case": args.case, "rows": run_case(args.case)}))
        return
    rng, deadline = random.Random(args.seed), time.monotonic() + args.budget_s
    cases, rows, sampled, differences, failures = 0, 0, 0, [], []
    while time.monotonic() < deadline:
        case = draw_case(rng)
        try:
            verdicts = run_case(case)
        except ValueError as error:  # a family that has no such attention implementation
            if "attention implementation" in str(error):
                continue
            failures.append({"case": case, "error": str(error)[:300]})
            continue
        cases, rows, sampled = cases + 1, rows + len(verdicts), sampled + bool(case["sampled"])
        for row, verdict in enumerate(verdicts):
            if not verdict["identical"]:
                differences.append({"case": case, "row": row} | verdict)
                print(json.dumps(differences[-1]), flush=True)
    summary = {"cases": cases, "rows": rows, "differences": differences, "failures": failures,
               "sampled_cases": sampled, "largest_ulps": max((d.get("ulps", 0) for d in differences), default=None),
               "seed": args.seed,
               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "differences"}))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
