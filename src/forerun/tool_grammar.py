"""The llguidance (Lark) grammar an answer of tool calls is held to, in the form its chat template writes calls
(`forerun.tool_specs.CallForm`): where a call is required, or, under tool_choice auto with a `strict` function,
from where the answer opens one (`lazy_start`).

Example:
    >>> from forerun.tool_specs import check_tools
    >>> tools = check_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    ...     "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    >>> print("\\n".join(calls_grammar(tools, "get_weather", parallel=False).splitlines()[:2]))
    start: "<tool_call>" "\\n" call "\\n" "</tool_call>"
    block: "<tool_call>" "\\n" call "\\n" "</tool_call>"
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from forerun.tool_pythonic import pythonic_rules
from forerun.tool_specs import CallForm, functions_of
from forerun.tool_xml import xml_rules


def calls_grammar(
    tools: Sequence[dict], name: str | None, parallel: bool, form: CallForm | None = None, lazy: bool = False
) -> str:
    """llguidance's Lark grammar of an answer that is only calls: of function `name` (one), or of any of `tools`
    (None: one, or several where `parallel` and the form writes several), each `{"name": ..., "arguments": ...}`
    with the arguments held to the function's parameters, written in the template's `form` (one list in one block,
    a block each, one per line, one bare object whose arguments are its "parameters", each call's name between
    marks before its arguments: "named", or a Python list of calls between marks: "pythonic"). The JSON is written as
    `json.dumps` and the templates' `tojson` write it (no room for a model to spin whitespace until its answer's
    end). `lazy`: free text until the answer opens a call, held from there (`lazy_start`); `form` None: `CallForm()`."""
    form = form or CallForm()  # the block form's defaults
    schema = {**call_schema(tools, name, form), "x-guidance": JSON_AS_DUMPED}
    call = f"call: %json {json.dumps(schema, ensure_ascii=False)}"
    several = parallel and name is None and form.kind != "json"
    lead, trail = (f"{json.dumps(gap)} " if gap else "" for gap in form.gaps)
    if form.kind == "json":  # one bare object
        rest, rules = "", call
    elif form.kind == "named":  # a name between marks, then its arguments; each call after its own mark
        rest, rules = (
            "named" + (f" ({form.open} named)*" if several else ""),
            f"{named_rules(tools, name, form)}\n{call}",
        )
    elif form.kind == "pythonic":  # one Python list of calls between marks (LFM2's)
        calls = 'pcall (", " pcall)*' if several else "pcall"
        rest, rules = f'"[" {calls} "]" {form.close}', f"{pythonic_rules(functions_of(tools, name))}\n{call}"
    elif form.listed:  # one list in one block
        calls = 'call (", " call)*' if several else "call"
        rest, rules = f'{lead}"[" {calls} "]" {trail}{form.close}', call
    else:  # a call a block (its JSON, or its XML: Qwen3.5's), one block a line
        one = "xcall" if form.kind == "xml" else "call"
        rest = f"{lead}{one} {trail}{form.close}" + (' ("\\n" block)*' if several else "")
        rules = f"block: {form.open} {lead}{one} {trail}{form.close}\n{call}"
        rules += f"\n{xml_rules(tools, name)}" if form.kind == "xml" else ""
    if lazy:
        body, lexemes = lazy_start(form, rest, several)
    else:
        body, lexemes = ("call" if form.kind == "json" else f"{form.open} {rest}"), ""
    if form.thinks:  # a thought first, free, as a reasoning model writes one; one the prompt opened closes first
        # (or, free, goes on to the answer's end)
        start = (f"closing ({body})" + (" | THOUGHT" if lazy else "")) if form.opened else f"thinking? ({body})"
        return f"start: {start}\n{thought_rules(form.thought)}\n{lexemes}{rules}\n"
    return f"start: {body}\n{lexemes}{rules}\n"


def thought_rules(thought: tuple[str, ...]) -> str:
    """A reasoning model's thought before its answer: free text between its own marks (`<think>` and `</think>`,
    or `[THINK]` and `[/THINK]`: `thought`, their grammar terms), then a few spaces or line breaks at most (the
    "\\n\\n" models write there; no room to spin whitespace until the answer's end, as `JSON_AS_DUMPED` says)."""
    opening, closing = thought
    return (f"thinking: {opening} closing\nclosing: THOUGHT? {closing} BREAK?\nTHOUGHT: /(?s:.+)/\n"
            "BREAK: /[ \\t\\r\\n]{1,4}/")  # fmt: skip


def lazy_start(form: CallForm, rest: str, several: bool) -> tuple[str, str]:
    """(the alternatives an answer starts with, the rules they use) of a lazy calls grammar (OpenAI's `strict`
    functions under tool_choice auto): free text, held to calls from where it opens one, to its end. A call opens at
    the template's mark (text before it free), or, as `forerun.tool_calls.read_calls` reads an answer that is only
    calls, where the answer (after a thought, where the model thinks) begins as JSON: `{`, or a ```json fence (whose
    calls are then written compactly, one a line). Free text may hold the special tokens of `form.specials`
    between its pieces of text."""
    bare = 'call ("\\n" call)*' if several else "call"
    starts = ["free?", f'{bare} | "```json\\n" {bare} "\\n```"']
    not_json, text = r"~/(?s:\s*(\{|```json).*)/", "/(?s:.+)/"  # free text does not begin as JSON
    first, plain, opened = [text, not_json], [text], ""
    if form.kind in ("blocks", "xml") and form.open.startswith('"'):  # the mark as text: free up to where it is
        mark = regex_escaped(json.loads(form.open))
        first.append(f"~/(?s:.*{mark}.*)/")
        plain.append(f"~/(?s:.*{mark}.*)/")
        upto = f"/(?s:.*{mark})/ & ~/(?s:.*{mark}.+)/"
        opened = f"\nOPENED0: {upto} & {not_json}\nOPENED: {upto}"
        starts.append(f"OPENED0 {rest}")
        if form.specials:
            starts.append(f"lead OPENED {rest}")
    elif form.kind != "json":  # a mark of its own token: no text spells it
        starts.append(f"free? {form.open} {rest}")
    some = form.specials  # a bare form's are none
    # pieces of text only apart by a special token: a lexeme ends where it cannot go on, so FIRST PLAIN side by side
    # would let "\n\n" end FIRST and a call's "{" begin PLAIN, free
    free = (
        f"free: FIRST ({some} PLAIN?)* | ({some} PLAIN?)+\nlead: (FIRST? {some}) (PLAIN? {some})*"
        if some
        else "free: FIRST"
    )
    lexemes = f"FIRST: {' & '.join(first)}\nPLAIN: {' & '.join(plain)}{opened}"
    return " | ".join(starts), f"{free}\n{lexemes}\n"


JSON_AS_DUMPED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON written as `json.dumps` and the templates' `tojson` write it: no room to spin whitespace until
the answer's end."""


def named_rules(tools: Sequence[dict], name: str | None, form: CallForm) -> str:
    """The rules of one call in the "named" form: a function's name (`name`'s, or any of `tools`'), the mark
    between, its arguments held to its parameters."""
    chosen = functions_of(tools, name)
    rules = [
        "named: " + " | ".join(f"{json.dumps(f['name'])} {form.between} arguments{i}" for i, f in enumerate(chosen))
    ]
    for i, f in enumerate(chosen):
        schema = {**(f.get("parameters") or {"type": "object"}), "x-guidance": JSON_AS_DUMPED}
        rules.append(f"arguments{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(rules)


def call_schema(tools: Sequence[dict], name: str | None, form: CallForm) -> dict:
    """The JSON schema of one call of function `name` (None: of any of `tools`), in `form`'s keys."""
    chosen = functions_of(tools, name)
    schemas = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, form.arguments: f.get("parameters") or {"type": "object"}},
            "required": ["name", form.arguments],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def regex_escaped(text: str) -> str:
    """`text` as a literal inside an llguidance (Rust) regular expression."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)
