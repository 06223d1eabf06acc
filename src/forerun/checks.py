"""Checks on what a caller asks of one generation: every bad value is a ValueError that names it.

The library, the CLI and the server share these, so `forerun.generate(..., temperature=1e-300)` and an HTTP
request with the same value fail the same way (a 400 there), never deep inside torch.

Example:
    >>> check_sampling({"temperature": 0.7, "top_p": 0.9})
    >>> check_sampling({"temperature": 1e-300})
    Traceback (most recent call last):
    ...
    ValueError: temperature must be 0 (greedy) or between 0.0001 and 100, got 1e-300
    >>> check_text("content", "a\\ud800b")
    Traceback (most recent call last):
    ...
    ValueError: content contains a lone surrogate (U+D800 at character 1): not valid Unicode text
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

MAX_SEED = 2**63 - 1
MAX_DEPTH = 64
"""Levels a JSON value a request gives may nest (a schema's objects and lists): deeper ones are refused before any
parser sees them."""

# name: (lowest, highest, lowest is allowed). Beyond these, sampling overflows (logits / 1e-300 is inf) or means
# nothing (a repetition penalty of 1e-300 divides logits by it).
RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (1e-4, 100.0, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "typical_p": (0.0, 1.0, False),
    "epsilon_cutoff": (0.0, 1.0, True),
    "eta_cutoff": (0.0, 1.0, True),
    "repetition_penalty": (1e-2, 100.0, True),
    "length_penalty": (-100.0, 100.0, True),
    "frequency_penalty": (-2.0, 2.0, True),  # OpenAI's range
    "presence_penalty": (-2.0, 2.0, True),
}


def is_count(value: object, minimum: int = 0) -> bool:
    """Whether `value` is a whole number (an int, not a bool) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_sampling(settings: dict[str, object]) -> None:
    """Range checks on transformers sampling settings (temperature, top_p, top_k, min_p, repetition_penalty...)."""
    for name, value in settings.items():
        if name in RANGES:
            number = check_number(name, value)
            low, high, inclusive = RANGES[name]
            if name == "temperature" and number == 0:
                continue
            if number > high or number < low or (number == low and not inclusive):
                prefix = "0 (greedy) or " if name == "temperature" else ""
                bounds = f"between {low:g} and {high:g}" if inclusive else f"in ({low:g}, {high:g}]"
                raise ValueError(f"{name} must be {prefix}{bounds}, got {value!r}")
        elif name in ("top_k", "no_repeat_ngram_size"):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
                raise ValueError(f"{name} must be an integer in [0, 1000000], got {value!r}")


DECODED_MODES = ("greedy_search", "sample", "assisted_generation")
"""transformers' generation modes forerun decodes (assisted generation's output is greedy's or sampling's)."""


def check_decoding_mode(config, settings: str = "these settings") -> None:
    """Refuse a transformers `GenerationConfig` that asks for a way of decoding forerun does not do (beam search,
    contrastive search, DoLa...), naming it, rather than decode greedily without a word (`settings`: where the
    config came from, for the message).

    Example:
        >>> from transformers import GenerationConfig
        >>> check_decoding_mode(GenerationConfig(num_beams=2))
        Traceback (most recent call last):
        ...
        ValueError: forerun decodes greedily or samples; these settings ask for beam search (num_beams=2)
    """
    mode = config.get_generation_mode().value
    if mode not in DECODED_MODES:
        beams = f" (num_beams={config.num_beams})" if config.num_beams not in (None, 1) else ""
        raise ValueError(f"forerun decodes greedily or samples; {settings} ask for {mode.replace('_', ' ')}{beams}")


def check_seed(seed: object) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


def check_warm_up(max_len: object, batch_size: object, single: object, context: int | None = None) -> None:
    """`Decoder.warm_up`'s arguments: a positive token count within the model's `context`, a positive row count,
    a boolean."""
    if not is_count(max_len, 1):
        raise ValueError(f"warm_up's max_len must be a positive number of tokens, got {max_len!r:.40}")
    if context is not None and max_len > context:
        raise ValueError(f"warm_up's max_len={max_len} exceeds the model's context ({context} tokens)")
    if not is_count(batch_size, 1):
        raise ValueError(f"warm_up's batch_size must be a positive number of rows, got {batch_size!r:.40}")
    if not isinstance(single, bool):
        raise ValueError(f"warm_up's single must be true or false, got {single!r:.40}")


def check_batch_size(batch_size: object) -> None:
    """None (every prompt at once) or a positive integer."""
    if batch_size is not None and not is_count(batch_size, 1):
        raise ValueError(f"batch_size must be a positive integer (rows decoded at once), got {batch_size!r}")


def row_seeds(seed: object, rows: int) -> list[int] | None:
    """Each row's seed: row i of a batch draws from seed + i (wrapping below 2**63), or from seed[i] given one
    per row.

    Example:
        >>> row_seeds(7, 3), row_seeds([5, 5, 9], 3), row_seeds(None, 3)
        ([7, 8, 9], [5, 5, 9], None)
    """
    if seed is None:
        return None
    if isinstance(seed, (list, tuple)):
        if len(seed) != rows:
            raise ValueError(f"seed takes one integer, or one per prompt ({rows}), got {len(seed)}")
        for one in seed:
            check_seed(one)
        return list(seed)
    return [offset_seed(seed, i) for i in range(rows)]


def offset_seed(seed: object, offset: int) -> int:
    """seed + offset, checked, wrapping below 2**63: `offset_seed(2**63 - 1, 1) == 0`."""
    check_seed(seed)
    return (seed + offset) % (MAX_SEED + 1)  # type: ignore[operator]


MAX_CHARS_PER_TOKEN = 64
"""No tokenizer packs more characters than this into a token of ordinary text; a prompt longer than the context
times this cannot fit, and is refused before it is tokenized (a 50 MB line took 91 s and 7 GB to tokenize)."""


def check_text_length(name: str, characters: int, context: int | None) -> None:
    """Refuse text of `characters` too long for a `context` of tokens, before any tokenizer sees it."""
    if context is not None and characters > context * MAX_CHARS_PER_TOKEN:
        raise ValueError(f"{name} is {characters:,} characters, more than the model's context ({context} tokens) holds")


def check_text(name: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be encoded, so no tokenizer can take it)."""
    try:
        text.encode("utf-8")
        return  # the common case in one C call; the loop below only finds where the bad character is
    except UnicodeEncodeError:
        pass
    for index, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            raise ValueError(
                f"{name} contains a lone surrogate (U+{ord(char):04X} at character {index}): not valid Unicode text"
            )


def check_stops(stop: str | Sequence[str] | None) -> list[str]:
    """None, one string or a list of non-empty strings -> a list (an empty stop string would end every answer)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(stops):
        if not s:
            raise ValueError(f"stop[{i}] is empty: an empty stop string would end the answer at once")
        check_text(f"stop[{i}]", s)
    return list(stops)


def check_logprobs(logprobs: object, most: int = 20) -> None:
    """None (no log-probabilities), or how many alternatives to give per token (0 = the chosen token's only)."""
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= most
    ):
        raise ValueError(f"logprobs must be an integer in [0, {most}] (alternatives per token), got {logprobs!r}")


def writable_folder(path: str | Path, what: str = "--out") -> Path:
    """`path` as a folder that exists (created if missing) and can be written to; else a ValueError naming it.
    Commands call this before loading a model or measuring, not after minutes of work.

    Example:
        >>> writable_folder("/proc/results")
        Traceback (most recent call last):
        ...
        ValueError: --out /proc/results cannot be created: [Errno 2] No such file or directory: '/proc/results'
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} {folder} is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{what} {folder} cannot be created: {error}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {folder} cannot be written (permission denied)")
    return folder


def nesting(value: object) -> int:
    """How deep objects and lists nest in `value` (a scalar: 0), counted without recursion, up to MAX_DEPTH + 1.

    Example:
        >>> nesting({"a": [1, {"b": 2}]}), nesting(3)
        (3, 0)
    """
    deepest, level = 0, [value]
    while deepest <= MAX_DEPTH:
        containers = [item for item in level if isinstance(item, (Mapping, list, tuple))]
        if not containers:
            break
        deepest += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, Mapping) else item)]
    return deepest
