#!/usr/bin/env bash
# lade side by side with forerun, on the same prompts and the same embedded model.
#
#   bash benchmarks/compare_lade.sh [DATASETS] [N] [MAX_NEW_TOKENS]      (defaults: gsm8k,humaneval 5 128)
#
# 1. builds .venv-lade with lade 0.0.2 (the only release on PyPI) and the transformers it runs with, CPU torch:
#    4.34.1. (With 4.36.2, which lade's GitHub README pins for newer code, 0.0.2 fails: sdpa refuses its
#    `padding_mask` argument, and with eager attention its KV slicing hits the new Cache objects: "'NoneType' object
#    is not subscriptable".)
# 2. exports the model (safetensors + a 4.34-readable config) and the chat-templated prompt ids from forerun's venv;
# 3. runs lade (W=7, N=5, G=7: its defaults) and plain generate interleaved in lade's venv -> bench-results/lade/lade.json;
# 4. runs forerun bench on the same prompts with --include, so the tables carry the lade row.
# If a step fails, the script says which and why, and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
DATASETS=${1:-gsm8k,humaneval}
N=${2:-5}
TOKENS=${3:-128}
OUT=bench-results/lade
LADE_VENV=.venv-lade

fail() { echo "compare_lade: $*" >&2; exit 1; }

[ -x .venv/bin/forerun ] || fail "forerun's environment is missing: run 'make setup' first"
if [ ! -x "$LADE_VENV/bin/python" ] || ! "$LADE_VENV/bin/python" -c "import lade" 2>/dev/null; then
  echo "building $LADE_VENV (lade 0.0.2, transformers 4.34.1, torch 2.13.0 CPU)"
  python3 -m venv "$LADE_VENV"
  "$LADE_VENV/bin/pip" install -q --upgrade pip
  "$LADE_VENV/bin/pip" install -q torch==2.13.0 || fail "could not install torch 2.13.0 in $LADE_VENV"
  "$LADE_VENV/bin/pip" install -q transformers==4.34.1 accelerate==0.25.0 lade==0.0.2 \
    || fail "could not install lade 0.0.2 with transformers 4.34.1 (see pip's message above)"
fi
"$LADE_VENV/bin/python" -c "import lade, transformers; print('lade ok, transformers', transformers.__version__)" \
  || fail "lade does not import in $LADE_VENV (see the traceback above)"

mkdir -p "$OUT"
.venv/bin/python benchmarks/export_for_lade.py --dataset "$DATASETS" --n "$N" --max-new-tokens "$TOKENS" --out "$OUT" \
  || fail "exporting the model/prompts failed"
"$LADE_VENV/bin/python" benchmarks/run_lade.py --export "$OUT" --window 7 --level 5 --guess 7 --out "$OUT/lade.json" \
  || fail "lade failed on the exported model (see the traceback above)"
.venv/bin/forerun bench --dataset "$DATASETS" --n "$N" --max-new-tokens "$TOKENS" --threads 1 \
  --methods "plain,jacobi,jacobi[window=7,ngram=5,max_candidates=7,pool_from_output=false,lazy_window=false]" --include "$OUT/lade.json" --out "$OUT"
