"""Other runtimes in the same benchmark: llama.cpp (through llama-cpp-python, the `peers` extra) reading the very
GGUF file forerun loads, and transformers on the same model's dense weights, with the same prompt token ids, thread
count and stopping tokens.

`llama_cpp`: its plain greedy decoding; `llama_cpp_lookup`: with its prompt lookup (`LlamaPromptLookupDecoding`, 10
tokens per guess); `generate_bf16` and `generate_fp32`: transformers' plain greedy `generate` of the same model in that
dtype with dense weights in transformers' own layers and its own sdpa, what a user runs without forerun (the baseline of
a `--quantize` run, whose reference is generate of the quantized model, and of a run whose weights forerun laid out for
oneDNN, `forerun.base.packed`, whose reference is generate of those). Texts differ across runtimes and weights, so a
peer's run is compared for speed only; llama.cpp's prompt lookup is checked against its own plain output of the same
prompt.

Example:
    >>> peer = LlamaCppPeer("SmolLM2-135M-Instruct.Q4_1.gguf", threads=1, lookup=False)   # doctest: +SKIP
    >>> tokens, seconds = peer.generate([1, 9690, 198], 64, eos={2})                      # doctest: +SKIP
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import torch

DENSE_PEERS = {"generate_bf16": "bf16", "generate_fp32": "fp32"}
"""transformers' own model in each dtype: the method's name -> the dtype it loads."""
PEER_METHODS = ("llama_cpp", "llama_cpp_lookup", *DENSE_PEERS)
LOOKUP_TOKENS = 10
"""Tokens per guess of llama.cpp's prompt lookup, as transformers' `prompt_lookup_num_tokens=10` in this bench."""
CONTEXT = 4096
PROBE = (
    "import sys; from llama_cpp import Llama; "
    "llm = Llama(sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False); "
    "llm.eval(llm.tokenize(b'Hello there, how are you?'))"
)
"""llama.cpp reading a prompt of a few tokens, in a child process (`child_crash`)."""
WITHOUT_AMX = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
    "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF "
    '-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install --force-reinstall --no-deps llama-cpp-python==0.3.36'
)
"""llama-cpp-python rebuilt without llama.cpp's AMX kernels, which crashed on prompts on a Xeon with AMX."""


def child_crash(command: Sequence[str], timeout: float = 600.0) -> str | None:
    """Run `command` in a child process; the signal's name where it died of one (a native library's crash), else
    None. A crash in this process would take a whole benchmark's results with it.

    Example:
        >>> child_crash([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
        'SIGSEGV'
        >>> child_crash([sys.executable, "-c", "pass"]) is None
        True
    """
    done = subprocess.run(list(command), capture_output=True, timeout=timeout, check=False)
    return signal.Signals(-done.returncode).name if done.returncode < 0 else None


class LlamaCppPeer:
    """One llama.cpp model of a GGUF file: greedy decoding of token ids, timed with its prefill. llama.cpp first
    reads a short prompt in a child process (`PROBE`): a crash of its native code there is an error saying so."""

    def __init__(self, gguf: str | Path, threads: int, lookup: bool) -> None:
        try:
            from llama_cpp import Llama, llama_print_system_info
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise ValueError(
                "llama_cpp methods need llama-cpp-python: pip install 'forerun[peers]' (it builds llama.cpp, minutes)"
            ) from None
        crash = child_crash([sys.executable, "-c", PROBE, str(gguf), str(threads)])
        if crash is not None:
            amx = b"AMX" in llama_print_system_info()  # this build's kernels
            raise ValueError(
                f"llama.cpp died of {crash} reading a short prompt of {gguf} (in a child process, before anything "
                "ran)."
                + (f" Its AMX kernels did so on a Xeon; rebuilt without them it ran: {WITHOUT_AMX}" if amx else "")
            )
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
        self.llm = Llama(
            str(gguf), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
        )

    def generate(self, ids: Sequence[int], max_new_tokens: int, eos: Collection[int]) -> tuple[list[int], float]:
        """Greedy new tokens after the prompt `ids` (its EOS included, as generate's), and the seconds taken. As
        forerun's prefix cache does, llama.cpp keeps the KV of the head this prompt shares with the previous one (the
        chat template's system prompt) and reads only the rest."""
        started, out = time.perf_counter(), []
        for token in self.llm.generate(list(ids), temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - started


class DenseGeneratePeer:
    """transformers' greedy `generate` of the model at `source` (an alias, folder or GGUF file) in `dtype`, its
    weights dense in transformers' own layers and its attention transformers' sdpa, timed with its prefill."""

    def __init__(self, source: str | Path, dtype: str = "bf16") -> None:
        from forerun.models import load_model

        self.model, _ = load_model(str(source), attn_implementation="sdpa", dtype=dtype, pack=False)

    def generate(self, ids: Sequence[int], max_new_tokens: int, eos: Collection[int]) -> tuple[list[int], float]:
        """Greedy new tokens after the prompt `ids`, stopping at `eos` (the generation config's where empty)."""
        prompt = torch.tensor([list(ids)])
        stop = {"eos_token_id": sorted(eos), "pad_token_id": min(eos)} if eos else {}
        started = time.perf_counter()
        out = self.model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **stop)
        return out[0, prompt.shape[1] :].tolist(), time.perf_counter() - started
