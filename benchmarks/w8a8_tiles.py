"""8-bit activations (`quantize="w8a8"`) with trees through AMX's int8 tiles or through fbgemm alone: one model, its
layers switched between the two (`RowInt8Linear.tiles`), interleaved in one process.

1. The forward-latency curve: ms per forward of n tokens after `--context` cached ones, the fastest of `--rounds`,
   the two settings in turn (logits checked equal: both kernels give the same numbers).
2. End to end: per prompt (GSM8K, HumanEval, MBPP, type hints), plain `generate` and forerun's `auto` under each
   setting, a Decoder per setting on its own curve (the curve's key names `tile_rows`); each output compared with
   generate's: how many are identical, and where others first differ, by how many units of w8a8's resolution
   generate's own logits put the two tokens apart (a tie, or plain generate's own noise: docs/exactness.md).

    python benchmarks/w8a8_tiles.py --model smollm2-135m --n 3 --threads 1 \
        --out benchmarks/results/w8a8-tiles-smollm2-xeon-amx.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import forerun
from forerun.base.row_int8 import RowInt8Linear, int8_tiles
from forerun.bench.datasets import load_dataset
from forerun.bench.runner import encode
from forerun.exactness import first_divergence, resolution
from forerun.measured import machine_label

SETTINGS = {"fbgemm": False, "tiles": True}
SIZES = (1, 2, 4, 8, 16, 32, 64)


def use_tiles(model: torch.nn.Module, tiles: bool) -> None:
    for layer in model.modules():
        if isinstance(layer, RowInt8Linear):
            layer.tiles = tiles


@torch.inference_mode()
def curve(model: torch.nn.Module, context: int, rounds: int) -> dict[str, dict[int, float]]:
    """ms per forward of n new tokens after `context` cached ones, per setting: the fastest of `rounds`."""
    ids = torch.randint(100, 10000, (1, context + max(SIZES)), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(ids[:, :context], cache=cache, use_cache=True)
    best = {name: dict.fromkeys(SIZES, float("inf")) for name in SETTINGS}
    for _ in range(rounds):
        for n in SIZES:
            logits = {}
            for name, tiles in SETTINGS.items():
                use_tiles(model, tiles)
                started = time.perf_counter()
                logits[name] = model(ids[:, context : context + n], cache=cache, use_cache=True).logits
                best[name][n] = min(best[name][n], time.perf_counter() - started)
                cache.crop(-n)
            assert torch.equal(*logits.values()), f"{n} tokens: the two kernels' logits differ"
    return {name: {n: s * 1e3 for n, s in cells.items()} for name, cells in best.items()}


def end_to_end(model, tokenizer, datasets: list[str], n: int, new_tokens: int) -> dict[str, dict]:
    """tokens/s of generate and of `auto` per setting, and whether every `auto` output held to generate's."""
    decoders = {}
    for name, tiles in SETTINGS.items():  # each Decoder measures (or reads) the curve of its own setting
        use_tiles(model, tiles)
        decoders[name] = forerun.Decoder(model, tokenizer, method="auto")
        decoders[name].generate([1, 2, 3], 2)
    keys = ["generate", *(f"auto, {name}" for name in SETTINGS)]
    seconds, tokens = dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0)
    identical, ulps = dict.fromkeys(keys, 0), {key: [] for key in keys}
    for index, prompt in enumerate(p for dataset in datasets for p in load_dataset(dataset, n)):
        ids = encode(tokenizer, prompt, torch.device("cpu"))
        use_tiles(model, True)  # generate's prompt is a wide product too
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        seconds["generate"] += time.perf_counter() - started
        expected = out.sequences[0, ids.shape[1] :].tolist()
        tokens["generate"] += len(expected)
        logits = torch.cat(out.logits).float()
        for name, tiles in SETTINGS.items():
            use_tiles(model, tiles)
            started = time.perf_counter()
            result = decoders[name].generate(ids[0].tolist(), new_tokens)
            seconds[f"auto, {name}"] += time.perf_counter() - started
            tokens[f"auto, {name}"] += len(result.new_tokens)
            divergence = first_divergence(expected, result.new_tokens, logits, resolution(model))
            identical[f"auto, {name}"] += divergence is None
            ulps[f"auto, {name}"] += [] if divergence is None else [divergence.ulps]
        print(f"prompt {index + 1}", flush=True)
    return {key: {"tokens_per_second": tokens[key] / seconds[key], "identical": identical[key],
                  "first_difference_ulps": ulps[key]} for key in keys}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=3, help="Prompts per dataset (0: the curve alone).")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not int8_tiles():
        raise SystemExit("this CPU has no AMX int8 tiles: nothing to compare")
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model(args.model, quantize="w8a8")
    found = {"curve_ms": curve(model, args.context, args.rounds)}
    machine = machine_label(torch.device("cpu"))
    print(f"{args.model}, w8a8, {machine}, {args.threads} thread(s), {args.context} cached")
    print("| ms per forward | " + " | ".join(str(n) for n in SIZES) + " |")
    for name, cells in found["curve_ms"].items():
        print(f"| {name} | " + " | ".join(f"{cells[n]:.1f}" for n in SIZES) + " |")
    if args.n:
        found["end_to_end"] = end_to_end(model, tokenizer, args.dataset.split(","), args.n, args.max_new_tokens)
        for key, cell in found["end_to_end"].items():
            differences = ", ".join(f"{u:.1f}" for u in cell["first_difference_ulps"]) or "none"
            print(f"| {key} | {cell['tokens_per_second']:.1f} tokens/s | identical {cell['identical']} | first"
                  f" differences at (w8a8 ulps): {differences} |")  # fmt: skip
    if args.out:
        settings = {"model": args.model, "machine": machine, "threads": args.threads, "context": args.context,
                    "n": args.n, "datasets": args.dataset, "max_new_tokens": args.max_new_tokens,
                    "torch": torch.__version__}  # fmt: skip
        args.out.write_text(json.dumps({"settings": settings, **found}, indent=1))


if __name__ == "__main__":
    main()
