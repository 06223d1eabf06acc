"""llama.cpp as a benchmark's peer: a crash of its native code is found in a child process before the benchmark
runs, and reported with what to do, instead of taking the whole run's results with it."""

from __future__ import annotations

import sys
import types

import pytest

from forerun.bench import peers


@pytest.fixture(params=[b"AVX512 = 1 | AMX_INT8 = 1 | ", b"AVX512 = 1 | "], ids=["amx", "no-amx"])
def fake_llama_cpp(monkeypatch, request):
    """A stand-in llama_cpp package, built with or without AMX's kernels: records the models it was asked for (the
    real one builds llama.cpp)."""
    made = []

    class Llama:
        def __init__(self, path, **settings):
            made.append((path, settings))

    package = types.ModuleType("llama_cpp")
    package.Llama, package.llama_print_system_info = Llama, lambda: request.param
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda num_pred_tokens: ("lookup", num_pred_tokens)
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    return made


def test_a_crash_in_the_probe_is_an_error_naming_the_file_and_the_rebuild(monkeypatch, fake_llama_cpp):
    probed = []
    monkeypatch.setattr(peers, "child_crash", lambda command: probed.append(command) or "SIGSEGV")
    with pytest.raises(ValueError, match="SIGSEGV") as raised:
        peers.LlamaCppPeer("model.Q4_1.gguf", threads=2, lookup=False)
    amx = b"AMX" in sys.modules["llama_cpp"].llama_print_system_info()
    assert "model.Q4_1.gguf" in str(raised.value)
    assert ("-DGGML_AMX_INT8=OFF" in str(raised.value)) == amx  # the rebuild is advised where it has AMX's kernels
    assert probed[0][-2:] == ["model.Q4_1.gguf", "2"] and probed[0][0] == sys.executable
    assert fake_llama_cpp == []  # nothing loaded in this process


def test_a_probe_that_ran_loads_the_model_here(monkeypatch, fake_llama_cpp):
    monkeypatch.setattr(peers, "child_crash", lambda command: None)
    peers.LlamaCppPeer("model.Q4_1.gguf", threads=1, lookup=True)
    ((path, settings),) = fake_llama_cpp
    assert path == "model.Q4_1.gguf" and settings["n_threads"] == 1
    assert settings["draft_model"] == ("lookup", peers.LOOKUP_TOKENS)


def test_the_probe_reads_a_prompt_in_a_child_that_can_die_of_a_signal():
    assert peers.child_crash([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"]) == (
        "SIGABRT"
    )
    assert peers.child_crash([sys.executable, "-c", "raise SystemExit(3)"]) is None  # an error is not a crash
    assert "llm.eval(llm.tokenize(" in peers.PROBE  # the probe reads a prompt: a model's load alone did not crash
