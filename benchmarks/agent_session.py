"""An agent's session on `forerun serve`: a coding agent's long system prompt and tools, three turns through the
Messages API as Claude Code sends them (streamed, `context_management`, `output_config.effort`), each turn the
conversation so far with the model's own answers and a tool's result. Per prefix-cache setting (`--prefix-cache`
tokens; `auto`: the default, four contexts within 1 GiB) it reports each turn's time to its first streamed piece,
the whole turn's time, and how many prompt tokens were read from the cache. Greedy: every setting sees the same
conversation. Each session starts a fresh server (an empty cache); settings alternate round by round.

Usage:
    .venv/bin/python benchmarks/agent_session.py --model qwen2.5-coder-0.5b --threads 2 --settings 4096,auto \\
        --rounds 2 --out benchmarks/results/agent-session-qwen05-epyc.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import anthropic
import torch

import forerun
from forerun.server import ServerConfig, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from test_server import LiveServer  # noqa: E402  (the tests' loopback uvicorn runner)

RULES = "\n".join(f"- Rule {i}: when editing file number {i}, keep its style, run its tests, and report what changed."
                  for i in range(150))  # fmt: skip
SYSTEM = [{"type": "text", "text": "You are a coding agent. Follow these rules.\n" + RULES,
           "cache_control": {"type": "ephemeral"}}]  # fmt: skip
TOOLS = [
    {"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "write_file", "description": "Write a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
        "required": ["path", "text"]}},
]  # fmt: skip
EXTRA = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
         "output_config": {"effort": "high"}, "metadata": {"user_id": "bench"}}  # fmt: skip
RESULT = "def main():\n    print('hi')\n"


def session(url: str, turns: int, new: int) -> list[dict]:
    """One agent session against the server at `url`: per turn, its timings and token counts."""
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=900)
    messages: list[dict] = [{"role": "user", "content": "Read the file main.py."}]
    rows = []
    for turn in range(turns):
        start, first, pieces = time.perf_counter(), None, 0
        choice = {"type": "any"} if turn == 0 else {"type": "auto"}
        with client.beta.messages.stream(model="local", max_tokens=new, system=SYSTEM, messages=messages, tools=TOOLS,
                                         tool_choice=choice, betas=["context-management-2025-06-27"],
                                         **EXTRA) as stream:  # fmt: skip
            for event in stream:
                if event.type in ("text", "input_json"):
                    first = first if first is not None else time.perf_counter() - start
                    pieces += 1
            final = stream.get_final_message()
        rows.append({"turn": turn, "first_s": first, "whole_s": time.perf_counter() - start,
                     "prompt_tokens": final.usage.input_tokens + final.usage.cache_read_input_tokens,
                     "cached_tokens": final.usage.cache_read_input_tokens, "pieces": pieces,
                     "blocks": [block.type for block in final.content]})  # fmt: skip
        said = [block.model_dump(exclude_none=True) for block in final.content if block.type != "thinking"]
        messages.append({"role": "assistant", "content": said})
        uses = [block.id for block in final.content if block.type == "tool_use"]
        follow = [{"type": "tool_result", "tool_use_id": ident, "content": RESULT} for ident in uses]
        messages.append({"role": "user", "content": follow or "Now add a docstring to main and write the file."})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default="4096,auto", help="prefix-cache settings: tokens or auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model(args.model)
    runs = []
    for round_ in range(args.rounds):
        for setting in args.settings.split(","):
            tokens = None if setting == "auto" else int(setting)
            config = ServerConfig("local", "auto", max_tokens_limit=args.max_tokens, prefix_cache_tokens=tokens,
                                  max_queue=4)  # fmt: skip
            server = LiveServer(create_app(model, tokenizer, config))
            try:
                rows = session(server.url, args.turns, args.max_tokens)
            finally:
                server.stop()
            runs.append({"round": round_, "setting": setting, "turns": rows})
            for row in rows:
                print(f"round {round_} prefix {setting:>5} turn {row['turn']}: prompt {row['prompt_tokens']} "
                      f"(cached {row['cached_tokens']}), first piece {row['first_s']:.2f} s, "
                      f"whole {row['whole_s']:.2f} s, {row['blocks']}", flush=True)  # fmt: skip
    if args.out:
        machine = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                   "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        args.out.write_text(json.dumps({"model": args.model, "machine": machine, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
