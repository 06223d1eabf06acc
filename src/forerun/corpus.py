"""Pre-build a trie cache from a JSONL corpus (`forerun trie build corpus.jsonl -o cache.safetensors`).

Each line is one of:
- `{"text": "..."}` or `{"completion": "..."}`: any text, inserted as it is (the output weight);
- `{"prompt": "..."}` or `{"messages": [...]}`: the model answers it (chat template, greedy) and the trie learns
  the answer, as it learns from live outputs — the model's own answers are what the trie will later see again.

Example:
    >>> decoder = Decoder(model, tokenizer, "trie")                             # doctest: +SKIP
    >>> build_trie(decoder, read_corpus(Path("corpus.jsonl")), max_new_tokens=256)  # doctest: +SKIP
    {'documents': 120, 'answered': 20, 'nodes': 48211}
    >>> decoder.save_cache("cache.safetensors")                                 # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from forerun.decoder import Decoder

TEXT_FIELDS = ("text", "completion")


def read_corpus(path: Path) -> list[dict]:
    """Rows of a JSONL corpus; a line that is not a JSON object with a known field raises ValueError (line number)."""
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number} is not JSON ({error.msg})") from None
            except (ValueError, RecursionError) as error:  # an integer past 4300 digits; '[' * 100000
                raise ValueError(f"{path}: line {number} is not JSON ({type(error).__name__})") from None
            if not isinstance(row, dict) or not any(k in row for k in (*TEXT_FIELDS, "prompt", "messages")):
                raise ValueError(f"{path}: line {number} needs one of 'text', 'completion', 'prompt', 'messages'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def build_trie(
    decoder: Decoder,
    rows: Iterable[dict],
    max_new_tokens: int = 256,
    on_row: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Feed every row to the decoder's trie; returns counts {documents, answered, nodes}."""
    drafter = decoder.trie_drafter()
    documents = answered = 0
    for row in rows:
        text = next((row[k] for k in TEXT_FIELDS if k in row), None)
        if text is not None:
            drafter.learn(decoder.tokenizer(str(text), add_special_tokens=False)["input_ids"])
            documents += 1
        else:
            prompt = row["messages"] if "messages" in row else str(row["prompt"])
            # Generating through the trie decoder inserts the answer exactly as a live request would.
            decoder.generate(prompt, max_new_tokens, chat=True)
            answered += 1
        if on_row is not None:
            on_row()
    return {"documents": documents, "answered": answered, "nodes": len(drafter.trie)}
