"""Structured output: answers held to JSON, or to a JSON schema (OpenAI's `response_format`).

`response_format={"type": "json_object"}` asks for an answer that is one JSON object;
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` for one that matches the schema. forerun
holds the answer to it as vLLM and SGLang do: before each token is chosen, every token that could not continue a
valid answer is masked (its logit set to -inf), and once the JSON is complete only an end-of-text token is left.
llguidance computes the masks (the schema compiled to a grammar, parsed over the tokenizer's tokens, with a cap on
each step's work, so no schema can stall a server). The mask is a logits processor like any other, a function of
the row's own answer so far: plain `model.generate(logits_processor=[constraint])` writes exactly what every forerun
method writes with it. A drafted guess that breaks the grammar could never be accepted (the verifier takes the
target's masked choice): it leaves the tree before the cost model chooses what to feed (`Constraint.pruned`).

Example (the checks a request makes; then, with a tokenizer, a request's mask):
    >>> check_response_format({"type": "json_object"})
    {'type': 'json_object'}
    >>> check_response_format({"type": "text"}) is None
    True
    >>> check_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}})
    Traceback (most recent call last):
    ...
    ValueError: response_format's json_schema.schema must be a JSON object, got '{}'
    >>> grammars = Grammars(tokenizer, 49152, end_token=2)                                       # doctest: +SKIP
    >>> constraint = grammars.constraint(response_format, prompt_length=5, ends=frozenset({2}))     # doctest: +SKIP
    >>> constraint(ids, scores)     # ids [k, 5 + answer], scores [k, vocab]: disallowed tokens -inf  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from transformers import LogitsProcessor

from forerun.checks import MAX_DEPTH, check_text, nesting
from forerun.thoughts import thought_terms
from forerun.tool_grammar import calls_grammar, thought_rules
from forerun.tool_specs import CallForm, call_form, call_mark, templates
from forerun.tree import TokenTree

logger = logging.getLogger(__name__)
FORMATS = ("text", "json_object", "json_schema")
"""OpenAI's `response_format` types: free text (no constraint), any JSON object, JSON matching a schema."""
UNHELD = "response_format's schema is not one forerun can hold an answer to"
UNHELD_CALLS = "a tool's parameters are not a schema forerun can hold a call to"
MAX_COMPILED = 32
"""Compiled formats a Decoder keeps (a server's clients tend to send the same few schemas)."""
MAX_ERROR = 300
"""Characters of llguidance's message kept in an error (its messages can quote the whole schema)."""


def check_response_format(value: object) -> dict[str, Any] | None:
    """`value` as a plain JSON copy, None where it asks for free text; a ValueError naming what is wrong otherwise
    (an unknown type or key, a schema that is not a JSON object, nesting past MAX_DEPTH). Whether the schema
    compiles is found when it is compiled (`Grammars.compile`), off a server's event loop."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"response_format must be an object such as {{'type': 'json_object'}}, got {value!r:.60}")
    kind = value.get("type")
    if kind not in FORMATS:
        raise ValueError(f"response_format's type must be one of {', '.join(FORMATS)}, got {kind!r:.60}")
    allowed = {"type"} | ({"json_schema"} if kind == "json_schema" else set())
    if extra := sorted(set(value) - allowed):
        raise ValueError(f"response_format of type {kind} takes no {', '.join(map(str, extra))}")
    if kind == "text":
        return None
    if (depth := nesting(value)) > MAX_DEPTH:
        raise ValueError(f"response_format nests {depth} levels deep; at most {MAX_DEPTH}")
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"response_format must be plain JSON: {error}") from None
    check_text("response_format", text)  # a lone surrogate: no text an answer could hold, nor one llguidance reads
    plain = json.loads(text)
    if kind == "json_schema":
        check_schema_entry(plain.get("json_schema"))
    return plain


def check_schema_entry(entry: object) -> None:
    """OpenAI's `json_schema` object: a name, the schema (a JSON object), optionally a description and `strict`
    (the answer is always held to the schema here, whatever `strict` says)."""
    if not isinstance(entry, dict):
        raise ValueError("response_format of type json_schema needs json_schema: {'name': ..., 'schema': {...}}")
    if extra := sorted(set(entry) - {"name", "schema", "description", "strict"}):
        raise ValueError(f"response_format's json_schema takes no {', '.join(extra)}")
    if not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ValueError("response_format's json_schema needs a name (a non-empty string)")
    if not isinstance(entry.get("schema"), dict):
        raise ValueError(f"response_format's json_schema.schema must be a JSON object, got {entry.get('schema')!r:.60}")
    if not isinstance(entry.get("strict", False), bool):
        raise ValueError("response_format's json_schema.strict must be true or false")


def grammar_of(
    response_format: Mapping[str, Any],
    form: CallForm | None = None,
    thought: tuple[str, ...] = (),
    opened: bool = False,
) -> str:
    """llguidance's grammar for a checked JSON format (any JSON object, or the given schema), or for a request's
    required tool calls ({"type": "tool_calls", "tools", "name", "parallel"} and "lazy" for strict ones under
    tool_choice auto: `GenerationRequest.held_format`, in the chat template's `form`:
    `forerun.tool_grammar.calls_grammar`). `thought`: a reasoning model's thought marks as grammar terms (`<[id]>`):
    the JSON may follow a free thought, as vLLM holds only the answer after it; `opened`: the prompt opened the
    thought, which the answer closes before its JSON."""
    from llguidance import LLMatcher

    if response_format["type"] == "tool_calls":
        tools, name, parallel = response_format["tools"], response_format["name"], response_format["parallel"]
        lazy = response_format.get("lazy", False)
        return LLMatcher.grammar_from_lark(calls_grammar(tools, name, parallel, form or CallForm(), lazy))
    schema = (
        {"type": "object"} if response_format["type"] == "json_object" else response_format["json_schema"]["schema"]
    )
    if not thought:
        return LLMatcher.grammar_from_json_schema(schema)
    start = "closing data" if opened else "thinking? data"
    lark = f"start: {start}\ndata: %json {json.dumps(schema, ensure_ascii=False)}\n{thought_rules(thought)}\n"
    return LLMatcher.grammar_from_lark(lark)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share, found by comparing slices (C-speed, O(log n) of them: a tree's
    rows share a long answer and differ near its end).

    Example:
        >>> shared_prefix([1, 2, 3, 4], [1, 2, 5]), shared_prefix([1, 2], [1, 2, 3]), shared_prefix([], [7])
        (2, 2, 0)
    """
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # the shared length lies in [low, high]
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def cut(message: str) -> str:
    """`message` cut to MAX_ERROR characters."""
    return message if len(message) <= MAX_ERROR else message[:MAX_ERROR] + "..."


class Grammars:
    """A Decoder's tokenizer as llguidance reads it, built at the first constrained request (a few tenths of a
    second for a 49k vocabulary) and shared by every request after it.

    `vocab_size`: the model's output width (a model may have more logits than its tokenizer has tokens: those
    ids are never allowed); `end_token`: the id llguidance marks as the end of an answer (the model's first EOS),
    stood in for, in each request, by that request's own EOS ids."""

    def __init__(self, tokenizer: object, vocab_size: int, end_token: int | None) -> None:
        self.tokenizer, self.vocab_size, self.end_token = tokenizer, vocab_size, end_token
        self.read: object | None = None  # llguidance's LLTokenizer, once built
        self.compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> a matcher at an answer's start
        self.lock = threading.Lock()
        self.forms: dict[tuple[str, ...], CallForm] = {}  # chat templates -> how they write calls (reads every token)
        self.marks: dict[tuple[str, ...], int | None] = {}  # chat templates -> their calls' opening mark

    def tokens(self) -> object:
        """The LLTokenizer (built once; a ValueError where the tokenizer is not a fast one)."""
        if self.read is None:
            from llguidance.hf import from_tokenizer

            if self.tokenizer is None or self.end_token is None:
                raise ValueError("response_format needs the model's tokenizer and an end-of-text token")
            try:
                self.read = from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.end_token)
            except ValueError as error:
                raise ValueError(f"response_format needs a fast (Rust) tokenizer: {error}") from None
        return self.read

    def compile(self, response_format: Mapping[str, Any], prompt: Sequence[int] | None = None) -> object:
        """A matcher at an answer's start for a checked `response_format` (a ValueError where its schema does not
        compile): built once, then kept for the next MAX_COMPILED formats asked for. Compiling a large schema takes
        up to about half a second with the GIL released: a server calls this off its event loop and its batch's
        thread, so the row built there finds it ready. `prompt` (its ids): whether it leaves a thought open decides
        whether a required call must close it first (the template's default prompt decides where it is not given;
        a request's `chat_template_kwargs` may change it, as Qwen3.5's `enable_thinking`)."""
        from llguidance import LLMatcher

        thought, opened = thought_terms(self.tokenizer, self.tokens().is_special_token, prompt)
        form = None
        if response_format["type"] == "tool_calls":  # the form's thought, opened or not by this prompt
            form = replace(self.call_form(), opened=opened)
        grammar = grammar_of(response_format, form, thought, opened)
        with self.lock:
            tokens = self.tokens()
            if grammar in self.compiled:
                self.compiled.move_to_end(grammar)
                return self.compiled[grammar]
        matcher = LLMatcher(tokens, grammar, log_level=0)
        if matcher.is_error():
            unheld = UNHELD if response_format["type"] != "tool_calls" else UNHELD_CALLS
            raise ValueError(f"{unheld}: {cut(matcher.get_error())}")
        with self.lock:
            self.compiled[grammar] = matcher
            while len(self.compiled) > MAX_COMPILED:
                self.compiled.popitem(last=False)
        return matcher

    def call_form(self) -> CallForm:
        """How the tokenizer's chat template writes calls (`forerun.tool_specs.call_form`: it reads every token),
        kept per template."""
        key = tuple(templates(self.tokenizer))
        if key not in self.forms:
            self.forms[key] = call_form(self.tokenizer, self.tokens().is_special_token, self.vocab_size, self.end_token)
        return self.forms[key]

    def call_mark(self) -> int | None:
        """`forerun.tool_specs.call_mark` (it renders a probe call through the template), kept per template."""
        key = tuple(templates(self.tokenizer))
        if key not in self.marks:
            self.marks[key] = call_mark(self.tokenizer)
        return self.marks[key]

    def constraint(
        self,
        response_format: Mapping[str, Any],
        prompt_length: int,
        ends: frozenset[int],
        prompt: Sequence[int] | None = None,
    ) -> Constraint:
        """The processor holding one request's answer to `response_format` (checked by `check_response_format`);
        `ends`: the request's EOS ids, which end the answer once the JSON is complete (none: a ValueError, as the
        answer could then never end where the JSON does); `prompt`: its ids (`compile`)."""
        if not ends:
            held = "a required or strict tool call" if response_format["type"] == "tool_calls" else "response_format"
            raise ValueError(f"{held} needs an end-of-text token to end the answer; this request has none")
        return Constraint(self.compile(response_format, prompt), prompt_length, ends, self.end_token)


class Constraint(LogitsProcessor):
    """Masks (-inf) every token that cannot continue a row's answer within the grammar; once the answer is complete,
    every token but the request's EOS ids. Each row of scores is computed from its own row of ids alone (a node of
    a tree scored as a row gets what it gets alone: `forerun.draws.ROW_WISE`); a row whose ids already break the
    grammar (a drafted node past a rejected guess, never kept) is left as it is.

    One llguidance matcher follows the rows asked about: rolled back to the longest prefix it shares with the next
    row, then advanced, so a tree's siblings and a walk down its accepted path cost a token or two each."""

    def __init__(self, start: object, prompt_length: int, ends: frozenset[int], end_token: int) -> None:
        self.start, self.prompt_length = start, prompt_length  # start: a compiled matcher, copied, never moved
        self.ends, self.end_token = sorted(ends), end_token
        self.end_set = frozenset(ends)
        self.matcher = self.fresh()
        self.consumed: list[int] = []
        self.limited = False  # told once: the grammar met llguidance's work limits

    def fresh(self) -> object:
        """A matcher of its own at the answer's start (a copy: the compiled one is shared)."""
        return self.start.deep_copy()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids [rows, prompt + answer], scores [rows, vocab] -> the masked scores [rows, vocab], a new tensor."""
        allowed = torch.ones(scores.shape, dtype=torch.bool)
        for row, ids in enumerate(input_ids[:, self.prompt_length :].tolist()):
            mask = self.allowed_after(ids)
            if mask is not None:
                width = min(mask.shape[0], scores.shape[1])
                allowed[row, :width] = mask[:width]
                allowed[row, width:] = False
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def allowed_after(self, answer: list[int]) -> torch.Tensor | None:
        """Which tokens may follow `answer` [vocab] bool, or None where the answer itself breaks the grammar."""
        state = self.follow(self.as_read(answer))
        if state == "refused":
            return None
        bias = self.matcher.compute_logit_bias() if state == "held" else b""
        if state == "limit" or self.matcher.is_error():  # past llguidance's work limits: the answer ends here
            if not self.limited:
                self.limited = True
                logger.warning("forerun: response_format's schema met llguidance's work limits after %d tokens; "
                               "the answer ends there (%s)", len(answer), cut(self.matcher.get_error()))  # fmt: skip
            allowed = torch.zeros(max(self.ends) + 1, dtype=torch.bool)
            allowed[self.ends] = True
            return allowed
        allowed = torch.frombuffer(bytearray(bias), dtype=torch.uint8) > 0
        may_end = bool(allowed[self.end_token])
        allowed[self.end_token] = False  # the model's EOS as such; the request's own EOS ids stand for it
        allowed[self.ends] = may_end
        return allowed

    def pruned(self, tree: TokenTree, answer: Sequence[int]) -> TokenTree:
        """`tree` without the guesses the grammar refuses, and what hangs under them: the target's choice is masked,
        so they could never be kept, and a node fed for them would be wasted. `answer`: the tokens written so far
        (the tree's root the last of them). Nodes other than candidates (probes) stay.

        Example: after `{"n` under a schema whose one key is "name", a tree root ─ a ─ m and root ─ x keeps a ─ m."""
        if len(tree) == 1:
            return tree
        paths, kept = {0: self.as_read(answer)}, [0]
        for node in range(1, len(tree)):
            parent = paths.get(tree.parents[node])
            if parent is None:  # under a refused guess
                continue
            token = tree.tokens[node]
            path = [*parent, self.end_token if token in self.end_set else token]
            if tree.roles[node] != "candidate" or self.follow(path) == "held":
                paths[node] = path
                kept.append(node)
        return tree if len(kept) == len(tree) else tree.subtree(kept)[0]

    def as_read(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` as llguidance reads them: the request's EOS ids as its end token (the check for one runs at
        C speed: an answer holds one at most at its end)."""
        if self.end_set.isdisjoint(tokens):
            return list(tokens)
        return [self.end_token if token in self.end_set else token for token in tokens]

    def follow(self, tokens: list[int]) -> Literal["held", "refused", "limit"]:
        """Bring the matcher to `tokens` (the answer, EOS as llguidance's end token): "held" where it is there,
        "refused" where a token breaks the grammar (the matcher then holds the longest valid prefix), "limit" where
        llguidance's work limits stopped it (it then consumes no more, erring or not: a token its own mask allows
        but it would not take tells)."""
        if self.matcher.is_error():  # left by an earlier row: start again from the answer's start
            self.matcher, self.consumed = self.fresh(), []
        common = shared_prefix(self.consumed, tokens)
        if common < len(self.consumed) and not self.matcher.rollback(len(self.consumed) - common):
            self.matcher, common = self.fresh(), 0
        self.consumed = self.consumed[:common]
        rest = tokens[common:]
        valid = self.matcher.try_consume_tokens(rest) if rest else 0  # stops at a token it does not take
        self.consumed += rest[:valid]
        if valid == len(rest):
            return "held"
        if rest[valid] == self.end_token:  # an answer that has ended: never extended
            return "refused"
        bias = self.matcher.compute_logit_bias()
        return "limit" if self.matcher.is_error() or bias[rest[valid]] else "refused"

    def __repr__(self) -> str:
        return f"Constraint(prompt={self.prompt_length}, ends={self.ends})"
