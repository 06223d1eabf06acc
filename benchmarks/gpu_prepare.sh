#!/usr/bin/env bash
# What benchmarks/gpu_check.sh carries to a lent GPU machine, prepared here in one command (the GPU machine reaches
# no registry): .whl/ (the transformers, gguf and llguidance wheels pyproject.toml pins, and those of what
# transformers' import checks the versions of: huggingface_hub, tokenizers, safetensors), .gpu/prompts.json
# (12 prompts of the four datasets as token ids), .gpu/chat.json (12 chat questions and 12 GSM8K problems, for a
# head's bench) and the embedded GGUF in three parts (a call carries 64 MiB with the work tree: the parts are sized
# from the tracked files' bytes, the first beside the wheels). Both folders are kept out of git
# (.git/info/exclude). Usage: bash benchmarks/gpu_prepare.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .git/info .whl .gpu
rm -f .whl/*.whl  # one version of each: the GPU machine installs them all
for path in /.whl/ /.gpu/; do grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | tr -d '"'; }
held() { grep -E "^$1==" constraints.txt; }  # what transformers' import checks, at its pinned versions
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "$(pin transformers)" "$(pin gguf)" \
  "$(pin llguidance)" "$(held huggingface_hub)" "$(held tokenizers)" "$(held safetensors)" -d .whl
"$PY" benchmarks/gpu_prompts.py --n 3 --out .gpu/prompts.json
"$PY" benchmarks/gpu_prompts.py --datasets benchmarks/chat_questions.jsonl,gsm8k --n 6 --out .gpu/chat.json
GGUF=$("$PY" -c "from forerun.models import EMBEDDED; print(EMBEDDED['smollm2-135m'].locate())" 2>/dev/null)
room=$(( 64 * 1024 * 1024 - $(git ls-files -z | xargs -0 cat | wc -c) - 1024 * 1024 ))  # a MiB spare: prompts, commits
first=$(( room - $(cat .whl/*.whl | wc -c) )); left=$(( $(wc -c < "$GGUF") - first - room ))
[ "$first" -gt 0 ] && [ "$left" -le "$room" ] || { echo "the GGUF does not fit three calls beside the work tree"; exit 1; }
rm -f .gpu/smollm2.part0*
part() { dd if="$GGUF" of=".gpu/smollm2.part0$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count=$3} status=none; }
part 0 0 "$first"; part 1 "$first" "$room"; part 2 $(( first + room ))
cat .gpu/smollm2.part0* | sha256sum | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
ls -la .whl .gpu
