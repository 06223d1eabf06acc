"""Run lade (hao-ai-lab/LookaheadDecoding, PyPI `lade`) on exported prompts; writes forerun's record format.

Runs in lade's own environment (transformers 4.34). For every prompt, interleaved: plain greedy `generate`
(USE_LADE=0, lade's own switch) then lade (USE_LADE=1), after a warm-up, with torch threads pinned. Speed is
lade's time against plain generate of the same environment; output is compared token for token with the
transformers-5 reference exported with the prompts. Forwards are counted with a hook on the final norm (lade
calls its own forward, not `model.forward`).

Usage: .venv-lade/bin/python benchmarks/run_lade.py --export X --window 7 --level 5 --guess 7 --out X/lade.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def record(
    common: dict, method: str, new: int, seconds: float, identical: bool, forwards: int, speedup: float | None = None
) -> dict:
    """One run's record in `forerun bench`'s layout (`--include` reads it): `speedup` None for the reference."""
    return {**common, "method": method, "new_tokens": new, "seconds": seconds, "identical": identical,
            "forwards": forwards, "tokens_per_forward": None if speedup is None else new / max(1, forwards),
            "acceptance": None, "draft_share": None, "speedup": 1.0 if speedup is None else speedup}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True, help="Folder written by export_for_lade.py")
    parser.add_argument("--window", type=int, default=7)
    parser.add_argument("--level", type=int, default=5, help="lade's LEVEL = N (n-gram size)")
    parser.add_argument("--guess", type=int, default=7, help="lade's GUESS_SET_SIZE = G")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import lade
    import transformers
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    lade.augment_all()
    lade.config_lade(LEVEL=args.level, WINDOW_SIZE=args.window, GUESS_SET_SIZE=args.guess, DEBUG=0)
    data = json.loads((args.export / "prompts.json").read_text())
    max_new_tokens = data["settings"]["max_new_tokens"]
    # 4.36+: ask for eager attention (lade passes `padding_mask`, which sdpa refuses); 4.34 has only eager.
    extra = {"attn_implementation": "eager"} if transformers.__version__ >= "4.36" else {}
    model = LlamaForCausalLM.from_pretrained(args.export / "model", torch_dtype=torch.float32, **extra).eval()
    forwards = [0]
    model.model.norm.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    label = f"lade[window={args.window},ngram={args.level},max_candidates={args.guess}]"

    def run(ids: torch.Tensor, use_lade: bool) -> tuple[list[int], float, int]:
        os.environ["USE_LADE"] = "1" if use_lade else "0"  # lade's own switch, read at each generate call
        forwards[0] = 0
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0].tolist(), time.perf_counter() - started, forwards[0]

    first = torch.tensor([data["prompts"][0]["input_ids"]])
    run(first[:, :32], False), run(first[:, :32], True)  # warm-up
    records = []
    for prompt in data["prompts"]:
        ids = torch.tensor([prompt["input_ids"]])
        plain, plain_s, plain_f = run(ids, False)
        fast, fast_s, fast_f = run(ids, True)
        new = len(fast) - ids.shape[1]
        common = {"prompt_id": prompt["prompt_id"], "dataset": prompt["dataset"], "accepted_hist": {}}
        reference = prompt["reference_ids"]
        records.append(record(common, "lade:generate", len(plain) - ids.shape[1], plain_s, plain == reference, plain_f))
        records.append(record(common, label, new, fast_s, fast == reference, fast_f, plain_s / fast_s))
        print(
            f"{prompt['prompt_id']}: {plain_s / fast_s:.2f}x, {new / max(1, fast_f):.2f} tokens/forward, "
            f"identical={fast == prompt['reference_ids']}",
            flush=True,
        )
    settings = {
        "lade": "0.0.2",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": platform.machine(),
        **data["settings"],
    }
    args.out.write_text(json.dumps({"settings": settings, "records": records}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
