"""Interleaved benchmark runs: for every prompt, every method in turn (A B C A B C ...), after a warm-up.

The reference is plain `model.generate` (label `generate`); each method's output is compared with it token for
token, and speed is the ratio of the two wall times on the same prompt in the same process.

Methods: any forerun method expression (`plain`, `prompt_lookup`, `jacobi`, `trie`, `draft_model`, `auto`,
`prompt_lookup+trie`), `hf_prompt_lookup` (transformers' `prompt_lookup_num_tokens=10`), `hf_assisted` (transformers'
`assistant_model=`), `llama_cpp` and `llama_cpp_lookup` (llama.cpp on the same GGUF file, plain and with its prompt
lookup), `generate_bf16` and `generate_fp32` (transformers' generate of the model's dense weights in its own layers;
these four: `forerun.bench.peers`), with knobs in brackets: `jacobi[window=7,ngram=5,max_candidates=7]`,
`prompt_lookup[max_tree_nodes=8,draft_len=7]`, `auto[trie.decoding_length=24]`, `auto[prefix_cache=0]` (no prefix cache:
every prompt prefilled in full, as generate does), `auto[predict=true]` (each prompt's prediction, the `edit` dataset's
original code, passed as OpenAI's predicted output), `trie[warm=10]` (the trie first learns from the model's own answers
to 10 other prompts of each dataset, disjoint from the timed ones, as PIA's benchmarks use a train split),
`auto[adaptive=false]`.

Speed is the ratio of tokens per second against the reference on the same prompt (for greedy fp32 runs, whose
lengths are equal, that is the ratio of wall times).

Low precision (bf16/fp16): a greedy run may leave the reference at a numerical tie (`forerun.exactness`); such a
run has `identical=False` and `tie_ulps` (the reference's logit margin at the first difference, in units in the last
place). Only a difference that is not a tie is a mismatch; one whose margin is more than a tie, but that another
reading of the same text calls one (one forward over it, or the token before it fed as a verification forward
feeds it: `forerun.exactness.tie_reading`), is a tie too, and its record names that reading (`tie_reading`). The row
`generate[batch=2]` is the noise floor: plain generate of the prompt in a left-padded batch of two, against itself
in a batch of one (not timed).

Sampled runs (`sampling={"temperature": 0.7, "top_p": 0.9}`) cannot be compared token for token with plain
generate, which draws its randomness differently (the distribution is proven equal by tests/equality/test_sampling.py):
`identical` is None. Every forerun method runs with the same seed, so in fp32 they all write the same text
(`forerun.noise`) and their speeds compare on one answer; in bf16 up to ties.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forerun.bench.datasets import BenchPrompt
from forerun.bench.methods import HF_METHODS, OTHER_METHODS, BenchMethod
from forerun.bench.peers import DENSE_PEERS, PEER_METHODS, DenseGeneratePeer, LlamaCppPeer
from forerun.bench.records import NOISE_FLOOR, REFERENCE, Record
from forerun.costmodel import LatencyCurve
from forerun.decoder import Decoder
from forerun.exactness import first_divergence, resolution, tie_reading
from forerun.latency import synchronize


def run_interleaved(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    specs: Sequence[BenchMethod],
    max_new_tokens: int,
    on_step: Callable[[str, str], None] | None = None,
    prepare: Callable[[BenchMethod, Decoder], None] | None = None,
    *,
    sampling: dict | None = None,
    seed: int = 0,
    draft_model: torch.nn.Module | None = None,
    latency: LatencyCurve | None = None,
    gguf: str | Path | None = None,
    threads: int = 1,
    draft_head: torch.nn.Module | None = None,
    compile_buckets: bool = False,
    source: str | None = None,
    on_prompt: Callable[[list[Record]], None] | None = None,
) -> list[Record]:
    """Run reference + every spec on each prompt in turn; returns one Record per (prompt, method).

    `on_step(prompt id, label)` after each run; `prepare(spec, decoder)` once per forerun method before anything is
    timed (a warm trie). `sampling`: generation settings for sampled runs (e.g. {"temperature": 0.7, "top_p": 0.9});
    None = greedy. `draft_model`: the small model of methods draft_model and hf_assisted (transformers'
    assistant_model). `latency`: the device's latency curve for the cost model (None: forerun.latency.curve_for).
    `gguf`, `threads`: the model's GGUF file and the thread count, for the llama.cpp methods; `source`: the model's
    name or path, which generate_bf16 and generate_fp32 load again with transformers' own layers.
    `draft_head`: the EAGLE-3 head of method eagle3, which `auto` then drafts with too. `compile_buckets`: a card's
    decoders compile each bucket before capturing it (`EngineConfig.compile_buckets`). `on_prompt(records so far)`
    after each prompt's every run (the CLI keeps them on disk: a crash loses at most the prompt under way).
    """
    needing = [s.label for s in specs if s.needs_draft()]
    if needing and draft_model is None:
        raise ValueError(f"{', '.join(needing)} need a draft model (forerun bench --draft-model NAME)")
    peers = make_peers(specs, gguf, threads, sampling, source)
    run = Run(model, max_new_tokens, dict(sampling) if sampling is not None else None, seed, draft_model, peers)
    decoders = build_decoders(model, tokenizer, specs, latency, draft_model, draft_head, compile_buckets)
    for spec in specs:
        if prepare is not None and spec.label in decoders:
            prepare(spec, decoders[spec.label])
    longest = max(encode(tokenizer, prompt, torch.device("cpu")).shape[1] for prompt in prompts)
    for decoder in decoders.values():  # a card's graphs, every bucket captured before anything is timed
        decoder.warm_up(longest + max_new_tokens)
    warm_up(model, tokenizer, decoders, prompts[0], draft_model, peers)
    return prompt_records(run, tokenizer, prompts, specs, decoders, on_step, on_prompt)


def build_decoders(
    model: torch.nn.Module,
    tokenizer,
    specs: Sequence[BenchMethod],
    latency: LatencyCurve | None,
    draft_model: torch.nn.Module | None,
    draft_head: torch.nn.Module | None,
    compile_buckets: bool,
) -> dict[str, Decoder]:
    """label -> a Decoder for each forerun method of `specs` (the other runtimes are `make_peers`'), each given the
    draft model or head only where its method drafts with one."""
    return {
        s.label: Decoder(
            model,
            tokenizer,
            s.method,
            max_tree_nodes=s.max_tree_nodes,
            adaptive=s.adaptive,
            latency=latency,
            draft_model=draft_model if s.needs_draft() else None,
            draft_head=draft_head if s.reads_head(draft_head is not None) else None,
            prefix_cache=s.prefix_cache,
            compile_buckets=compile_buckets,
            **s.knobs,
        )
        for s in specs
        if s.method not in OTHER_METHODS
    }


def prompt_records(
    run: Run,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    specs: Sequence[BenchMethod],
    decoders: dict[str, Decoder],
    on_step: Callable[[str, str], None] | None,
    on_prompt: Callable[[list[Record]], None] | None = None,
) -> list[Record]:
    """Each prompt in turn: plain generate (the reference), in greedy low precision its noise floor, then every
    method; a conversation's later turns follow plain generate's own earlier answers. `on_prompt(records so far)`
    after each prompt."""
    model = run.model
    histories: dict[str, list[dict]] = {}  # conversation -> its turns so far, with plain generate's answers
    records = []
    for index, prompt in enumerate(prompts):
        ids = encode(tokenizer, prompt, model.device, histories.get(prompt.conversation or "", []))
        reference, ref_seconds = run.hf(ids)
        new = reference.shape[1] - ids.shape[1]
        if prompt.conversation is not None:
            answer = tokenizer.decode(reference[0, ids.shape[1] :], skip_special_tokens=True)
            turns = histories.get(prompt.conversation, [])
            histories[prompt.conversation] = [*turns, *prompt.messages, {"role": "assistant", "content": answer}]
        identical = None if run.sampling is not None else True
        records.append(
            Record(prompt.id, prompt.dataset, REFERENCE, new, ref_seconds, identical, new, 1.0, None, 0.0, {}, 1.0)
        )
        if on_step:
            on_step(prompt.id, REFERENCE)
        if run.sampling is None and not run.exact:
            other = encode(tokenizer, prompts[(index + 1) % len(prompts)], model.device)
            records.append(run.noise_floor(ids, other, prompt, reference))
        for spec in specs:
            records.append(run.one(ids, spec, decoders.get(spec.label), prompt, reference, ref_seconds))
            if on_step:
                on_step(prompt.id, spec.label)
        if on_prompt:
            on_prompt(list(records))
    return records


def encode(tokenizer, prompt: BenchPrompt, device: torch.device, history: Sequence[dict] = ()) -> torch.Tensor:
    """The prompt's chat messages after `history` (a conversation's earlier turns), templated: input_ids [1, L]."""
    return tokenizer.apply_chat_template(
        [*history, *prompt.messages], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].to(device)


@dataclass(frozen=True)
class Run:
    """How every method is called in one benchmark run (greedy, or sampled with the same settings)."""

    model: torch.nn.Module
    max_new_tokens: int
    sampling: dict | None
    seed: int
    draft_model: torch.nn.Module | None = None
    peers: dict = field(default_factory=dict)
    """label -> LlamaCppPeer, for the llama.cpp methods."""
    plain_peer_tokens: dict = field(default_factory=dict)
    """input ids (as a tuple) -> llama.cpp's plain output, which its prompt lookup is checked against."""
    reference_logits: dict = field(default_factory=dict)
    """input ids (as a tuple) -> plain generate's logits per new token, computed once when a run differs."""

    @property
    def exact(self) -> bool:
        """fp32: greedy runs must be token for token identical; lower precision: identical up to ties."""
        return resolution(self.model) == torch.float32

    def judge(self, ids: torch.Tensor, reference: torch.Tensor, out: torch.Tensor) -> dict:
        """A greedy output against the reference, as `Record` fields: `identical`, and in low precision the tie
        margin in ulps at the first difference (`tie_ulps`) and, where that is more than a tie, the other reading
        of the same text that calls it one (`tie_reading`)."""
        if torch.equal(out, reference):
            return {"identical": True}
        if self.exact:
            return {"identical": False}
        key = tuple(ids[0].tolist())
        if key not in self.reference_logits:  # the timed run kept no logits: the same generate again, untimed
            again = self.model.generate(
                ids,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            if not torch.equal(again.sequences.cpu(), reference):
                raise RuntimeError("plain generate is not deterministic on this device; ties cannot be judged")
            self.reference_logits[key] = [row[0].cpu() for row in again.logits]
        start = ids.shape[1]
        expected = reference[0, start:].tolist()
        divergence = first_divergence(
            expected, out[0, start:].tolist(), self.reference_logits[key], resolution(self.model)
        )
        if divergence is None:  # the same tokens, one of them longer
            return {"identical": False, "tie_ulps": 0.0}
        reading = None if divergence.is_tie else tie_reading(self.model, ids, expected, divergence)
        return {"identical": False, "tie_ulps": divergence.ulps, "tie_reading": reading}

    def noise_floor(self, ids: torch.Tensor, other: torch.Tensor, prompt: BenchPrompt, reference) -> Record:
        """Plain generate of `ids` in a left-padded batch of two (beside `other`), judged against batch one."""
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            eos = self.model.generation_config.eos_token_id
            pad = eos if isinstance(eos, int) else eos[0]
        width = max(ids.shape[1], other.shape[1])
        rows = [torch.cat([ids.new_full((1, width - row.shape[1]), pad), row], dim=1) for row in (ids, other)]
        mask = torch.cat(
            [
                torch.cat([row.new_zeros(1, width - t.shape[1]), row.new_ones(1, t.shape[1])], 1)
                for row, t in zip(rows, (ids, other), strict=True)
            ]
        )
        out = self.model.generate(
            torch.cat(rows), attention_mask=mask, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad
        )
        row = torch.cat([ids.cpu(), out[:1, width:].cpu()], dim=1)
        eos = self.model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        new = row[0, ids.shape[1] :].tolist()
        for i, token in enumerate(new):  # the batch pads a finished row: cut it after its EOS
            if token in eos_ids:
                row = row[:, : ids.shape[1] + i + 1]
                break
        verdict = self.judge(ids, reference, row)
        return Record(prompt.id, prompt.dataset, NOISE_FLOOR, row.shape[1] - ids.shape[1], 0.0, **verdict)

    def hf(self, ids: torch.Tensor, **extra) -> tuple[torch.Tensor, float]:
        """model.generate (the reference, or with extra arguments such as prompt_lookup_num_tokens); (ids, s)."""
        settings = {"do_sample": False} if self.sampling is None else {"do_sample": True, **self.sampling}
        torch.manual_seed(self.seed)
        synchronize(ids.device)
        started = time.perf_counter()
        out = self.model.generate(ids, max_new_tokens=self.max_new_tokens, **settings, **extra)
        synchronize(ids.device)
        return out.cpu(), time.perf_counter() - started

    def peer(self, ids: torch.Tensor, spec: BenchMethod, prompt: BenchPrompt, ref_rate: float) -> Record:
        """A llama.cpp run: speed against the reference; its prompt lookup checked against its own plain output."""
        eos = self.model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        key = tuple(ids[0].tolist())
        tokens, seconds = self.peers[spec.label].generate(key, self.max_new_tokens, eos_ids)
        identical = None
        if spec.method == "llama_cpp":
            self.plain_peer_tokens[key] = tokens
        elif key in self.plain_peer_tokens:
            identical = tokens == self.plain_peer_tokens[key]
        speedup = len(tokens) / seconds / ref_rate
        return Record(prompt.id, prompt.dataset, spec.label, len(tokens), seconds, identical, speedup=speedup)

    def one(self, ids, spec: BenchMethod, decoder: Decoder | None, prompt: BenchPrompt, reference, ref_seconds):
        verdict: dict = {"identical": None}
        ref_rate = (reference.shape[1] - ids.shape[1]) / ref_seconds
        if spec.method in PEER_METHODS:
            return self.peer(ids, spec, prompt, ref_rate)
        if spec.method in HF_METHODS:
            extra = {"prompt_lookup_num_tokens": 10}
            if spec.method == "hf_assisted":
                extra = {"assistant_model": self.draft_model}
            out, seconds = self.hf(ids, **extra)
            new = out.shape[1] - ids.shape[1]
            if self.sampling is None:
                verdict = self.judge(ids, reference, out)
            speedup = new / seconds / ref_rate
            return Record(prompt.id, prompt.dataset, spec.label, new, seconds, speedup=speedup, **verdict)
        extra = {"prediction": prompt.prediction} if spec.predict and prompt.prediction else {}
        if self.sampling is None:
            result = decoder.generate(ids, self.max_new_tokens, **extra)
            verdict = self.judge(ids, reference, result.sequences)
        else:
            result = decoder.generate(
                ids, self.max_new_tokens, do_sample=True, seed=self.seed, **self.sampling, **extra
            )
        s = result.stats
        return Record(
            prompt.id,
            prompt.dataset,
            spec.label,
            s.new_tokens,
            s.total_seconds,
            forwards=s.forwards,
            tokens_per_forward=s.tokens_per_forward,
            acceptance=s.acceptance_rate,
            draft_share=s.draft_share,
            accepted_hist={str(k): v for k, v in sorted(s.accepted_hist.items())},
            speedup=s.new_tokens / s.total_seconds / ref_rate,
            mean_fed=s.mean_fed,
            single_token_share=s.single_token_share,
            **verdict,
        )


def make_peers(
    specs: Sequence[BenchMethod], gguf: str | Path | None, threads: int, sampling: dict | None, source: str | None
) -> dict[str, LlamaCppPeer | DenseGeneratePeer]:
    """The other runtimes the specs ask for, each label its own: llama.cpp models loaded from `gguf`, transformers'
    own model from `source` (the model's name or path) in the dtype of each `generate_*`."""
    wanted = [s for s in specs if s.method in PEER_METHODS]
    dense = [s for s in wanted if s.method in DENSE_PEERS]
    llama = [s for s in wanted if s not in dense]
    if dense and source is None:
        raise ValueError(f"{dense[0].label} loads the model again with transformers' own layers; give its name or path")
    if llama and gguf is None:
        raise ValueError(
            f"{llama[0].label} runs llama.cpp on the model's GGUF file; this model was not loaded from one"
        )
    if wanted and sampling is not None:
        raise ValueError(f"{wanted[0].label}: the other runtimes are timed greedy; drop --sample")
    # every check before any model loads
    return {s.label: DenseGeneratePeer(source, DENSE_PEERS[s.method]) for s in dense} | {
        s.label: LlamaCppPeer(gguf, threads, lookup=s.method == "llama_cpp_lookup") for s in llama
    }


def warm_up(model, tokenizer, decoders: dict[str, Decoder], prompt: BenchPrompt, draft_model=None, peers=None) -> None:
    """One short run of each path, so first-call allocations do not land in the first prompt's timings."""
    ids = encode(tokenizer, prompt, model.device)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=10)
    if draft_model is not None:
        model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft_model)
    for decoder in decoders.values():
        decoder.generate(ids, 8)
    for peer in (peers or {}).values():
        peer.generate(ids[0].tolist(), 8, ())
