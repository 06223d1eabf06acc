"""The methods a benchmark run compares: forerun method expressions with their knobs, and other runtimes' calls.

Example:
    >>> [(m.method, m.knobs) for m in parse_methods("plain,jacobi[window=4],hf_prompt_lookup")]
    [('plain', {}), ('jacobi', {'window': 4}), ('hf_prompt_lookup', {})]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from forerun.bench.peers import PEER_METHODS
from forerun.methods import METHODS, parse_knob_pairs, plan_method

HF_METHODS = ("hf_prompt_lookup", "hf_assisted")
OTHER_METHODS = HF_METHODS + PEER_METHODS
"""Methods that are not forerun's: their knobs are not forerun knobs, no Decoder is built for them."""


BENCH_PREFIX_TOKENS = 4096
"""The prefix cache a benchmarked method's decoder keeps (tokens): the size its figures were first taken with
(its prompts are short: only their chat template's head is read again)."""


@dataclass(frozen=True)
class BenchMethod:
    label: str
    method: str
    knobs: dict = field(default_factory=dict)
    max_tree_nodes: int | None = None
    warm: int = 0
    """Before timing, let the decoder answer this many other prompts per dataset (a warm trie or pool)."""
    adaptive: bool | None = None
    predict: bool = False
    """Pass each prompt's prediction (the `edit` dataset's original code) to `generate(prediction=...)`."""
    prefix_cache: int = BENCH_PREFIX_TOKENS
    """The decoder's prefix cache in tokens (`auto[prefix_cache=0]`: every prompt prefilled in full, as generate)."""

    def needs_draft(self) -> bool:
        return self.method == "hf_assisted" or (
            self.method not in OTHER_METHODS and plan_method(self.method, self.knobs, head=True).needs_draft()
        )

    def reads_head(self, given: bool) -> bool:
        """Whether this method drafts with an EAGLE-3 head (eagle3; also auto when one is `given`)."""
        if self.method in OTHER_METHODS:
            return False
        return plan_method(self.method, self.knobs, head=given).uses_head()


def parse_methods(text: str) -> list[BenchMethod]:
    """'plain,jacobi[window=7,ngram=5],auto' -> methods; raises ValueError naming an unknown method or knob."""
    specs = []
    for label in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text):
        label = label.strip()
        name, _, rest = label.partition("[")
        knobs = parse_knob_pairs([p for p in rest.rstrip("]").split(",") if p]) if rest else {}
        nodes = knobs.pop("max_tree_nodes", None)
        warm = knobs.pop("warm", 0)
        adaptive = knobs.pop("adaptive", None)
        predict = bool(knobs.pop("predict", False))
        prefix_cache = knobs.pop("prefix_cache", BENCH_PREFIX_TOKENS)
        if isinstance(prefix_cache, bool) or not isinstance(prefix_cache, int) or prefix_cache < 0:
            raise ValueError(f"{label}: prefix_cache takes a number of tokens >= 0, got {prefix_cache!r}")
        if predict and name in OTHER_METHODS:
            raise ValueError(f"{label}: predict=true is for forerun methods")
        if rest and name in OTHER_METHODS:  # another runtime's call is fixed: a knob would be ignored silently
            raise ValueError(f"{label}: {name} takes no knobs; they are for forerun methods")
        if name not in OTHER_METHODS:
            try:
                plan_method(name, knobs, head=True)  # a head's knobs under 'auto' are checked when it is given
            except ValueError as error:
                raise ValueError(
                    f"unknown benchmark method {name!r} ({error}); choose from {', '.join(METHODS + OTHER_METHODS)}"
                ) from None
        specs.append(BenchMethod(label, name, knobs, nodes, warm, adaptive, predict, prefix_cache))
    if not specs:
        raise ValueError("no methods given")
    return specs
