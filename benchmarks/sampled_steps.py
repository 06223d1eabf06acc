"""Sampled steps: every node drawn at once (one copy to the host a step) against the walk (a sync per walked node).

On a card a sampled step drew node by node along the walked path: the processors' launches and a host sync for
each walked node's token, and in a batch each row's own. Drawn at once (`forerun.draws`, the default wherever the
logits are on an accelerator), the processors run over every node in one call (per depth level where they read
the prefix), and one copy brings every row's draws to the host. This measures, on the device given:

1. `equality`: the draws at once against the walk's, node by node, on random logits of the model's vocabulary
   (64-node trees, temperature 0.7 + top-k 50 + top-p 0.9, and repetition penalty 1.2 + temperature 0.7), and
   the processed scores themselves: on a CPU they are equal bit for bit (the unit tests); on a card a batched
   top-p's cumulative sums could round otherwise than one row's, which would show here as scores that differ
   (and a draw that differs only where that met a near-tie of two perturbed scores).
2. `decode`: sampled decoding (temperature 0.7, top-p 0.9, a seed per prompt), the walk and at once interleaved,
   per rows and method: tokens per second, tokens per forward, and whether the texts are the same (they must be).

Usage (a card; the CPU runs it too, where the walk is its default and at once costs more):
    python benchmarks/sampled_steps.py --model /tmp/smollm2.gguf --prompts .gpu/prompts.json --device cuda \
        --rows 1,16 --out "$OUT/sampled_steps.json"
    .venv/bin/python benchmarks/sampled_steps.py --device cpu --rows 1,4 --n 1 --new-tokens 24 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import forerun
from forerun.batched import decode_rows
from forerun.draws import drawn, scored
from forerun.engine import decode
from forerun.noise import GumbelNoise
from forerun.transcript import Transcript
from forerun.tree import TokenTree
from forerun.verify import NodeScores

SETTINGS = dict(do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[])
PROCESSORS = {
    "temperature-top_k-top_p": [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
    "repetition-temperature": [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7)],
}


def random_tree(nodes: int, generator: torch.Generator, vocab: int) -> TokenTree:
    tree = TokenTree.rooted_at(int(torch.randint(vocab, (), generator=generator)))
    while len(tree) < nodes:
        parent = int(torch.randint(len(tree), (), generator=generator))
        token = int(torch.randint(vocab, (), generator=generator))
        if (parent, token) not in tree.children:
            tree.add(parent, token)
    return tree


def equality(device: str, vocab: int, trees: int = 100, nodes: int = 64) -> dict:
    """Nodes whose draw at once differs from the walk's, per processor setting, over `trees` random trees."""
    generator, out = torch.Generator().manual_seed(0), {}
    prefix = torch.randint(vocab, (1, 200), generator=generator)
    for name, processors in PROCESSORS.items():
        differ = rounded = 0
        for seed in range(trees):
            tree = random_tree(nodes, generator, vocab)
            logits = (torch.randn(nodes, vocab, generator=generator) * 4).to(device)
            scores = NodeScores(logits, LogitsProcessorList(processors), Transcript(prefix, []), tree)
            noise = GumbelNoise(seed)
            at_once = drawn(scores, noise).tolist()
            walked = [noise.draw(scores.scores(i), prefix.shape[1] + d) for i, d in enumerate(tree.depths)]
            differ += sum(a != b for a, b in zip(at_once, walked, strict=True))
            every = scored(scores)
            rounded += sum(not torch.equal(every[i], scores.scores(i)) for i in range(nodes))
        out[name] = {"nodes": trees * nodes, "draws_differ": differ, "scores_differ": rounded}
    return out


def jobs_of(decoder: forerun.Decoder, prompts: list[list[int]], new_tokens: int, at_once: bool, seed: int) -> list:
    """Each prompt as a sampled row (seed: `seed` + its index), drawing at once or walking."""
    jobs = []
    for index, ids in enumerate(prompts):
        request = forerun.GenerationRequest.of(ids, new_tokens, seed=seed + index, **SETTINGS)
        job = decoder.prepare(request).job
        jobs.append(replace(job, sampling=replace(job.sampling, at_once=at_once)))
    return jobs


def timed_decode(decoder: forerun.Decoder, prompts: list[list[int]], rows: int, new_tokens: int, at_once: bool,
                 seed: int) -> tuple[list[list[int]], float, int]:  # fmt: skip
    """The prompts decoded `rows` at a time (1: one by one, on the single row's base): texts, seconds, forwards."""
    jobs = jobs_of(decoder, prompts, new_tokens, at_once, seed)
    if decoder.model.device.type == "cuda":
        torch.cuda.synchronize()
    started, forwards = time.perf_counter(), 0
    with torch.inference_mode():
        if rows == 1:
            for job in jobs:
                forwards += decode(decoder.model, job, decoder.budget, True, decoder.base).forwards
        else:
            for _, stats in decode_rows(decoder.model, jobs, decoder.budget, rows, decoder.base):
                forwards += stats.forwards
    seconds = time.perf_counter() - started
    texts = [job.transcript.sequence[0, len(ids) :].tolist() for job, ids in zip(jobs, prompts, strict=True)]
    return texts, seconds, forwards


def decode_runs(model, tokenizer, prompts: list[list[int]], rows: int, method: str, new_tokens: int) -> dict:
    """The walk and at once, each on a Decoder of its own (their tries learn the same texts), warmed on the prompts
    reversed (same shapes, other answers: graphs captured there), then two timed rounds interleaved, each round's
    seeds its own."""
    group = (prompts * rows)[: max(rows, len(prompts))]
    decoders = {at_once: forerun.Decoder(model, tokenizer, method) for at_once in (False, True)}
    for at_once, decoder in decoders.items():
        timed_decode(decoder, [list(reversed(p)) for p in group], rows, new_tokens, at_once, 0)
    seconds, forwards = {False: 0.0, True: 0.0}, {False: 0, True: 0}
    texts: dict[bool, list] = {False: [], True: []}
    for round_ in (1, 2):
        for at_once, decoder in decoders.items():
            got, took, steps = timed_decode(decoder, group, rows, new_tokens, at_once, 1000 * round_)
            seconds[at_once] += took
            forwards[at_once] += steps
            texts[at_once] += got
    tokens = sum(len(text) for text in texts[True])
    return {
        "rows": rows,
        "method": method,
        "tok_s_walk": round(tokens / seconds[False], 2),
        "tok_s_at_once": round(tokens / seconds[True], 2),
        "at_once_vs_walk": round(seconds[False] / seconds[True], 3),
        "tokens_per_forward": round(tokens / max(forwards[True], 1), 2),  # a row's tokens per forward it took part in
        "same_texts": texts[True] == texts[False],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=Path, help="JSON list of {id, dataset, ids} (default: chat prompts)")
    parser.add_argument("--n", type=int, default=2, help="prompts per dataset, without --prompts")
    parser.add_argument("--methods", default="prompt_lookup,auto")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from forerun.measured import device_name

    model, tokenizer = forerun.load_model(args.model, dtype=args.dtype, device=args.device)
    record = {"device": device_name(torch.device(args.device)), "threads": args.threads, "dtype": str(model.dtype)}
    record["equality"] = equality(args.device, model.config.vocab_size)
    print(json.dumps(record), flush=True)
    if args.prompts:
        prompts = [p["ids"] for p in json.loads(args.prompts.read_text())]
    else:
        from batch_host import chat_ids  # a sibling script: benchmarks/ is on the path when this one runs

        prompts = chat_ids(tokenizer, args.n)
    runs = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for method in args.methods.split(","):
            runs.append(decode_runs(model, tokenizer, prompts, rows, method, args.new_tokens))
            print(json.dumps(runs[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({**record, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
