"""Every benchmark the docs give a command for still loads: its imports resolve (a module the tests moved had left
three server and long-prompt benchmarks failing at their first line) and every shell script parses."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
SHELL = sorted(BENCHMARKS.glob("*.sh"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 20 and len(SHELL) >= 3  # a wrong folder must not pass as "nothing broken"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_benchmark_imports(script: Path):
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))  # as `python benchmarks/x.py` runs it: its own folder first on the path
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # module level only: each script runs under `if __name__ == "__main__"`
    finally:
        sys.path[:] = saved
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
    assert module.__doc__, f"{script.name} has no docstring saying how it is run"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SHELL, ids=lambda path: path.name)
def test_shell_script_parses(script: Path):
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def load_script(name: str):
    """A benchmark script as a module, loaded as `python benchmarks/<name>.py` would (its own folder first)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_the_gpu_batch_check_tells_a_tie_from_a_fault():
    """The card's batch check counts the rows that differ from batched generate and, of them, those whose first
    difference is a tie on generate's own logits: a row that took generate's second choice by a wide margin is
    counted as differing, not as a tie."""
    import torch

    agreement = load_script("gpu_batch").agreement
    vocab = 8
    tied = torch.zeros(vocab, dtype=torch.bfloat16)
    tied[3] = tied[5] = 4.0  # tokens 3 and 5 level: either is generate's choice
    clear = torch.zeros(vocab, dtype=torch.bfloat16)
    clear[3], clear[5] = 4.0, 1.0  # 3 well ahead of 5
    reference = [[1, 3], [1, 3], [1, 3]]
    logits = [[clear, clear], [clear, tied], [clear, clear]]
    rows = [SimpleNamespace(new_tokens=tokens) for tokens in ([1, 3], [1, 5], [1, 5])]
    assert agreement(rows, reference, logits, torch.bfloat16) == (1, 1)


@pytest.mark.parametrize("price", [1.0, 2.5])
def test_the_batch_host_script_prices_every_forward_on_the_curve(price):
    """`batch_host.timed_run(curve=)` adds each forward's (rows, bucket) price: on a curve where every forward
    costs `price` seconds, whatever its rows and nodes, the priced seconds are the forwards times `price` (the
    script decodes once before it times, as here)."""
    import forerun
    from forerun.costmodel import LatencyCurve

    from tiny_models import prompts, tiny_model

    batch_host = load_script("batch_host")
    flat = LatencyCurve((1, 64), (price, price))
    curve = flat.with_batches([(2**i, flat) for i in range(1, 7)])
    decoder = forerun.Decoder(tiny_model("llama", "sdpa"), None, "plain", static_cache=True, latency=curve)
    rows = [p[0].tolist() for p in prompts(3)]
    decoder.generate(rows, 6)  # the batch's base (a sibling of the decoder's, made at its first batch) exists
    run = batch_host.timed_run(decoder, rows, 6, curve=curve)
    assert run["forwards"] >= 6  # the prompts side by side with the first tokens, then a step a token
    assert run["priced_s"] == pytest.approx(price * run["forwards"])


def test_the_batch_host_script_hides_only_learning_done_while_a_forward_runs():
    """`overlapped_s`: the drafters' learning a paused batch does between a forward and the step's copy to the
    host (on a card the forward hides it). Rows of prompt lookup on a curve where nothing pays pause and learn
    there; rows without drafters have nothing to learn; neither hides more than its host work."""
    import forerun
    from forerun.costmodel import LatencyCurve

    from tiny_models import prompts, tiny_model

    batch_host = load_script("batch_host")
    sizes = (1, 2, 4, 8, 16, 32, 64)
    linear = LatencyCurve(sizes, tuple(float(n) for n in sizes))
    curve = linear.with_batches([(2**i, linear) for i in range(1, 7)])
    rows = [p[0].tolist() for p in prompts(3)]
    hidden = {}
    for method in ("plain", "prompt_lookup"):
        decoder = forerun.Decoder(
            tiny_model("llama", "sdpa"), None, method, static_cache=True, latency=curve, reproducible=True
        )
        decoder.generate(rows, 24)
        run = batch_host.timed_run(decoder, rows, 24, curve=curve)
        hidden[method] = run["overlapped_s"]
        assert run["overlapped_s"] <= run["wall_s"] - run["forward_s"]
    assert hidden["plain"] == 0 and hidden["prompt_lookup"] > 0, hidden
