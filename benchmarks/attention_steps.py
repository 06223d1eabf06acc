"""What a step costs as the text grows, with a half-precision model attending in fp32 or in its own dtype.

`load_model(attn_implementation="auto")` attends bf16 models (4-bit ones too: bf16 activations) on the CPU in
whichever of the two this CPU measured faster (`forerun.attention_choice`). This compares the two on the real
model: each cell is the fastest of --repeats forwards of `tokens` new tokens after `context` cached ones, on
forerun's growing cache (fp32 entries for the fp32 attention, `kvcache.RoomyLayer`), the two models interleaved in
one process. The two compute different numbers (the largest logit difference is printed), each what plain
`generate` of its own model computes.

    python benchmarks/attention_steps.py --quantize int4 --threads 1 \
        --out benchmarks/results/attention-steps-int4-xeon-amx.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from forerun.attention import SDPA_FP32, SDPA_GROUPED
from forerun.kvcache import roomy_cache
from forerun.measured import machine_label
from forerun.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_growth import stepper  # noqa: E402

SHAPES = ((200, 1), (200, 8), (1000, 1), (1000, 8), (4000, 1), (4000, 8))
"""(cached tokens, tokens fed) per cell."""
WAYS = {"fp32": SDPA_FP32, "own dtype": SDPA_GROUPED}


@torch.inference_mode()
def measure(models: dict[str, torch.nn.Module], repeats: int) -> list[dict]:
    ids = torch.randint(100, 1000, (1, max(c + t for c, t in SHAPES)), generator=torch.Generator().manual_seed(0))
    rows = []
    for context, tokens in SHAPES:
        steps = {way: stepper(model, roomy_cache(model.config), ids, context, tokens) for way, model in models.items()}
        first = {way: step().float() for way, step in steps.items()}
        best = dict.fromkeys(steps, float("inf"))
        for _ in range(repeats):
            for way, step in steps.items():
                started = time.perf_counter()
                step()
                best[way] = min(best[way], time.perf_counter() - started)
        rows.append(
            {"context": context, "tokens": tokens}
            | {f"{way}_ms": round(s * 1e3, 2) for way, s in best.items()}
            | {"speedup": round(best["fp32"] / best["own dtype"], 3)}
            | {"max_logit_difference": round(float((first["fp32"] - first["own dtype"]).abs().max()), 3)}
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="", help="int4 or int8 weights (bf16 activations); default bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {"quantize": args.quantize} if args.quantize else {"dtype": "bf16"}
    models = {way: load_model(args.model, attention, **options)[0] for way, attention in WAYS.items()}
    record = {
        "model": args.model,
        "weights": args.quantize or "bf16",
        "threads": args.threads,
        "machine": machine_label(torch.device("cpu")),
        "torch": torch.__version__,
        "rows": measure(models, args.repeats),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
