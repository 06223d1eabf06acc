"""Reuse the KV cache of text the model has already read: a prompt's head that an earlier request shared.

Chat prompts begin alike (the template's system prompt: 24 of SmolLM2's tokens before every user message), and a
conversation's next turn begins with the whole previous turn, answer included. Prefilling them again computes the
same keys and values again. A `PrefixCache` keeps the KV entries of recent requests (prompt and answer) and seeds a
new request's cache with the longest head it shares with one of them; the prefill feeds only the rest.

Exactness: a token's keys and values depend only on the tokens before it, so a reused head holds the values a full
prefill computes, up to floating-point rounding (a 24-token forward and a 300-token forward may sum in another
order), the same order of difference as verifying a tree instead of one token: fp32 output stays token for token
plain generate's (tested), low precision up to ties.

Only caches whose every layer is a plain full-attention `DynamicLayer` are seeded with a head of any length (sliding
windows, linear attention and recurrent states are not per-token prefixes). A hybrid with recurrent states
(`forerun.base.chain`) keeps its whole cache, states included, as one `Entry.states`: it seeds a prompt that
begins with all of that entry's text (a conversation's next turn), never a shorter head of it. Where a prompt
shares a longer head with such an entry than any entry seeds (`states_head`: a system prompt two users sent), the
hybrid reads that head alone first and keeps its cache there too, as a `shared` entry: later prompts that begin
with it are seeded from it.

Scored prompts (`forerun.scoring`: a server's `echo` with `logprobs`) keep their tokens' log-probabilities with
their entry (`Entry.scores`), so a prompt scored later reads the head it shares, values and scores, and computes
only the rest (`find_scored`): the answers to one multiple-choice question score the question once.

Isolation: a reused head makes a prompt's first token come sooner, so whoever can time answers can tell whether
someone sent the same head before. Entries carry a salt (a request's `cache_salt`, vLLM's name for it): a prompt
is seeded only from text read under the same salt (`scoped`); requests without one share the unsalted entries.

Example (a second prompt with the same 4-token head as a stored one reuses 4 entries; shapes [1, heads, len, dim]):
    >>> from transformers import DynamicCache
    >>> prefixes = PrefixCache(max_tokens=100)
    >>> stored = DynamicCache()
    >>> _ = stored.update(torch.ones(1, 2, 5, 8), torch.ones(1, 2, 5, 8), 0)
    >>> prefixes.store([1, 2, 3, 4, 5], stored, 5)
    >>> cache = DynamicCache()
    >>> prefixes.seed(cache, [1, 2, 3, 4, 9, 10])        # 4 shared tokens; the root (10) is always fed
    4
    >>> cache.get_seq_length()
    4
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from forerun.checks import is_count
from forerun.kvcache import plain_layers

MIN_REUSE = 4
"""Shorter shared heads are prefilled again: not worth the copy."""

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]] | torch.Tensor
"""What `PrefixCache.keep` copies from: per layer (keys, values), or every layer's in one tensor."""


@dataclass(eq=False)  # identity: entries are removed by `is`, never compared by value
class Entry:
    tokens: tuple[int, ...]
    """The token ids whose KV this entry holds (a tuple: compared as Python ints, `shared_head`)."""
    keys: list[torch.Tensor]
    """Per layer [1, kv_heads, length, head_dim] (copies: nothing else writes to them)."""
    values: list[torch.Tensor]
    salt: str = ""
    """Only requests with the same salt are seeded from this entry."""
    states: DynamicCache | None = None
    """A hybrid's whole cache after `tokens` (recurrent states included; `keys` and `values` empty): it seeds only
    prompts that begin with all of `tokens` (`find_whole`)."""
    shared: bool = False
    """`states` after a head that several prompts began with: kept when a longer text it heads is (an earlier
    turn of a conversation is dropped then)."""
    block: torch.Tensor | None = None
    """Every layer's keys and values in one tensor [layers, 2, kv_heads, length, head_dim], of which `keys` and
    `values` are views, where they were kept from a static base's one buffer: a place is seeded from it in one
    copy (`forerun.base.place_prefixes`), not two per layer."""
    scores: tuple | None = None
    """Log-probability entries (`forerun.scoring`) of `tokens[:len(scores)]`, where a scoring forward read them: a
    prompt scored later takes them for the head it shares (`find_scored`) and reads only the rest."""

    def fill(self, cache: DynamicCache, length: int) -> None:
        """Put the keys and values of this entry's first `length` tokens in the empty `cache` (copies: the layers
        concatenate, and nothing writes to the entry)."""
        for index, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.update(keys[:, :, :length], values[:, :, :length], index)


def shared_head(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` (tuples of ints) have in common.

    Slices are compared whole (in C), in spans that double from 32 tokens, and the first span that differs is
    halved down to 16 before a token-by-token walk: a 30-token system prompt costs about as much as one tensor
    comparison's call, and making tensors of the token lists cost more than comparing them.

    Example:
        >>> shared_head((1, 2, 3, 4), (1, 2, 9)), shared_head((1, 2), (1, 2, 3)), shared_head((), (1,))
        (2, 2, 0)
    """
    n = min(len(a), len(b))
    low, span = 0, 32
    while low < n:
        high = min(low + span, n)
        if a[low:high] != b[low:high]:
            while high - low > 16:  # a[:low] == b[:low], and a[low:high] != b[low:high]
                middle = (low + high) // 2
                if a[low:middle] == b[low:middle]:
                    low = middle
                else:
                    high = middle
            while a[low] == b[low]:
                low += 1
            return low
        low, span = high, span * 2
    return n


class PrefixCache:
    """KV entries of recent requests, least recently used dropped first once they hold over `max_tokens` tokens.

    Thread-safe (a server's decode loop and a direct `generate` may share a Decoder). `max_tokens=0` turns it off.
    Memory: SmolLM2-135M keeps 30 layers x 2 x 3 heads x 64 floats = 46 KB per token in fp32 (8192 tokens: 377 MB).
    """

    def __init__(self, max_tokens: int = 8192) -> None:
        if not is_count(max_tokens):
            raise ValueError(f"prefix cache max_tokens must be >= 0 (a whole number of tokens), got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.entries: list[Entry] = []  # least recently used first
        self.lock = threading.Lock()

    @property
    def held_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self.entries)

    salt = ""
    """The unsalted requests' view is the cache itself (`scoped` gives a salt's)."""

    def scoped(self, salt: str | None) -> PrefixScope:
        """This cache as seen by requests with `salt` (None or "": the shared, unsalted entries)."""
        return PrefixScope(self, salt or "")

    def seed(self, cache: DynamicCache, tokens: list[int], salt: str = "") -> int:
        """Fill the empty `cache` with the KV of the longest head of `tokens[:-1]` stored under `salt` (the last
        token, the root of the first tree, is always fed); return how many tokens it holds now (0: nothing
        reused)."""
        if not plain_layers(cache) or cache.get_seq_length():
            return 0
        best, length = self.find(tokens, len(cache.layers) or None, salt)
        if best is None:
            return 0
        best.fill(cache, length)
        return length

    def find(self, tokens: list[int], layers: int | None = None, salt: str = "") -> tuple[Entry | None, int]:
        """The entry stored under `salt` that shares the longest head with `tokens[:-1]`, and that head's length;
        (None, 0) where none shares `MIN_REUSE` tokens or more (entries of another layer count than `layers` left
        out). The entry found becomes the most recently used; its `keys` and `values` are read, never written."""

        def reach(entry: Entry) -> int | None:
            if entry.states is not None or (layers is not None and len(entry.keys) != layers):
                return None
            return len(entry.tokens)

        return self.longest_head(tokens, salt, reach)

    def longest_head(
        self, tokens: list[int], salt: str, reach: Callable[[Entry], int | None]
    ) -> tuple[Entry | None, int]:
        """The entry stored under `salt` sharing the longest head with `tokens[:-1]`, each entry counting at most
        `reach(entry)` of its tokens (None: not one to read), made the most recently used, and that head's length;
        (None, 0) where none reaches `MIN_REUSE` tokens."""
        if not self.max_tokens or len(tokens) <= MIN_REUSE:
            return None, 0
        wanted = tuple(tokens[:-1])
        with self.lock:
            best, length = None, 0
            for entry in self.entries:
                most = reach(entry) if entry.salt == salt else None
                if most is None:
                    continue
                shared = min(shared_head(entry.tokens, wanted), most)
                if shared > length:
                    best, length = entry, shared
            if best is None or length < MIN_REUSE:
                return None, 0
            self.entries.remove(best)
            self.entries.append(best)  # most recently used
        return best, length

    def find_whole(self, tokens: list[int], salt: str = "") -> Entry | None:
        """The longest entry with `states` stored under `salt` whose every token heads `tokens[:-1]` (at least
        `MIN_REUSE` of them), made the most recently used; None where there is none."""
        if not self.max_tokens or len(tokens) <= MIN_REUSE:
            return None
        wanted = tuple(tokens[:-1])
        with self.lock:
            whole = [e for e in self.entries if e.states is not None and e.salt == salt and len(e.tokens) >= MIN_REUSE]
            whole = [e for e in whole if shared_head(e.tokens, wanted) == len(e.tokens)]
            if not whole:
                return None
            best = max(whole, key=lambda entry: len(entry.tokens))
            self.entries.remove(best)
            self.entries.append(best)
        return best

    def whole_copy(self, tokens: list[int], salt: str = "") -> tuple[DynamicCache | None, int]:
        """A copy of the cache `find_whole` finds for `tokens` (entries are never written: the model writes into
        what it is given) and how many tokens it holds; (None, 0) where none heads them."""
        entry = self.find_whole(tokens, salt)
        return (None, 0) if entry is None else (copy.deepcopy(entry.states), len(entry.tokens))

    def states_head(self, tokens: list[int], salt: str = "") -> int:
        """The longest head `tokens[:-1]` shares with the text of an entry with states stored under `salt` (0 where
        shorter than `MIN_REUSE`): where it is longer than what seeds `tokens`, a hybrid reads it alone and keeps
        the cache there (`keep_whole(..., shared=True)`)."""
        if not self.max_tokens or len(tokens) <= MIN_REUSE:
            return 0
        wanted = tuple(tokens[:-1])
        with self.lock:
            heads = [shared_head(e.tokens, wanted) for e in self.entries if e.states is not None and e.salt == salt]
        longest = max(heads, default=0)
        return longest if longest >= MIN_REUSE else 0

    def keep_whole(self, tokens: list[int], cache: DynamicCache, salt: str = "", shared: bool = False) -> None:
        """Keep `cache` (a hybrid's, recurrent states included, after exactly `tokens`), as it is: the caller hands
        over a copy. Entries with states it begins with (a conversation's earlier turns) are dropped, unless they
        are `shared` heads; `shared`: `tokens` is a head other prompts began with too."""
        if not self.max_tokens or not MIN_REUSE <= len(tokens) <= self.max_tokens:
            return
        held = tuple(tokens)
        with self.lock:
            self.entries = [
                e for e in self.entries
                if e.salt != salt or e.states is None or shared_head(e.tokens, held) < len(e.tokens)
                or (e.shared and len(e.tokens) < len(held))
            ]  # fmt: skip
            self.entries.append(Entry(held, [], [], salt, cache, shared))
            while self.held_tokens > self.max_tokens:
                self.entries.pop(0)

    def store(
        self, tokens: list[int], cache: DynamicCache, length: int, salt: str = "", scores: tuple | None = None
    ) -> None:
        """Keep the first `length` entries of `cache` (the KV of `tokens[:length]`, batch row 0) for later requests
        with the same `salt` (`keep`), with the log-probability entries of its tokens where it was scored."""
        whole = plain_layers(cache) and bool(cache.layers) and all(layer.is_initialized for layer in cache.layers)
        length = min(length, cache.get_seq_length() if whole else 0)
        layers = [(layer.keys, layer.values) for layer in cache.layers] if whole else []
        # the model's own dtype, where a `RoomyLayer` holds its entries in fp32 (`kvcache.RoomyLayer`'s `upcast`)
        written = next((layer.written for layer in cache.layers if hasattr(layer, "written")), None)
        self.keep(tokens, layers, length, salt, scores, written)

    def keep(
        self,
        tokens: list[int],
        layers: Layers,
        length: int,
        salt: str = "",
        scores: tuple | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Keep the KV of `tokens[:length]`: per layer (keys, values) [rows, kv_heads, >= length, head_dim], or
        every layer's in one tensor [layers, 2, rows, kv_heads, >= length, head_dim] (a static base's buffer), of
        which row 0's first `length` positions are copied (in `dtype` where given: the model's own, for layers held
        in fp32); for later requests with the same `salt`. `scores`: the log-probability entries of the tokens
        (`Entry.scores`).

        An entry that is a head of the new one is replaced by it; a new one that is a head of a held entry adds
        nothing (both under the same salt). Scores go with the text they score: the longer entry keeps the
        longest scores either held."""
        length = min(length, len(tokens)) if len(layers) else 0
        if not self.max_tokens or length < MIN_REUSE or length > self.max_tokens:
            return
        held = tuple(tokens[:length])
        scores = None if scores is None else tuple(scores[:length])
        with self.lock:
            for entry in self.entries:
                if entry.salt == salt and entry.states is None and shared_head(entry.tokens, held) == length:
                    self.entries.remove(entry)
                    self.entries.append(entry)
                    entry.scores = longest(entry.scores, scores)
                    return
        keys, values, block = copied(layers, length, dtype)
        with self.lock:
            heads = [
                e for e in self.entries
                if e.salt == salt and e.states is None and shared_head(e.tokens, held) == len(e.tokens)
            ]  # fmt: skip
            for head in heads:
                scores = longest(scores, head.scores)
            self.entries = [e for e in self.entries if not any(e is head for head in heads)]
            self.entries.append(Entry(held, keys, values, salt, block=block, scores=scores))
            while self.held_tokens > self.max_tokens:
                self.entries.pop(0)

    def find_scored(self, tokens: list[int], top: int, salt: str = "") -> tuple[Entry | None, int]:
        """The entry stored under `salt` whose scores (with `top` alternatives or more) cover the longest head of
        `tokens[:-1]`, and that head's length; (None, 0) where none covers `MIN_REUSE` tokens or more."""

        def reach(entry: Entry) -> int | None:
            return len(entry.scores) if entry.scores and alternatives(entry.scores) >= top else None

        return self.longest_head(tokens, salt, reach)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


def longest(a: tuple | None, b: tuple | None) -> tuple | None:
    """The longer of two entries' scores (a head's scores are the same values as a longer text's first ones)."""
    return a if len(a or ()) >= len(b or ()) else b


def alternatives(scores: tuple) -> int:
    """How many alternatives each of `scores` carries (the first token's entry is None)."""
    return next((len(entry.top) for entry in scores if entry is not None), 0)


def copied(
    layers: Layers, length: int, dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """Row 0's first `length` keys and values of `layers` (`Layers`), copied (per layer, in `dtype` where given:
    the model's own, for layers kept in fp32): per layer [1, kv_heads, length, head_dim], and the one tensor they
    are views of, where `layers` is one."""
    if not isinstance(layers, torch.Tensor):
        keys = [keys[:1, :, :length].to(dtype or keys.dtype, copy=True) for keys, _ in layers]
        return keys, [values[:1, :, :length].to(dtype or values.dtype, copy=True) for _, values in layers], None
    block = layers[:, :, 0, :, :length].clone()  # [layers, 2, kv_heads, length, head_dim]: one copy, not two a layer
    return [layer[0, None] for layer in block], [layer[1, None] for layer in block], block


@dataclass(frozen=True)
class PrefixScope:
    """A `PrefixCache` as one salt's requests see it: they are seeded only from what was stored under that salt.

    Example (the same text stored under salt "a" is not seen under "b"):
        >>> from transformers import DynamicCache
        >>> prefixes = PrefixCache(max_tokens=100)
        >>> stored = DynamicCache()
        >>> _ = stored.update(torch.ones(1, 2, 5, 8), torch.ones(1, 2, 5, 8), 0)
        >>> prefixes.scoped("a").store([1, 2, 3, 4, 5], stored, 5)
        >>> prompt = [1, 2, 3, 4, 5, 6]
        >>> prefixes.scoped("b").seed(DynamicCache(), prompt), prefixes.scoped("a").seed(DynamicCache(), prompt)
        (0, 5)
    """

    cache: PrefixCache
    salt: str = ""

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens

    def seed(self, cache: DynamicCache, tokens: list[int]) -> int:
        return self.cache.seed(cache, tokens, self.salt)

    def store(self, tokens: list[int], cache: DynamicCache, length: int, scores: tuple | None = None) -> None:
        self.cache.store(tokens, cache, length, self.salt, scores)

    def find_scored(self, tokens: list[int], top: int) -> tuple[Entry | None, int]:
        return self.cache.find_scored(tokens, top, self.salt)

    def find(self, tokens: list[int], layers: int | None = None) -> tuple[Entry | None, int]:
        return self.cache.find(tokens, layers, self.salt)

    def keep(self, tokens: list[int], layers: Layers, length: int) -> None:
        self.cache.keep(tokens, layers, length, self.salt)

    def find_whole(self, tokens: list[int]) -> Entry | None:
        return self.cache.find_whole(tokens, self.salt)

    def whole_copy(self, tokens: list[int]) -> tuple[DynamicCache | None, int]:
        return self.cache.whole_copy(tokens, self.salt)

    def states_head(self, tokens: list[int]) -> int:
        return self.cache.states_head(tokens, self.salt)

    def keep_whole(self, tokens: list[int], cache: DynamicCache, shared: bool = False) -> None:
        self.cache.keep_whole(tokens, cache, self.salt, shared)


Prefixes = PrefixCache | PrefixScope
"""What the engine and batches seed from and store to."""
