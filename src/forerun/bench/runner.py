"""Interleaved benchmark runs: for every prompt, every method in turn (A B C A B C ...), after a warm-up.

The reference is plain `model.generate` (label `generate`); each method's output is compared with it token for
token, and speed is the ratio of the two wall times on the same prompt in the same process.

Method specs: `plain`, `prompt_lookup`, `jacobi`, `trie` (forerun), `hf_prompt_lookup` (transformers'
`prompt_lookup_num_tokens=10`), and knobs in brackets: `jacobi[window=7,ngram=5,max_candidates=7]`,
`prompt_lookup[max_tree_nodes=8,draft_len=7]`, `trie[warm=10]` (the trie first learns from the model's own
answers to 10 other prompts of each dataset, disjoint from the timed ones, as PIA's benchmarks use a train split).

Sampled runs (`sampling={"temperature": 0.7, "top_p": 0.9}`) cannot be compared token for token (the methods draw
their randomness differently; their distribution is proven equal by tests/test_sampling.py): `identical` is None
and speed is the ratio of tokens per second, since the lengths differ.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forerun.bench.datasets import BenchPrompt
from forerun.cli import parse_knobs
from forerun.config import METHODS
from forerun.decoder import Decoder
from forerun.drafters.draft_model import needs_draft_model

REFERENCE = "generate"
HF_METHODS = ("hf_prompt_lookup", "hf_assisted")


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    knobs: dict = field(default_factory=dict)
    max_tree_nodes: int | None = None
    warm: int = 0
    """Before timing, let the decoder answer this many other prompts per dataset (a warm trie or pool)."""


def parse_methods(text: str) -> list[MethodSpec]:
    """'plain,jacobi[window=7,ngram=5]' -> specs; raises ValueError naming an unknown method."""
    specs = []
    for label in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text):
        label = label.strip()
        name, _, rest = label.partition("[")
        knobs = parse_knobs([p for p in rest.rstrip("]").split(",") if p]) if rest else {}
        if name not in METHODS and name not in HF_METHODS:
            raise ValueError(f"unknown benchmark method {name!r}; choose from {', '.join(METHODS + HF_METHODS)}")
        nodes = knobs.pop("max_tree_nodes", None)
        warm = knobs.pop("warm", 0)
        specs.append(MethodSpec(label, name, knobs, nodes, warm))
    if not specs:
        raise ValueError("no methods given")
    return specs


@dataclass
class Record:
    """One (prompt, method) run."""

    prompt_id: str
    dataset: str
    method: str
    new_tokens: int
    seconds: float
    identical: bool | None
    """Token-for-token equal to the reference; None for sampled runs."""
    forwards: int | None = None
    tokens_per_forward: float | None = None
    acceptance: float | None = None
    draft_share: float | None = None
    accepted_hist: dict = field(default_factory=dict)
    speedup: float | None = None
    """This run's tokens/s over the reference's, same prompt, same process (greedy: reference s / this run's s)."""


def run_interleaved(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    specs: Sequence[MethodSpec],
    max_new_tokens: int,
    on_step: Callable[[str, str], None] | None = None,
    prepare: Callable[[MethodSpec, Decoder], None] | None = None,
    sampling: dict | None = None,
    seed: int = 0,
    draft_model: torch.nn.Module | None = None,
) -> list[Record]:
    """Run reference + every spec on each prompt in turn; returns one Record per (prompt, method).

    `sampling`: generation settings for sampled runs (e.g. {"temperature": 0.7, "top_p": 0.9}); None = greedy.
    `draft_model`: the small model of methods draft_model and hf_assisted (transformers' assistant_model).
    """
    needing = [s.label for s in specs if s.method == "hf_assisted" or needs_draft_model(s.method, s.knobs)]
    if needing and draft_model is None:
        raise ValueError(f"{', '.join(needing)} need a draft model (forerun bench --draft-model NAME)")
    run = Run(model, max_new_tokens, dict(sampling) if sampling is not None else None, seed, draft_model)
    decoders = {
        s.label: Decoder(
            model,
            tokenizer,
            s.method,
            max_tree_nodes=s.max_tree_nodes,
            draft_model=draft_model if needs_draft_model(s.method, s.knobs) else None,
            **s.knobs,
        )
        for s in specs
        if s.method not in HF_METHODS
    }
    for spec in specs:
        if prepare is not None and spec.label in decoders:
            prepare(spec, decoders[spec.label])
    warm_up(model, tokenizer, decoders, prompts[0], draft_model)
    records = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(model.device)
        reference, ref_seconds = run.hf(ids)
        new = reference.shape[1] - ids.shape[1]
        identical = None if run.sampling is not None else True
        records.append(
            Record(prompt.id, prompt.dataset, REFERENCE, new, ref_seconds, identical, new, 1.0, None, 0.0, {}, 1.0)
        )
        if on_step:
            on_step(prompt.id, REFERENCE)
        for spec in specs:
            records.append(run.one(ids, spec, decoders.get(spec.label), prompt, reference, ref_seconds))
            if on_step:
                on_step(prompt.id, spec.label)
    return records


@dataclass(frozen=True)
class Run:
    """How every method is called in one benchmark run (greedy, or sampled with the same settings)."""

    model: torch.nn.Module
    max_new_tokens: int
    sampling: dict | None
    seed: int
    draft_model: torch.nn.Module | None = None

    def hf(self, ids: torch.Tensor, **extra) -> tuple[torch.Tensor, float]:
        """model.generate (the reference, or with extra arguments such as prompt_lookup_num_tokens); (ids, s)."""
        settings = {"do_sample": False} if self.sampling is None else {"do_sample": True, **self.sampling}
        torch.manual_seed(self.seed)
        synchronize(ids.device)
        started = time.perf_counter()
        out = self.model.generate(ids, max_new_tokens=self.max_new_tokens, **settings, **extra)
        synchronize(ids.device)
        return out.cpu(), time.perf_counter() - started

    def one(self, ids, spec: MethodSpec, decoder: Decoder | None, prompt: BenchPrompt, reference, ref_seconds):
        identical = None
        ref_rate = (reference.shape[1] - ids.shape[1]) / ref_seconds
        if spec.method in HF_METHODS:
            extra = {"prompt_lookup_num_tokens": 10}
            if spec.method == "hf_assisted":
                extra = {"assistant_model": self.draft_model}
            out, seconds = self.hf(ids, **extra)
            new = out.shape[1] - ids.shape[1]
            if self.sampling is None:
                identical = torch.equal(out, reference)
            speedup = new / seconds / ref_rate
            return Record(prompt.id, prompt.dataset, spec.label, new, seconds, identical, speedup=speedup)
        if self.sampling is None:
            result = decoder.generate(ids, self.max_new_tokens)
            identical = torch.equal(result.sequences, reference)
        else:
            result = decoder.generate(ids, self.max_new_tokens, do_sample=True, seed=self.seed, **self.sampling)
        s = result.stats
        return Record(
            prompt.id,
            prompt.dataset,
            spec.label,
            s.new_tokens,
            s.total_seconds,
            identical,
            s.forwards,
            s.tokens_per_forward,
            s.acceptance_rate,
            s.draft_share,
            {str(k): v for k, v in sorted(s.accepted_hist.items())},
            s.new_tokens / s.total_seconds / ref_rate,
        )


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer stops when the tokens exist (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_records(path: Path) -> list[Record]:
    """The records of a results.json (ours, or one written in our format by benchmarks/run_lade.py)."""
    if not path.is_file():
        raise FileNotFoundError(f"records file not found: {path}")
    try:
        rows = json.loads(path.read_text())["records"]
        return [Record(**row) for row in rows]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a benchmark results file ({error})") from None


def mismatch_lines(records: Sequence[Record]) -> list[str]:
    """One line per greedy run whose tokens differ from plain model.generate (sampled runs are not compared)."""
    return [f"{r.method} on {r.prompt_id} differs from model.generate" for r in records if r.identical is False]


def warm_up(model, tokenizer, decoders: dict[str, Decoder], prompt: BenchPrompt, draft_model=None) -> None:
    """One short run of each path, so first-call allocations do not land in the first prompt's timings."""
    ids = tokenizer.apply_chat_template(
        list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].to(model.device)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=10)
    if draft_model is not None:
        model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft_model)
    for decoder in decoders.values():
        decoder.generate(ids, 8)
