"""`forerun.generate`: one call, a Decoder built for it (`forerun.decoder.Decoder` to keep one across calls).

Example:
    >>> result = forerun.generate(model, "def fib(n):", "auto", 64, tokenizer=tokenizer)   # doctest: +SKIP
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from forerun.decoder import Decoder
from forerun.defaults import DEFAULT_METHOD
from forerun.request import Prompt
from forerun.result import GenerationResult


def generate(
    model: torch.nn.Module,
    input_ids: Prompt,
    method: str = DEFAULT_METHOD,
    max_new_tokens: int = 256,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    knobs: dict[str, object] | None = None,
    max_tree_nodes: int | None = None,
    draft_model: torch.nn.Module | str | None = None,
    **generation_kwargs: object,
) -> GenerationResult:
    """One call: `Decoder(model, tokenizer, method, **knobs).generate(input_ids, max_new_tokens, **generation_kwargs)`.

    Method knobs go in `knobs` (e.g. `knobs={"draft_len": 8}`); every argument of `Decoder.generate` (chat, stop,
    eos_token_id, streamer, do_sample, seed, temperature, top_p, ...) is passed through.

    Example:
        >>> forerun.generate(model, ids, "trie", 64, do_sample=True, temperature=0.7, seed=0)  # doctest: +SKIP
    """
    decoder = Decoder(model, tokenizer, method, max_tree_nodes=max_tree_nodes, draft_model=draft_model, **(knobs or {}))
    return decoder.generate(input_ids, max_new_tokens, **generation_kwargs)
