"""The trie's file: safetensors arrays of parents, tokens and output counts in BFS order, and a reader that checks
every value before a trie is built from it (`TokenTrie.save` / `TokenTrie.load`; no pickle).

Example (a trie of one path written and read back):
    >>> import tempfile, os
    >>> from forerun.drafters.trie import TokenTrie
    >>> trie = TokenTrie(); trie.insert([1, 2, 3], 1.0)
    >>> path = os.path.join(tempfile.mkdtemp(), "trie.safetensors"); trie.save(path)
    >>> read_trie(path, vocab=10)
    (200000, [-1, 0, 1], [1, 2, 3], [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from forerun.config import TrieConfig
    from forerun.drafters.trie import TokenTrie

FORMAT, VERSION = "forerun-trie", "1"
MAX_FILE_NODES = 10_000_000
"""The most nodes a trie file may hold: the `max_nodes` knob's ceiling."""


def write_trie(trie: TokenTrie, path: str | Path, config: TrieConfig | None = None) -> None:
    """Write the nodes of `trie` with an output count (prompt weights are the running requests' own)."""
    from safetensors.torch import save_file

    parents, tokens, counts = [], [], []
    queue = [(0, -1)]
    while queue:
        node, index = queue.pop()
        for token, child in (trie.kids[node] or {}).items():
            if trie.count[child] <= 0:
                continue
            parents.append(index)
            tokens.append(token)
            counts.append(trie.count[child])
            queue.append((child, len(tokens) - 1))
    metadata = {"format": FORMAT, "version": VERSION, "max_nodes": str(trie.max_nodes)}
    if config is not None:
        metadata["config"] = repr(config)
    # Written beside the target, then renamed over it: a kill mid-save leaves the old file, never half a file.
    temporary = Path(f"{path}.tmp-{os.getpid()}")
    save_file(
        {
            "parents": torch.tensor(parents, dtype=torch.int64),
            "tokens": torch.tensor(tokens, dtype=torch.int64),
            "counts": torch.tensor(counts, dtype=torch.float64),
        },
        str(temporary),
        metadata=metadata,
    )
    os.replace(temporary, path)


def read_trie(path: str | Path, vocab: int | None = None) -> tuple[int, list[int], list[int], list[float]]:
    """A trie file's node budget, parents, tokens and counts, each checked: anything else raises ValueError naming
    the file and what is wrong (a count that is not finite and non-negative: an infinite count broke every later
    request; a token id outside [0, `vocab`); more nodes than any trie holds)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"{path} is not a forerun trie file (format {metadata.get('format')!r})")
            if metadata.get("version") != VERSION:
                raise ValueError(f"{path} has trie format version {metadata.get('version')!r}; expected {VERSION}")
            arrays = {name: handle.get_tensor(name) for name in ("parents", "tokens", "counts")}
            stored_max = metadata.get("max_nodes", "200000")
    except (FileNotFoundError, ValueError):
        raise
    except Exception as error:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"cannot read trie file {path}: {error}") from error
    budget = check_stored_budget(path, stored_max)  # checked even where the caller names its own
    return (budget, *check_arrays(path, arrays, vocab))


def check_stored_budget(path: str | Path, stored: str) -> int:
    """The node budget a trie file names in its metadata, checked like the `max_nodes` knob."""
    if not stored.isdigit() or not 16 <= int(stored) <= 10_000_000:
        raise ValueError(f"{path}: corrupt trie (max_nodes {stored[:20]!r} is not an integer in [16, 10000000])")
    return int(stored)


def check_arrays(
    path: str | Path, arrays: dict[str, torch.Tensor], vocab: int | None
) -> tuple[list[int], list[int], list[float]]:
    """The file's parents, tokens and counts as lists, each checked (`TokenTrie.load`)."""
    parents, tokens, counts = arrays["parents"], arrays["tokens"], arrays["counts"]
    if any(a.dim() != 1 for a in arrays.values()) or not len(parents) == len(tokens) == len(counts):
        raise ValueError(f"{path}: inconsistent trie arrays (shapes {[list(a.shape) for a in arrays.values()]})")
    if parents.is_floating_point() or tokens.is_floating_point() or parents.dtype == torch.bool:
        raise ValueError(f"{path}: corrupt trie (parents and tokens must be integers)")
    if len(tokens) > MAX_FILE_NODES:  # over the budget but under this, the trie prunes itself as it learns
        raise ValueError(f"{path}: {len(tokens)} nodes, more than any trie holds ({MAX_FILE_NODES})")
    counts = counts.double()
    if len(counts) and not (bool(torch.isfinite(counts).all()) and float(counts.min()) >= 0):
        raise ValueError(f"{path}: corrupt trie (counts must be finite and >= 0)")
    if len(tokens) and (int(tokens.min()) < 0 or (vocab is not None and int(tokens.max()) >= vocab)):
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise ValueError(f"{path}: token id {int(tokens.max()) if int(tokens.min()) >= 0 else int(tokens.min())} "
                         f"outside the model's vocabulary ({limit})")  # fmt: skip
    return parents.tolist(), tokens.tolist(), counts.tolist()
