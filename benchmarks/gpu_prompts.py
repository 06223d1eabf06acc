"""Write benchmark prompts as token ids for `benchmarks/gpu_check.py` (the GPU machine has no dataset packages).

Usage:
    .venv/bin/python benchmarks/gpu_prompts.py --n 3 --out .gpu/prompts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forerun.bench.datasets import load_dataset
from forerun.models import load_model

DATASETS = ("gsm8k", "humaneval", "mbpp", "typehints")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--datasets", default=",".join(DATASETS),
                        help="comma-separated names or JSONL files (benchmarks/chat_questions.jsonl)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(".gpu/prompts.json"))
    args = parser.parse_args()
    _, tokenizer = load_model()
    prompts = []
    for name in args.datasets.split(","):
        for prompt in load_dataset(name, args.n):
            ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            prompts.append({"id": prompt.id, "dataset": Path(name).stem, "ids": list(ids)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(prompts))
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
