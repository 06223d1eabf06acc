"""Server stall: how long the other streams stop while a long prompt joins the batch, with and without chunks.

S clients stream long answers (GSM8K questions) from `forerun serve`'s continuous batch; once each has its first
token, one more client sends a long prompt (HumanEval prompts one after another, ~T tokens, "summarise"). Per
`--prefill-chunk` setting the table gives the longest gap between two streamed pieces any running client saw,
their median gap, the long request's time to its first token, and aggregate tokens per second. With chunk 0 the
whole prompt is read in one forward while every stream waits; with chunks the running rows step between them.

Usage:
    .venv/bin/python benchmarks/server_stall.py --streams 3 --prompt-tokens 2000 --threads 1 --chunks 0,256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from openai import OpenAI

import forerun
from forerun.bench.datasets import load_dataset
from forerun.server import ServerConfig, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from test_server import LiveServer  # noqa: E402  (the tests' loopback uvicorn runner)


def long_document(tokenizer, tokens: int) -> str:
    """HumanEval prompts one after another until the text has about `tokens` tokens."""
    parts, total = [], 0
    for prompt in load_dataset("humaneval", 164):
        text = prompt.messages[-1]["content"]
        parts.append(text)
        total += len(tokenizer(text).input_ids)
        if total >= tokens:
            break
    return "Summarise what these functions do, in one line each.\n\n" + "\n\n".join(parts)


def stream(client: OpenAI, messages: list[dict], max_tokens: int, arrivals: list[float]) -> int:
    """Stream one chat answer, noting the time each piece arrives; returns the completion tokens."""
    chunks = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
    )
    used = 0
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=3, help="Clients streaming long answers.")
    parser.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of the streaming clients.")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="About how long the joining prompt is.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--chunks", default="0,256", help="--prefill-chunk settings, comma-separated (0: off).")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m")
    questions = [list(p.messages) for p in load_dataset("gsm8k", args.streams)]
    document = [{"role": "user", "content": long_document(tokenizer, args.prompt_tokens)}]
    print(f"{args.streams} streaming clients ({args.stream_tokens} tokens, {args.method}), then one prompt of "
          f"~{args.prompt_tokens} tokens; fp32, {args.threads} torch thread(s)")  # fmt: skip
    print("| prefill chunk | longest stall of a stream (s) | median gap (s) | long prompt: first token (s) | "
          "its prompt tokens | tokens/s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        config = ServerConfig(
            "smollm2-135m", args.method, max_batch=8, max_tokens_limit=1024, prefill_chunk=chunk, prefix_cache_tokens=0
        )
        server = LiveServer(create_app(model, tokenizer, config))
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        client.chat.completions.create(model="smollm2-135m", messages=questions[0], max_tokens=4)  # warm-up
        arrivals: list[list[float]] = [[] for _ in questions]
        used = [0] * len(questions)

        def run(i: int, client=client, arrivals=arrivals, used=used) -> None:
            used[i] = stream(client, questions[i], args.stream_tokens, arrivals[i])

        began = time.perf_counter()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
        for thread in threads:
            thread.start()
        while not all(arrivals):  # every stream is running
            time.sleep(0.05)
        sent = time.perf_counter()
        long_arrivals: list[float] = []
        reply_tokens = stream(client, document, 16, long_arrivals)
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        server.stop()
        gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)]
        prompt_len = len(
            tokenizer.apply_chat_template(document, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
        first = long_arrivals[0] - sent if long_arrivals else float("nan")
        tokens = sum(used) + reply_tokens
        print(f"| {chunk or 'off'} | {max(gaps):.2f} | {statistics.median(gaps):.3f} | {first:.1f} | {prompt_len} | "
              f"{tokens / wall:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
