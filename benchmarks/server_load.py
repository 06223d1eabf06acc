"""Server load: C concurrent clients x R requests each, against `forerun serve` one at a time and batched.

Each setting starts the app in this process on 127.0.0.1 (uvicorn in a thread), sends the same requests (chat,
greedy, prompts from GSM8K/HumanEval/MBPP/typehints) from C threads of another process with the official openai
client (`--clients-in-process`: threads of this one, as before 2026-11-25), and reports
aggregate completion tokens per second over the wall time and p50/p95 request latency. Traffic stays on loopback.

Usage:
    .venv/bin/python benchmarks/server_load.py --clients 8 --requests 5 --max-tokens 64 --threads 1 \\
        --settings "plain:1,auto:1,auto:8"        # method:max_batch[:prefix_cache_tokens]

A third field sets the server's prefix cache (`--prefix-cache`; 4096 tokens when not given, as these figures were
first taken; 0 = off, as before it existed): `prompt_lookup:1:0` is the one-at-a-time server as it was first
shipped, with today's engine.

A setting `LABEL=URL` measures a server already running at URL instead, such as the server as it was before
batching (an older checkout, its own process; start it with the same model, dtype and threads):
    git worktree add /tmp/forerun-5cc1a23 5cc1a23
    PYTHONPATH=/tmp/forerun-5cc1a23/src .venv/bin/forerun serve --port 8124 &
    .venv/bin/python benchmarks/server_load.py --threads 2 \\
        --settings "5cc1a23=http://127.0.0.1:8124,prompt_lookup:8,5cc1a23=http://127.0.0.1:8124,prompt_lookup:8"
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch
from openai import OpenAI

import forerun
from forerun.bench.datasets import load_dataset
from forerun.server import ServerConfig, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from test_server import LiveServer  # noqa: E402  (the tests' loopback uvicorn runner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=5, help="Per client.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument(
        "--settings",
        default="plain:1,auto:1,auto:8",
        help="method:max_batch[:prefix_cache_tokens] or LABEL=URL (a running server), comma-separated.",
    )
    parser.add_argument(
        "--clients-in-process",
        action="store_true",
        help="Run the client threads in the server's process, as the tables before 2026-11-25 did.",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, tokenizer = forerun.load_model("smollm2-135m", attn_implementation=args.attention, dtype=dtype)
    total = args.clients * args.requests
    prompts = [p for name in ("gsm8k", "humaneval", "mbpp", "typehints") for p in load_dataset(name, total)]
    prompts = [list(p.messages) for p in prompts[::4][:total]]  # every dataset in turn
    print(f"{args.clients} clients x {args.requests} requests, {args.max_tokens} tokens, {args.dtype}, "
          f"{args.attention} attention, {args.threads} torch thread(s)")  # fmt: skip
    print("| server | completion tokens/s | p50 latency (s) | p95 latency (s) | requests |")
    print("|---|---:|---:|---:|---:|")
    for setting in args.settings.split(","):
        server = None
        if "=" in setting:  # LABEL=URL: a server running elsewhere
            label, url = setting.split("=", 1)
        else:
            parts = setting.split(":")
            method, batch, prefix = parts[0], (parts[1:2] or ["1"])[0], (parts[2:3] or ["4096"])[0]
            config = ServerConfig(
                "smollm2-135m", method, max_batch=int(batch), max_queue=total + 1, prefix_cache_tokens=int(prefix)
            )
            server = LiveServer(create_app(model, tokenizer, config))
            url = server.url
            label = f"{method}, max_batch {batch}" + (", no prefix cache" if int(prefix) == 0 else "")
        if args.clients_in_process:
            results, wall = load(url, prompts, args.clients, args.max_tokens)
        else:  # the clients' Python (HTTP, JSON) must not take the server's GIL: they run in a process of their own
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
                results, wall = clients.submit(load, url, prompts, args.clients, args.max_tokens).result()
        if server is not None:
            server.stop()
        latencies = sorted(seconds for seconds, _ in results)
        tokens = sum(n for _, n in results)
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        print(f"| {label} | {tokens / wall:.1f} | {statistics.median(latencies):.1f} | {p95:.1f} | {len(results)} |",
              flush=True)  # fmt: skip


def load(url: str, prompts: list[list[dict]], clients: int, max_tokens: int) -> tuple[list[tuple[float, int]], float]:
    """Send every prompt from `clients` threads (after one warm-up request); return (latency s, completion tokens)
    per request and the wall time of the whole load."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    client.chat.completions.create(model="smollm2-135m", messages=prompts[0], max_tokens=4)  # warm-up

    def one(messages: list[dict]) -> tuple[float, int]:
        began = time.perf_counter()
        reply = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=max_tokens)
        return time.perf_counter() - began, reply.usage.completion_tokens

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, prompts))
    return results, time.perf_counter() - began


if __name__ == "__main__":
    main()
