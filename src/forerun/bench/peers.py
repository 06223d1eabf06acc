"""Other runtimes in the same benchmark: llama.cpp (through llama-cpp-python, the `peers` extra) reading the very
GGUF file forerun loads, with the same prompt token ids, thread count and stopping tokens.

`llama_cpp`: its plain greedy decoding; `llama_cpp_lookup`: with its prompt lookup (`LlamaPromptLookupDecoding`,
10 tokens per guess). Texts differ across runtimes (its 4-bit kernels are not forerun's), so a peer's run is
compared for speed only; its prompt lookup is checked against its own plain output of the same prompt.

Example:
    >>> peer = LlamaCppPeer("SmolLM2-135M-Instruct.Q4_1.gguf", threads=1, lookup=False)   # doctest: +SKIP
    >>> tokens, seconds = peer.generate([1, 9690, 198], 64, eos={2})                      # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from pathlib import Path

PEER_METHODS = ("llama_cpp", "llama_cpp_lookup")
LOOKUP_TOKENS = 10
"""Tokens per guess of llama.cpp's prompt lookup, as transformers' `prompt_lookup_num_tokens=10` in this bench."""
CONTEXT = 4096


class LlamaCppPeer:
    """One llama.cpp model of a GGUF file: greedy decoding of token ids, timed with its prefill."""

    def __init__(self, gguf: str | Path, threads: int, lookup: bool) -> None:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise ValueError(
                "llama_cpp methods need llama-cpp-python: pip install 'forerun[peers]' (it builds llama.cpp, minutes)"
            ) from None
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
