"""What sampling costs the host: a position's Gumbel noise, and sampled decoding end to end.

A sampled token is the argmax of the processed scores plus the noise of its position (`forerun.noise`); a
position's noise is a vocabulary of float64 values, made once per position. This times (1) making the noise of a
fresh position, on the CPU and, where there is one, on a card (there: the card's time, synchronized), and (2)
sampled decoding on the CPU (temperature 0.7, top-p 0.9; a seed per prompt), a single row and a batch, reporting
tokens per second, tokens per forward and the share of the wall time spent outside the forwards. Run it on two
commits to compare them (the texts differ where the noise does: compare speeds).

Usage:
    .venv/bin/python benchmarks/sampling_host.py --threads 2 --rows 1,8 --out benchmarks/results/sampling-host-epyc.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import forerun
from forerun.models import load_model
from forerun.noise import GumbelNoise


def noise_ms(device: str, vocab: int, positions: int = 200) -> float:
    """Milliseconds to make one fresh position's noise of `vocab` tokens on `device` (median of `positions`)."""
    noise, times = GumbelNoise(seed=1), []
    scores = torch.zeros(vocab, device=device)
    for position in range(positions + 5):
        started = time.perf_counter()
        noise.draw(scores, position)  # made, added and drawn from, wherever this version does each
        times.append(time.perf_counter() - started)
    return 1e3 * sorted(times[5:])[positions // 2]


def decode_rate(decoder: forerun.Decoder, prompts: list, rows: int, new_tokens: int) -> dict:
    """Sampled decoding of `prompts`, `rows` at a time: tokens per second, tokens per forward, host share."""
    started, tokens, forwards, forward_s = time.perf_counter(), 0, 0, 0.0
    for first in range(0, len(prompts), rows):
        group = prompts[first : first + rows]
        seeds = dict(do_sample=True, temperature=0.7, top_p=0.9, seed=first, eos_token_id=[])
        results = decoder.generate(group if rows > 1 else group[0], new_tokens, **seeds)
        for result in results if rows > 1 else [results]:
            tokens += len(result.new_tokens)
            forwards += result.stats.forwards
            forward_s += result.stats.forward_seconds / (len(group) if rows > 1 else 1)
    wall = time.perf_counter() - started
    return {"tok_s": round(tokens / wall, 2), "tokens_per_forward": round(tokens / max(forwards, 1), 2),
            "host_share": round(1 - forward_s / wall, 3), "wall_s": round(wall, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="plain,auto")
    parser.add_argument("--rows", default="1,8", help="rows decoded together, comma-separated")
    parser.add_argument("--n", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype="fp32")
    vocab = model.config.vocab_size
    record = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__}
    record["noise_ms"] = {"cpu": round(noise_ms("cpu", vocab), 3)}
    if torch.cuda.is_available():
        noise_ms("cuda", vocab, 10)  # the card's kernels loaded
        record["noise_ms"]["cuda"] = round(noise_ms("cuda", vocab), 3)
    print(json.dumps(record), flush=True)
    from batch_host import chat_ids  # a sibling script: benchmarks/ is on the path when this one runs

    prompts = chat_ids(tokenizer, args.n)
    runs = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for method in args.methods.split(","):
            decoder = forerun.Decoder(model, tokenizer, method)
            runs.append({"rows": rows, "method": method, **decode_rate(decoder, prompts, rows, args.new_tokens)})
            print(json.dumps(runs[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({**record, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
