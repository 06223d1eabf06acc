#!/usr/bin/env bash
# The GPU check in phases, for a machine that can take 64 MiB per call with the work tree (the embedded GGUF is
# 98 MB: a part of it travels with each phase 0, into .gpu/, and phase 2 joins them all). Needs .whl/ (transformers
# and gguf wheels, as the project pins them) and .gpu/ (prompts.json, chat.json, smollm2.part00, part01, part02),
# prepared here by: bash benchmarks/gpu_prepare.sh
# A path not named in a call's carry does not stay in the work tree between calls: each phase keeps the part it
# carried in /tmp, which lasts as long as the machine.
# Usage: bash benchmarks/gpu_check.sh 0   (carrying .whl and .gpu/smollm2.part00: install, keep the part in /tmp;
#        again carrying each further part but the last, which travels with phase 2)
#        bash benchmarks/gpu_check.sh 1   (tiny models' exactness; a random 1B-class model's curve)
#        bash benchmarks/gpu_check.sh 2   (SmolLM2-135M: tiny models again, curve, single-row bench, batches)
#        SECTIONS=curve,bench bash benchmarks/gpu_check.sh 2   (only those)
#        SECTIONS=bench bash benchmarks/gpu_check.sh 2 --compiled plain,auto   (more options: gpu_check.py --help)
#        bash benchmarks/gpu_check.sh 3   (undrafted steps of the random 1B-class model: eager, compiled, forerun)
#        bash benchmarks/gpu_check.sh 4   (SmolLM2-135M: sampled steps drawn at once against the walk, after a
#          phase 2 joined the model; benchmarks/sampled_steps.py)
#        bash benchmarks/gpu_check.sh 5   (SmolLM2-135M: a draft model's forwards on slots against a growing cache,
#          after a phase 2 joined the model; benchmarks/draft_slots.py)
#        bash benchmarks/gpu_check.sh 6   (a random Qwen3.5-shaped hybrid: chains on a card, guesses set by a
#          prediction; benchmarks/hybrid_chains.py; add --lone for a server's lone request, --family lfm2 for
#          LFM2's shape, whose convolution windows are cut back)
#        SECTIONS=bench bash benchmarks/gpu_check.sh 2 --methods plain,eagle3,auto,eagle3+prompt_lookup+trie \
#          --baselines generate_static_compiled   (the shipped head on graphs; chat prompts: gpu_prompts.py --datasets)
set -uo pipefail
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: a phase may run from benchmarks/
cp .gpu/smollm2.part0* /tmp/ 2>/dev/null
if [ -d .whl ]; then  # a later phase finds the wheels the first one installed (the machine keeps /tmp while warm)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
test -d /tmp/site/transformers || { echo "no wheels installed: carry .whl"; exit 1; }
if [ "${1:-1}" = 0 ]; then ls -la /tmp/smollm2.part0*; exit 0; fi  # phase 0: keep the part carried, install
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "${1:-1}" in
  1) python3 benchmarks/gpu_check.py smoke,curve --model random-1b --budget-s "${BUDGET_S:-200}" --out "$OUT/gpu_phase1.jsonl" ;;
  3) python3 benchmarks/gpu_check.py steps --model random-1b --budget-s 150 --out "$OUT/gpu_phase3.jsonl" ;;
  4) echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm2.gguf" | sha256sum -c || exit 1
     (cd benchmarks && timeout "${BUDGET_S:-300}" python3 sampled_steps.py --model /tmp/smollm2.gguf \
       --prompts ../.gpu/prompts.json --device cuda --rows 1,16 --out "$OUT/sampled_steps.json" "${@:2}") ;;
  5) echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm2.gguf" | sha256sum -c || exit 1
     timeout "${BUDGET_S:-200}" python3 benchmarks/draft_slots.py --model /tmp/smollm2.gguf --prompts .gpu/prompts.json \
       --device cuda --budget-s "$(( ${BUDGET_S:-200} - 60 ))" --out "$OUT/draft_slots.jsonl" "${@:2}" ;;
  6) timeout "${BUDGET_S:-150}" python3 benchmarks/hybrid_chains.py --device cuda --dtype bf16 --prompts 3 \
       --out "$OUT/hybrid_chains.json" "${@:2}" ;;
  2) cat /tmp/smollm2.part0* > /tmp/smollm2.gguf
     echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm2.gguf" | sha256sum -c || exit 1
     python3 benchmarks/gpu_check.py "${SECTIONS:-smoke,curve,bench,batch}" --model /tmp/smollm2.gguf \
       --prompts .gpu/prompts.json --budget-s "${BUDGET_S:-380}" --out "$OUT/gpu_phase2.jsonl" "${@:2}" ;;
esac
