"""Random cases on the tiny test models, each row judged against plain generate (greedy, in ulps) or against its
own seed's undrafted text (sampled): what `benchmarks/random_cases.py` searches for a time budget and
`tests/equality/test_random_cases.py` runs for a fixed few.

Example:
    >>> case = draw_case(random.Random(0))
    >>> sorted(case)[:4]
    ['attention', 'family', 'length', 'method']
"""

from __future__ import annotations

import math
import random

import torch
from transformers import LogitsProcessorList

import forerun
from forerun import GenerationRequest
from forerun.config import DraftModelConfig
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.exactness import first_divergence, tie_reading
from forerun.penalties import OccurrencePenalty
from forerun.structured import Grammars

from tiny_models import FAMILIES, NO_SDPA, STATEFUL_FAMILIES, VOCAB, char_tokenizer, prompts, tiny_model

METHODS = ("plain", "prompt_lookup", "trie", "jacobi", "prompt_lookup+trie", "auto", "draft_model")
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}
FORMATS = (
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "record", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
        "required": ["a", "n"], "additionalProperties": False}}},
    {"type": "json_schema", "json_schema": {"name": "list", "schema": {
        "type": "array", "items": {"enum": ["ab", "c", "Zz"]}, "maxItems": 4}}},
)  # fmt: skip
"""A case's response formats (`forerun.structured`; the tiny models read `tiny_models.char_tokenizer`'s tokens)."""
END = 2
"""The end-of-text id a formatted case ends at unless it draws its own (`COMMON`'s eos)."""
STATE_GAP = 1e-4
"""Most a greedy fp32 hybrid row's logprobs may stand from generate's own (`judge`): on the tiny hybrids a state
slightly wrong can leave the text as it was (windows cut back by the first row's count moved a tiny LFM2's logprobs
by 3.5e-4 and no token: `test_batched_chains.py`'s control), while rounding moves them by ~1e-6."""


def draw_case(
    rng: random.Random,
    dtypes: tuple[str, ...] = ("fp32",),
    follow_ups: bool = False,
    stops: bool = False,
    families: tuple[str, ...] = tuple(sorted(FAMILIES)),
    drafts: tuple[str, ...] | None = None,
    predictions: bool = False,
    penalties: bool = False,
    formats: bool = False,
) -> dict:
    """One random case's settings (JSON-able, so a reported case can be run again with `--case`). With more than
    one of `dtypes` ("fp32", "bf16", "int4": 4-bit weights, bf16 activations) each case draws one, with
    `follow_ups` whether a second turn follows (`run_case`), and with `stops` where an end-of-text token falls (half
    the cases: `end_of_text`; a batch's rows then end at different steps), all last: the draws before stay those
    of fp32 alone. A low-precision case decodes greedily. `families`: the targets' families drawn among
    (`tiny_models.FAMILIES`, or with `MORE_FAMILIES` or `STATEFUL_FAMILIES` too); `drafts`: the draft models'
    (default: the same). With `predictions`, half the greedy cases give each row a prediction (`predict_every`:
    generate's own text with every k-th token wrong): drafts that are accepted in part, step after step, which
    random texts rarely give (a hybrid's chains put back or cut back). With `penalties`, half the fp32 cases decode
    under OpenAI's frequency and presence penalties (`forerun.penalties`), each drawn in [-2, 2]. With `formats`,
    half the fp32 cases answer to one of `FORMATS` (a JSON answer ends at an end-of-text token: `END` where the case
    draws none)."""
    case = {"family": rng.choice(families), "attention": rng.choice(["sdpa", "eager"]),
            "method": rng.choice(METHODS), "static": rng.random() < 0.5, "rows": rng.choice([1, 1, 2, 3]),
            "new": rng.choice([8, 20, 33]), "length": rng.choice([3, 10, 24, 40]),
            "prompt_seed": rng.randrange(1000), "sampled": rng.random() < 0.3}  # fmt: skip
    if case["family"] in NO_SDPA:
        case["attention"] = "eager"
    if case["method"] == "draft_model":
        case |= {"draft": rng.choice(families if drafts is None else drafts), "slots": rng.random() < 0.5}
    if len(dtypes) > 1 and (dtype := rng.choice(dtypes)) != "fp32":
        case |= {"dtype": dtype, "sampled": False}  # a seed's text is judged exactly: fp32 only
    if follow_ups:
        case["follow"] = rng.random() < 0.5
    if stops and rng.random() < 0.5:
        case["eos_at"] = rng.randrange(case["new"])  # the end-of-text token: the one generate writes there (row 0)
    if predictions and not case["sampled"] and rng.random() < 0.5:
        case["predict_every"] = rng.choice([2, 3, 5, 8, 1000])
    if penalties and "dtype" not in case and rng.random() < 0.5:  # fp32: low precision's tie readings read raw logits
        case["penalties"] = [round(rng.uniform(-2, 2), 2), round(rng.uniform(-2, 2), 2)]
    if formats and "dtype" not in case and rng.random() < 0.5:
        case["format"] = rng.randrange(len(FORMATS))
        if "eos_at" not in case:
            case["eos"] = END
    return case


def in_dtype(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """`model` (fp32) in `dtype`: bf16, or int4 weights with bf16 activations (`forerun.base.weights`)."""
    if dtype == "fp32":
        return model
    model = model.to(torch.bfloat16)
    if dtype == "int4":
        from forerun.base.weights import quantize_weights

        quantize_weights(model, "int4")
    return model


def decoder_for(case: dict, target: torch.nn.Module) -> forerun.Decoder:
    tokenizer = char_tokenizer() if "format" in case else None  # llguidance reads the tokens of a format's mask
    if case["method"] != "draft_model":
        return forerun.Decoder(target, tokenizer, case["method"], static_cache=case["static"])
    draft = tiny_model(case["draft"], "eager" if case["draft"] in NO_SDPA else "sdpa", 1)
    draft = in_dtype(draft, case.get("dtype", "fp32"))
    drafter = DraftModelDrafter(DraftModelConfig(confidence=0.0, gamma=3), draft, VOCAB, slots=case["slots"])
    return forerun.Decoder(target, tokenizer, "draft_model", draft_model=draft, drafters=[drafter], gamma=3,
                           static_cache=case["static"])  # fmt: skip


def run_case(case: dict) -> list[dict]:
    """Each row's verdict: identical, or its first difference (greedy: with generate's margin in ulps; in low
    precision also whether it is a tie, `tie_reading`). A case with `follow` then decodes, on the same Decoder,
    each row's text so far with 4 more tokens: a conversation's next turn, whose head the prefix cache serves;
    those rows' verdicts are marked `follow`."""
    target = in_dtype(tiny_model(case["family"], case["attention"], 0), case.get("dtype", "fp32"))
    rows = prompts(case["rows"], length=case["length"], seed=case["prompt_seed"])
    options = dict(SAMPLING, seed=case["prompt_seed"]) if case.get("sampled") else {}
    decoder = decoder_for(case, target)
    if "eos_at" in case and "eos" not in case:
        case = case | {"eos": end_of_text(target, rows[0], case["eos_at"])}
    settings = options | {"eos_token_id": [case["eos"]] if "eos" in case else []} | processed_by(case)
    read_states = case["family"] in STATEFUL_FAMILIES and not options and "dtype" not in case
    if read_states:  # a hybrid's greedy fp32 rows are judged by their logprobs too
        settings["logprobs"] = 1

    def turn(rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
        every = case.get("predict_every")
        ahead = None if every is None else [predicted(target, row, case["new"], case.get("eos"), every) for row in rows]
        results = decode(decoder, rows, case["new"], settings, ahead)
        outputs = [result.sequences for result in results]
        return outputs, [judge(target, prompt, result.sequences, case, options, i,
                               [t.logprob for t in result.logprobs] if read_states else None)
                         for i, (prompt, result) in enumerate(zip(rows, results, strict=True))]  # fmt: skip

    outputs, verdicts = turn(rows)
    if case.get("follow"):
        more = prompts(case["rows"], length=4, seed=case["prompt_seed"] + 1)
        _, second = turn([torch.cat([output, extra], dim=1) for output, extra in zip(outputs, more, strict=True)])
        verdicts += [verdict | {"follow": True} for verdict in second]
    return verdicts


def plain_greedy(target: torch.nn.Module, prompt: torch.Tensor, new: int, eos: int | None = None, **extra):
    """`target.generate`, greedy, reading every prompt token as text: a second turn's prompt may hold a token equal
    to the pad id, which generate masks out unless told."""
    return target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                           eos_token_id=eos, pad_token_id=0, **extra)  # fmt: skip


def end_of_text(target: torch.nn.Module, prompt: torch.Tensor, position: int) -> int:
    """The token plain greedy generate writes at new-token `position` after `prompt`: as the case's end-of-text
    token, row 0 ends there or sooner, and the other rows wherever they write it."""
    return int(plain_greedy(target, prompt, position + 1)[0, -1])


def predicted(target: torch.nn.Module, prompt: torch.Tensor, new: int, eos: int | None, every: int) -> tuple[int, ...]:
    """Plain greedy generate's new tokens after `prompt`, every `every`-th of them replaced by another token."""
    text = plain_greedy(target, prompt, new, eos)[0, prompt.shape[1] :].tolist()
    return tuple(t if i % every != every - 1 else (t + 1) % VOCAB for i, t in enumerate(text))


def processed_by(case: dict) -> dict:
    """The case's frequency and presence penalties and its response format as request settings ({}: none)."""
    settings = {}
    if "penalties" in case:
        settings |= dict(zip(("frequency_penalty", "presence_penalty"), case["penalties"], strict=True))
    if "format" in case:
        settings["response_format"] = FORMATS[case["format"]]
    return settings


def caller_processors(case: dict, start: int) -> list:
    """The case's processors as plain generate takes them from a caller (forerun's own: the penalties, then the
    format's mask), for a prompt of `start` tokens."""
    processors = []
    if "penalties" in case:
        processors.append(OccurrencePenalty(*case["penalties"], prompt_length=start))
    if "format" in case:
        grammars = Grammars(char_tokenizer(), VOCAB, END)
        processors.append(grammars.constraint(FORMATS[case["format"]], start, frozenset({case["eos"]})))
    return processors


def decode(
    decoder: forerun.Decoder, rows: list[torch.Tensor], new: int, options: dict, ahead: list | None = None
) -> list:
    """Each row's result (its `sequences`: the prompt and new tokens [1, P + new], ending at its end-of-text token,
    if any), the rows decoded as one batch (a single row alone); `ahead`: each row's prediction."""
    if ahead is not None:
        requests = [GenerationRequest.of(row, new, prediction=p, **options) for row, p in zip(rows, ahead, strict=True)]
        return [decoder.generate(requests[0])] if len(rows) == 1 else list(decoder.generate(requests))
    if len(rows) == 1:
        return [decoder.generate(rows[0], new, **options)]
    return list(decoder.generate(rows, new, **options))


def judge(
    target: torch.nn.Module,
    prompt: torch.Tensor,
    output: torch.Tensor,
    case: dict,
    options: dict,
    i: int,
    logprobs: list[float] | None = None,
) -> dict:
    """Row `i`'s verdict on its `output`: against the row alone, undrafted, with its own seed (sampled), or plain
    generate (greedy). Where the case has an end-of-text token, both texts must end at it, and at the same place.
    `logprobs` (the row's, greedy): a text equal to generate's whose logprobs stand more than `STATE_GAP` from
    generate's differs too (`logprob_gap`, at its first such position)."""
    start, text, new = prompt.shape[1], output[0, prompt.shape[1] :].tolist(), case["new"]
    eos = case.get("eos")
    if options:  # the row alone, undrafted, with its own seed
        own = options | {"seed": options["seed"] + i, "eos_token_id": [] if eos is None else [eos]} | processed_by(case)
        tokenizer = char_tokenizer() if "format" in case else None
        alone = forerun.Decoder(target, tokenizer, "plain").generate(prompt, new, **own)
        expected = alone.new_tokens
        differs = next((k for k, (a, b) in enumerate(zip(expected, text, strict=False)) if a != b), None)
        if differs is None and len(expected) != len(text):
            differs = min(len(expected), len(text))  # one ended where the other went on
        return {"identical": True} if differs is None else {"identical": False, "position": differs}
    extra = {}
    if processors := caller_processors(case, start):  # forerun's processors, given to plain generate as a caller's
        extra["logits_processor"] = LogitsProcessorList(processors)
    reference = plain_greedy(target, prompt, new, eos, output_logits=True, output_scores=bool(extra),
                             return_dict_in_generate=True, **extra)  # fmt: skip
    expected = reference.sequences[0, start:].tolist()
    judged = reference.scores if extra else reference.logits  # the scores generate chose from
    found = first_divergence(expected, text, [scores[0] for scores in judged], target.dtype)
    if found is None and len(expected) != len(text):  # the same tokens, but one ended early: no rounding does that
        return {"identical": False, "position": min(len(expected), len(text)), "ulps": math.inf, "tie": False}
    if found is None and logprobs is not None:
        steps = zip(reference.logits, text, strict=True)
        read = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in steps]
        gaps = [abs(a - b) for a, b in zip(logprobs, read, strict=True)]
        far = next((k for k, gap in enumerate(gaps) if gap > STATE_GAP), None)
        if far is not None:
            return {"identical": False, "position": far, "ulps": math.inf, "tie": False, "logprob_gap": gaps[far]}
    if found is None:
        return {"identical": True}
    verdict = {"identical": False, "position": found.position, "ulps": round(found.ulps, 2)}
    if target.dtype != torch.float32:
        reading = tie_reading(target, prompt, expected, found)  # forerun.exactness: the first that calls it a tie
        verdict["tie"] = reading is not None
        if reading not in (None, "generate"):
            verdict["tie_reading"] = reading
    return verdict
