"""A draft model's forwards on slots (a static base of its own, captured graphs on a card) against a growing cache.

`method="draft_model"` drafts token by token, one draft forward each. On a card an eager forward of a small model
is its kernels' launches and Python, so a drafted token could cost more than the target's captured step; on slots
each draft forward replays a captured graph, as the target's do. This times, interleaved per prompt, on the device
given: `plain` (undrafted), and `draft_model` drafting with the target's own first `--layers` layers
(`self_draft_layers`: no second model to carry) in a growing cache and on slots. It reports tokens per second,
tokens per forward, and per step the time spent proposing (the draft's forwards, mostly) and in the target's
forward; texts are compared with `plain`'s (bf16 on a card: a first difference must sit on a tie of the drafts'
own; fp32 on a CPU: equal). A self-draft of SmolLM2 agrees with it rarely (the benchmarks page): what this shows is
the cost of a drafted token, not a speedup.

Usage (a card, after `gpu_check.sh 2` joined the model: `bash benchmarks/gpu_check.sh 5`; a CPU check):
    python benchmarks/draft_slots.py --model /tmp/smollm2.gguf --prompts .gpu/prompts.json --device cuda \
        --out "$OUT/draft_slots.jsonl"
    .venv/bin/python benchmarks/draft_slots.py --device cpu --n 2 --new-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forerun
from forerun.drafters.draft_model import DraftModelDrafter, self_draft
from forerun.methods import plan_method


def synced(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def decoders(model, tokenizer, layers: int, gamma: int) -> dict[str, forerun.Decoder]:
    """plain, and draft_model with the target's first `layers` layers in a growing cache and on slots."""
    made = {"plain": forerun.Decoder(model, tokenizer, "plain")}
    knobs = dict(self_draft_layers=layers, gamma=gamma)
    config = plan_method("draft_model", knobs, next(model.parameters()).device.type).configs[0]  # as a Decoder's
    draft, vocab = self_draft(model, layers), model.get_output_embeddings().weight.shape[0]
    for label, slots in (("draft_model (growing)", False), ("draft_model (slots)", True)):
        drafter = DraftModelDrafter(config, draft, vocab, slots=slots)
        made[label] = forerun.Decoder(model, tokenizer, "draft_model", drafters=[drafter], **knobs)
    return made


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    model, tokenizer = forerun.load_model(args.model, dtype=dtype, device=str(device))
    if args.prompts:
        prompts = json.loads(Path(args.prompts).read_text())
    else:
        from forerun.bench.datasets import load_dataset

        prompts = [{"id": p.id, "dataset": "humaneval", "ids": tokenizer.apply_chat_template(
            list(p.messages), add_generation_prompt=True, tokenize=True, return_dict=False)}
            for p in load_dataset("humaneval", args.n)]  # fmt: skip
    prompts = prompts[: args.n] if args.n else prompts
    made = decoders(model, tokenizer, args.layers, args.gamma)
    longest = max(len(p["ids"]) for p in prompts) + args.new_tokens
    out = open(args.out, "w") if args.out else None  # lines written as they come

    def log(**record: object) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    warm = {}
    for label, decoder in made.items():
        started = time.perf_counter()
        decoder.warm_up(longest)
        decoder.generate(torch.tensor([prompts[0]["ids"]], device=device), 16)
        warm[label] = round(time.perf_counter() - started, 2)
    log(note="warmed (graphs captured)", seconds=warm, device=str(device), dtype=dtype, layers=args.layers)
    sync, deadline = synced(device), time.monotonic() + args.budget_s
    for prompt in prompts:
        if time.monotonic() > deadline:
            log(note="deadline: stopped early")
            break
        ids = torch.tensor([prompt["ids"]], device=device)
        texts = {}
        for label, decoder in made.items():
            sync()
            started = time.perf_counter()
            result = decoder.generate(ids, args.new_tokens, eos_token_id=[])
            sync()
            took = time.perf_counter() - started
            stats, steps = result.stats, max(result.stats.forwards, 1)
            texts[label] = result.new_tokens
            log(prompt=prompt["id"], method=label, seconds=round(took, 4),
                tokens_per_s=round(len(result.new_tokens) / took, 1),
                tokens_per_forward=round(stats.tokens_per_forward, 3),
                propose_ms_per_step=round(1e3 * stats.draft_seconds / steps, 3),
                forward_ms_per_step=round(1e3 * stats.forward_seconds / steps, 3),
                same_as_plain=texts[label] == texts["plain"])  # fmt: skip
    if out is not None:
        out.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", help="JSON list of {id, dataset, ids} (gpu_prompts.py); else HumanEval")
    parser.add_argument("--n", type=int, default=0, help="prompts used (0: all given)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bf16 on a card, fp32 on a CPU")
    parser.add_argument("--layers", type=int, default=8, help="the self-draft's layers")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--out", type=Path)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
