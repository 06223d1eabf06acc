"""Random cases on the tiny test models, each row judged against plain generate (greedy, in ulps) or against its
own seed's undrafted text (sampled): what `benchmarks/random_cases.py` searches for a time budget and
`tests/equality/test_random_cases.py` runs for a fixed few.

Example:
    >>> case = draw_case(random.Random(0))
    >>> sorted(case)[:4]
    ['attention', 'family', 'length', 'method']
"""

from __future__ import annotations

import random

import torch

import forerun
from forerun.config import DraftModelConfig
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.exactness import first_divergence

from tiny_models import FAMILIES, NO_SDPA, VOCAB, prompts, tiny_model

METHODS = ("plain", "prompt_lookup", "trie", "jacobi", "prompt_lookup+trie", "auto", "draft_model")
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}


def draw_case(rng: random.Random) -> dict:
    """One random case's settings (JSON-able, so a reported case can be run again with `--case`)."""
    case = {"family": rng.choice(sorted(FAMILIES)), "attention": rng.choice(["sdpa", "eager"]),
            "method": rng.choice(METHODS), "static": rng.random() < 0.5, "rows": rng.choice([1, 1, 2, 3]),
            "new": rng.choice([8, 20, 33]), "length": rng.choice([3, 10, 24, 40]),
            "prompt_seed": rng.randrange(1000), "sampled": rng.random() < 0.3}  # fmt: skip
    if case["family"] in NO_SDPA:
        case["attention"] = "eager"
    if case["method"] == "draft_model":
        case |= {"draft": rng.choice(sorted(FAMILIES)), "slots": rng.random() < 0.5}
    return case


def decoder_for(case: dict, target: torch.nn.Module) -> forerun.Decoder:
    if case["method"] != "draft_model":
        return forerun.Decoder(target, None, case["method"], static_cache=case["static"])
    draft = tiny_model(case["draft"], "eager" if case["draft"] in NO_SDPA else "sdpa", 1)
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
