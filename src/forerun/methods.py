"""The registry of drafting methods, and the method expressions every entry point accepts.

A method expression names one method (`"trie"`), several joined by `+` (`"prompt_lookup+trie"`: their trees are
merged under one root every step), `"auto"` (every model-free method: prompt lookup, trie, Jacobi) or `"plain"`
(no drafter). Knobs address one method: `draft_len=8` when only one is named, `trie.decoding_length=16` (dotted)
when several are combined.

Adding a method is one drafter module that declares `METHOD = MethodSpec(...)` and one line in `REGISTRY` below.

Example:
    >>> plan = plan_method("prompt_lookup+trie", {"trie.decoding_length": 16, "prompt_lookup.draft_len": 6})
    >>> plan.names, plan.config("trie").decoding_length, plan.config("prompt_lookup").draft_len
    (('prompt_lookup', 'trie'), 16, 6)
    >>> plan_method("auto").names
    ('prompt_lookup', 'trie', 'jacobi')
    >>> plan_method("auto", {"draft_len": 6})
    Traceback (most recent call last):
    ...
    ValueError: knob 'draft_len' needs a method prefix when several methods are combined (e.g. prompt_lookup.draft_len)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from forerun.drafters import draft_model, jacobi, prompt_lookup, trie
from forerun.drafters.base import Drafter, MethodSpec
from forerun.drafters.eagle3 import drafter as eagle3

REGISTRY: dict[str, MethodSpec] = {
    spec.name: spec for spec in (prompt_lookup.METHOD, trie.METHOD, jacobi.METHOD, draft_model.METHOD, eagle3.METHOD)
}
"""Every drafting method, in the order their trees are merged under one root."""

PLAIN, AUTO = "plain", "auto"
METHODS: tuple[str, ...] = (PLAIN, *REGISTRY, AUTO)
"""The names a method expression is made of."""


def source_style(source: str) -> str:
    """The rich style of tokens accepted from `source` (a method name; 'model' = the target's own step)."""
    if source == "model":
        return ""
    spec = REGISTRY.get(source)
    return spec.style if spec is not None else "bold yellow"


@dataclass(frozen=True)
class MethodPlan:
    """A parsed method expression: the methods in merge order and one validated config each."""

    text: str
    specs: tuple[MethodSpec, ...]
    configs: tuple[object, ...]
    knobs: Mapping[str, object] = field(default_factory=dict)
    """The knobs it was built with (a plan for a flat curve is built again from them: `for_flat_curve`)."""
    device_type: str = "cpu"

    def for_flat_curve(self) -> MethodPlan:
        """The same methods and knobs over the defaults for a cost model on a flat latency curve."""
        return plan_method(self.text, self.knobs, self.device_type, flat=True)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)

    @property
    def combined(self) -> bool:
        """More than one drafter (a '+' expression or 'auto')."""
        return len(self.specs) > 1

    def config(self, name: str) -> object | None:
        """The config of method `name`, or None when it is not part of the plan."""
        for spec, config in zip(self.specs, self.configs, strict=True):
            if spec.name == name:
                return config
        return None

    @property
    def adaptive(self) -> bool:
        """Whether the cost model chooses each step's tree by default: for combinations, and for a single method
        that asks for it (every model-free one)."""
        return bool(self.specs) and (self.combined or all(spec.adaptive for spec in self.specs))

    def uses_model(self) -> bool:
        """Whether some method of the plan drafts with a second model (given, loaded, or the target's own layers)."""
        return any(not spec.model_free and not spec.reads_head for spec in self.specs)

    def uses_head(self) -> bool:
        """Whether some method of the plan drafts with a trained head (method eagle3)."""
        return any(spec.reads_head for spec in self.specs)

    def with_head(self) -> MethodPlan:
        """'auto' (or a combination with it) given a head: the same plan with eagle3 added; otherwise itself."""
        if self.uses_head() or AUTO not in [part.strip() for part in self.text.split("+")]:
            return self
        return plan_method(self.text, self.knobs, self.device_type, head=True)

    def saves_state(self) -> bool:
        """Whether some method of the plan keeps state a Decoder can save and load."""
        return any(spec.saves_state for spec in self.specs)

    def model_config(self) -> object | None:
        """The config of the plan's method that drafts with a second model, if any."""
        for spec, config in zip(self.specs, self.configs, strict=True):
            if not spec.model_free and not spec.reads_head:
                return config
        return None

    def needs_draft(self) -> bool:
        """Whether some method of the plan drafts with a second model the caller must supply."""
        return any(spec.needs_draft(config) for spec, config in zip(self.specs, self.configs, strict=True))

    def build(self, draft: object | None = None, vocab: int = 0, head: object | None = None) -> list[Drafter]:
        """Fresh drafters, one per method (a head-reading method gets `head` where others get the draft model)."""
        return [
            spec.build(config, head if spec.reads_head else draft, vocab)
            for spec, config in zip(self.specs, self.configs, strict=True)
        ]

    def static_budget(self) -> int:
        """Nodes per forward (root included) that the methods ask for together: the root plus each one's drafts."""
        return 1 + sum(spec.budget(config) - 1 for spec, config in zip(self.specs, self.configs, strict=True))

    def min_budget(self) -> int:
        return max((spec.min_budget(config) for spec, config in zip(self.specs, self.configs, strict=True)), default=1)


def parse_method(text: str) -> tuple[MethodSpec, ...]:
    """'prompt_lookup+trie' -> their specs; 'auto' -> every model-free one; 'plain' -> (). Bad names raise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"method must be a name like 'trie' or 'prompt_lookup+trie', got {text!r}")
    parts = [part.strip() for part in text.split("+")]
    if parts == [PLAIN]:
        return ()
    names: list[str] = []
    for part in parts:
        if part == AUTO:
            expanded = [name for name, spec in REGISTRY.items() if spec.model_free]
        elif part in REGISTRY:
            expanded = [part]
        elif part == PLAIN:
            raise ValueError(f"'plain' means no drafter and cannot be combined with others (in {text!r})")
        else:
            raise ValueError(
                f"unknown method {part!r} in {text!r}; choose one of {', '.join(METHODS)} or join them with +"
            )
        for name in expanded:
            if name in names:
                where = " (it is part of 'auto')" if AUTO in parts else ""
                raise ValueError(f"method {name!r} appears twice in {text!r}{where}")
            names.append(name)
    return tuple(REGISTRY[name] for name in names)


def split_knobs(specs: Sequence[MethodSpec], knobs: Mapping[str, object], text: str) -> dict[str, dict[str, object]]:
    """Route knobs to methods: 'trie.decoding_length' to trie; an undotted knob only when one method is named."""
    routed: dict[str, dict[str, object]] = {spec.name: {} for spec in specs}
    for key, value in knobs.items():
        method, dot, knob = str(key).rpartition(".")
        if not dot:
            if not specs:
                raise ValueError(f"method 'plain' takes no knobs, got {sorted(knobs)}")
            if len(specs) > 1:
                raise ValueError(
                    f"knob {key!r} needs a method prefix when several methods are combined (e.g. {specs[0].name}.{key})"
                )
            method, knob = specs[0].name, key
        if method not in routed:
            hint = ""
            if method in REGISTRY and REGISTRY[method].reads_head and AUTO in [p.strip() for p in text.split("+")]:
                hint = " ('auto' drafts with a head only when one is given: draft_head=FOLDER, --draft-head)"
            raise ValueError(f"knob {key!r} is for method {method!r}, which is not part of {text!r}{hint}")
        routed[method][knob] = value
    return routed


def plan_method(
    text: str,
    knobs: Mapping[str, object] | None = None,
    device_type: str = "cpu",
    flat: bool = False,
    head: bool = False,
) -> MethodPlan:
    """Parse `text`, route `knobs`, and build each method's config over its defaults for `device_type` (and,
    `flat=True`, for a cost model on a flat latency curve: see `device_defaults`). `head=True`: a trained head is
    given, so 'auto' drafts with it too, and the head's knobs route to it.

    Knobs the caller gives always win over device defaults; unknown knobs raise a ValueError naming them.

    Example:
        >>> plan_method("auto", {"eagle3.depth": 3}, head=True).names
        ('prompt_lookup', 'trie', 'jacobi', 'eagle3')
    """
    if head and isinstance(text, str):
        text = head_added(text)
    specs = parse_method(text)
    routed = split_knobs(specs, knobs or {}, text)
    configs = []
    for spec in specs:
        known = {f.name for f in fields(spec.config)}
        unknown = sorted(set(routed[spec.name]) - known)
        if unknown:
            raise ValueError(f"unknown knob(s) {unknown} for method {spec.name!r}; known: {sorted(known)}")
        defaults = device_defaults(spec.name, device_type, flat)
        configs.append(spec.config(**{**defaults, **routed[spec.name]}))
    return MethodPlan(text.strip(), specs, tuple(configs), dict(knobs or {}), device_type)


def head_added(text: str) -> str:
    """'auto' (alone or combined) with the head-reading method added, when the expression does not name one.

    Example:
        >>> head_added("auto"), head_added("auto+eagle3"), head_added("trie")
        ('auto+eagle3', 'auto+eagle3', 'trie')
    """
    parts = [part.strip() for part in text.split("+")]
    if AUTO not in parts or any(part in REGISTRY and REGISTRY[part].reads_head for part in parts):
        return text
    return "+".join([*parts, *(name for name, spec in REGISTRY.items() if spec.reads_head)])


def device_defaults(method: str, device_type: str, flat: bool = False) -> dict[str, object]:
    """The default knobs of `method` on a device kind ("cpu", "cuda", ...; unknown kinds get the CPU defaults);
    `flat`: under a cost model whose latency curve is flat (`LatencyCurve.flat`), the method's "flat" defaults
    first, the device kind's own over them.

    Example:
        >>> device_defaults("jacobi", "cuda")
        {'window': 7, 'ngram': 5, 'max_candidates': 7, 'pool_from_output': False, 'lazy_window': False}
        >>> device_defaults("jacobi", "cpu"), device_defaults("trie", "cpu", flat=True)
        ({}, {'decoding_length': 64, 'branch_length': 16})
    """
    spec = REGISTRY[method]
    return {**(spec.device_defaults.get("flat", {}) if flat else {}), **spec.device_defaults.get(device_type, {})}


def parse_knob_pairs(pairs: Sequence[str]) -> dict[str, object]:
    """['draft_len=8', 'trie.pool_policy=fifo', 'pool_from_prompt=false'] -> typed keyword arguments.

    Example:
        >>> parse_knob_pairs(["draft_len=8", "trie.prompt_weight=0.5", "lazy_window=false"])
        {'draft_len': 8, 'trie.prompt_weight': 0.5, 'lazy_window': False}
    """
    knobs: dict[str, object] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"knob {pair!r} is not NAME=VALUE")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    continue
        knobs[name] = value
    return knobs
