"""The GPU check's `smoke` section: on a card's captured graphs, forerun's greedy output is plain generate's.

Tiny random models (fp32, `tests/tiny_models.py`), so that every difference is a defect, not a rounding tie:
- single rows: 4 families x eager/sdpa x `plain`, `prompt_lookup`, `auto`, `eagle3` (a random head reading the
  layer the graph hands it, drafting every step) against `model.generate`, token for token;
- batches (`smoke_rows`): three ragged rows on the static base's places, answers of different lengths (rows leave
  at different steps: a lone row, places settled), each row against `model.generate` of that row alone; once
  plain, once with a repetition penalty, once with OpenAI's frequency and presence penalties, once answering JSON
  (`response_format`: llguidance's mask over `tiny_models.char_tokenizer`; greedy rows with processors choose
  every node at once on a card, a level at a time). This
  is the card's one copy a step (`forerun.host_copy`) and its pinned inputs refilled after an event, which a CPU
  runs but cannot race.

Usage (`gpu_check.py smoke` beside the other sections, or alone; a CPU runs it too, eagerly, in ~4 minutes):
    python benchmarks/gpu_check.py smoke --out $OUT/gpu.jsonl
    python benchmarks/gpu_smoke.py --out smoke.jsonl   # exit status 1 when a row differs
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from forerun import Decoder
from forerun.costmodel import LatencyCurve
from forerun.penalties import OccurrencePenalty
from forerun.request import GenerationRequest
from forerun.structured import Grammars

ROWS = ((24, 40), (9, 12), (17, 28))
"""Each batch row's prompt length and answer length: the second row leaves first, the first row last."""
SETTINGS = (
    {},
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"response_format": {"type": "json_object"}},
)
"""Each batch's processors: none, transformers' repetition penalty, OpenAI's penalties (`forerun.penalties`), a
response format's mask (`forerun.structured`)."""
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.1, 1.3, 1.7, 2.6))
"""A flat-then-rising curve, given rather than measured (each decoder would time its own): trees pay."""


def smoke(log, device: torch.device) -> None:
    """Single rows, then batches (module docstring); each (family, attention, method) logged with its count equal."""
    from eagle3_heads import random_head
    from tiny_models import prompts, tiny_model

    for family in ("llama", "qwen3", "gemma", "gpt2"):
        for attention in ("sdpa", "eager"):
            model = tiny_model(family, attention).to(device)
            for method in ("plain", "prompt_lookup", "auto", "eagle3"):
                head = random_head(model, aux=(0, 0, 0)).to(device) if method == "eagle3" else None
                # a random head never pays: the switch would keep it out; here it drafts every step
                decoder = Decoder(model, None, method, latency_cache=None, static_cache=True, draft_head=head,
                                  adaptive=False if head is not None else None)  # fmt: skip
                same = drafted = 0
                for prompt in prompts(3, 24, seed=1):
                    prompt = prompt.to(device)
                    expected = model.generate(prompt, max_new_tokens=48, do_sample=False, pad_token_id=0)
                    result = decoder.generate(prompt, 48)
                    same += torch.equal(result.sequences, expected.cpu())
                    drafted += result.stats.candidates
                base = decoder.base
                captured = base is not None and any(step.graph is not None for step in base.steps.values())
                error = base.capture_error if base is not None else "no static base"
                log("smoke", family=family, attention=attention, method=method, identical=f"{same}/3",
                    drafted=drafted, captured=captured, capture_error=error,
                    head_graphs=head_graphs(decoder))  # fmt: skip
            if attention == "sdpa":
                smoke_rows(log, model, family, device)


def smoke_rows(log, model: torch.nn.Module, family: str, device: torch.device) -> None:
    """Three ragged rows of `ROWS` through `generate([...])` on the static base's places, per method and
    processor setting, each row against `model.generate` of it alone (greedy: equal token for token in fp32)."""
    from tiny_models import char_tokenizer, prompts

    texts = [prompts(1, length, seed=5 + i)[0][0] for i, (length, _) in enumerate(ROWS)]  # [length] each
    tokenizer = char_tokenizer()  # the tiny models' 96 tokens, as llguidance reads them
    for setting in SETTINGS:
        expected = [
            model.generate(t[None].to(device), max_new_tokens=n, do_sample=False, pad_token_id=0,
                           **reference_settings(setting, len(t), tokenizer))[0].cpu()[len(t) :].tolist()
            for t, (_, n) in zip(texts, ROWS, strict=True)
        ]  # fmt: skip
        for method in ("plain", "prompt_lookup", "auto"):
            decoder = Decoder(model, tokenizer, method, latency=CURVE, static_cache=True)
            requests = [GenerationRequest.of(t.tolist(), n, **setting) for t, (_, n) in zip(texts, ROWS, strict=True)]
            results = decoder.generate(requests)
            same = sum(r.new_tokens == e for r, e in zip(results, expected, strict=True))
            base = decoder.base
            rows = None if base is None else base.siblings.get(len(ROWS))
            graphs = None if rows is None else sum(step.graph is not None for step in rows.steps.values())
            log("smoke_rows", family=family, method=method, processors=sorted(setting),
                identical=f"{same}/{len(ROWS)}", drafted=sum(r.stats.candidates for r in results),
                places=rows is not None, graphs=graphs)  # fmt: skip


def reference_settings(setting: dict, prompt_length: int, tokenizer) -> dict:
    """`model.generate`'s settings for a request's: OpenAI's penalties and a response format's mask as forerun's
    processors, given as a caller's (the model's EOS, id 2, ends a JSON answer)."""
    if "frequency_penalty" in setting:
        penalty = OccurrencePenalty(setting["frequency_penalty"], setting["presence_penalty"], prompt_length)
        return {"logits_processor": LogitsProcessorList([penalty])}
    if "response_format" in setting:
        grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
        mask = grammars.constraint(setting["response_format"], prompt_length, frozenset({tokenizer.eos_token_id}))
        return {"logits_processor": LogitsProcessorList([mask])}
    return setting


def head_graphs(decoder) -> list[list] | None:
    """The (rows, kind) of every head forward a decoder's EAGLE-3 drafter captured (None: it drafts with no head,
    [] where its forwards run eagerly)."""
    runners = [d.runner for d in decoder.drafters if hasattr(d, "runner")]
    return [[rows, "read" if project else "level"] for rows, project, _ in runners[0].graphs] if runners else None


def main() -> int:
    """Runs the smoke section alone on the card (or the CPU); 1 when any row or sequence differs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_smoke.jsonl"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gpu_check import DEVICE, Log

    records: list[dict] = []
    log = Log(args.out, deadline=math.inf)

    def kept(section: str, **record: object) -> None:
        records.append(record)
        log(section, **record)

    smoke(kept, DEVICE)
    differing = [r for r in records if len(set(str(r["identical"]).split("/"))) != 1]
    print(f"{len(records) - len(differing)}/{len(records)} checks identical on {DEVICE}")
    return 1 if differing or not records else 0


if __name__ == "__main__":
    raise SystemExit(main())
