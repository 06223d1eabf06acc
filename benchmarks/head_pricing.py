"""`auto` with the shipped head under reproducible choices (bf16, int4: the head's forwards priced, not timed): one
line of JSON with tokens/s, forwards, steps that fed the root alone and a digest of the texts.

For an A/B of two ways of pricing, run it from two checkouts in turn (each process loads the checkout named by
PYTHONPATH), alternating, on a quiet machine:

    for side in /tmp/old/src src src /tmp/old/src; do
        PYTHONPATH=$side .venv/bin/python benchmarks/head_pricing.py --quantize int4 \
            --datasets benchmarks/chat_questions.jsonl --n 12
    done
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

import forerun
from forerun.bench.datasets import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default=None, help="int4 or int8 (bf16 activations)")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mbpp,typehints")
    parser.add_argument("--n", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = forerun.load_model("smollm2-135m", dtype=args.dtype, quantize=args.quantize)
    decoder = forerun.Decoder(model, tokenizer, "auto", draft_head="smollm2-135m")
    prompts = [p for name in args.datasets.split(",") for p in load_dataset(name, args.n)]
    decoder.generate(list(prompts[0].messages), 8)  # first-call allocations
    tokens = seconds = forwards = undrafted = 0
    texts = []
    for prompt in prompts:
        result = decoder.generate(list(prompt.messages), args.max_new_tokens)
        stats = result.stats
        tokens, seconds = tokens + stats.new_tokens, seconds + stats.total_seconds
        forwards, undrafted = forwards + stats.forwards, undrafted + stats.undrafted_steps
        texts.append(result.sequences[0].tolist())
    digest = hashlib.sha1(str(texts).encode()).hexdigest()[:10]
    print(json.dumps({"code": forerun.__file__, "tok_s": round(tokens / seconds, 2), "tokens": tokens,
                      "forwards": forwards, "undrafted": undrafted, "texts": digest}))  # fmt: skip


if __name__ == "__main__":
    main()
