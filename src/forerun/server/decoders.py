"""The server's Decoders: shared by all requests of one method (its trie, n-gram pool and cost-model calibration
learn across requests); a request with knobs of its own gets a private Decoder, kept in a small LRU so a flood of
distinct knob sets cannot grow memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from forerun.decoder import Decoder
from forerun.drafters.eagle3 import load_head
from forerun.methods import plan_method
from forerun.prefixcache import PrefixCache

PRIVATE_DECODERS = 8


class DecoderPool:
    def __init__(
        self,
        model,
        tokenizer,
        method: str,
        knobs: dict,
        draft_model=None,
        prefixes=None,
        max_tree_nodes=None,
        draft_head: str | None = None,
        compile_buckets: bool = False,
    ) -> None:
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.compile_buckets = compile_buckets
        """The server's own Decoder (its method and knobs) compiles its tree sizes before capturing them (a CUDA
        device's), in the warm-up. One a request asks for (another method, other knobs) does not: compiling in a
        request's time would hold every stream for minutes."""
        self.head = None if draft_head is None else load_head(draft_head, model)
        """The EAGLE-3 head, read once and shared by every Decoder that drafts with it."""
        self.max_tree_nodes = max_tree_nodes
        """The operator's cap on tokens per forward, for every Decoder of the server (None: the curve's)."""
        self.prefixes = prefixes if prefixes is not None else PrefixCache(0)
        """One prefix cache for every Decoder: the KV of a text is the model's, whichever method drafts."""
        self.method, self.knobs = method, dict(knobs)
        self.shared: dict[str, Decoder] = {}
        self.private: OrderedDict[tuple, Decoder] = OrderedDict()
        self.lock = threading.Lock()

    def build(self, method: str, knobs: dict, compiled: bool = False) -> Decoder:
        plan = plan_method(method, knobs, next(self.model.parameters()).device.type, head=self.head is not None)
        draft = {}
        if plan.needs_draft():
            if self.draft_model is None:
                raise ValueError("method draft_model needs a draft model: start the server with --draft-model NAME")
            draft = {"draft_model": self.draft_model}
        if plan.uses_head():
            if self.head is None:
                raise ValueError("method eagle3 needs an EAGLE-3 head: start the server with --draft-head FOLDER")
            draft["draft_head"] = self.head
        return Decoder(
            self.model, self.tokenizer, method, prefix_cache=self.prefixes, max_tree_nodes=self.max_tree_nodes,
            compile_buckets=compiled, **draft, **knobs
        )  # fmt: skip

    def get(self, method: str, knobs: dict) -> Decoder:
        """The shared Decoder of `method` (with the server's knobs for its own method), or a private one."""
        with self.lock:
            if not knobs or (method == self.method and knobs == self.knobs):
                if method not in self.shared:
                    own = method == self.method
                    self.shared[method] = self.build(method, self.knobs if own else {}, own and self.compile_buckets)
                return self.shared[method]
            key = (method, tuple(sorted((k, repr(v)) for k, v in knobs.items())))
            if key not in self.private:
                self.private[key] = self.build(method, knobs)
                while len(self.private) > PRIVATE_DECODERS:
                    self.private.popitem(last=False)
            self.private.move_to_end(key)
            return self.private[key]

    def trie_decoder(self) -> Decoder | None:
        """The shared Decoder whose trie the cache file holds (the server's own method, if it has a trie)."""
        if not plan_method(self.method, self.knobs, head=self.head is not None).saves_state():
            return None
        return self.get(self.method, {})
