"""Tool calls as Qwen3.5's and Qwen3-Coder's templates teach them: XML in a `<tool_call>` block, each argument in a
`<parameter=...>` element of its own, its value as text (a string as it is, an object or a list as JSON):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

`xml_call` reads a block's call back (each value typed by the function's schema: "7" is 7 where the parameter is
an integer, "7" where it is a string); `xml_rules` is the grammar a required call is held to (the parameters in
the schema's order, a string's value any text up to its closing tag: its length and pattern are not held).

Example:
    >>> schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
    >>> xml_call("\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n", schemas)
    ('get_weather', {'city': 'Paris'})
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence

from forerun.tool_specs import FUNCTION, functions_of

CALL = re.compile(r"\s*<function=([A-Za-z0-9_-]{1,64})>\n(.*?)</function>\s*", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]{1,256})>\n(.*?)\n</parameter>\n?", re.S)


def xml_call(body: str, names: Collection[str]) -> tuple[str, dict] | None:
    """(name, arguments) of the call in one block's XML (`names`: the tools offered, or a mapping of their names to
    their parameters' schemas, which type each value), or None where it is not that."""
    call = CALL.fullmatch(body)
    if call is None:
        return None
    properties = properties_of(names, call.group(1))
    arguments, at, inner = {}, 0, call.group(2)
    for parameter in PARAMETER.finditer(inner):
        if inner[at : parameter.start()].strip():
            return None
        arguments[parameter.group(1)] = typed(parameter.group(2), properties.get(parameter.group(1)))
        at = parameter.end()
    if inner[at:].strip():
        return None
    return call.group(1), arguments


def properties_of(names: Collection[str], name: str) -> Mapping:
    """Function `name`'s parameters' schemas by key, where `names` maps the tools to their parameters' schemas
    (else none known: {})."""
    schema = names.get(name) if isinstance(names, Mapping) else None
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    return properties if isinstance(properties, Mapping) else {}


def typed(value: str, schema: object) -> object:
    """A parameter's text as its schema's type says (a string as written; a number, a truth value, null, an object
    or a list read; without a type, JSON where it reads as such, else the text)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string":
        return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind == "null" and value.strip() in ("null", "None"):
        return None
    try:
        read = json.loads(value)
    except (ValueError, RecursionError):
        return value
    return value if kind is None and isinstance(read, str) else read


def xml_rules(tools: Sequence[dict], name: str | None) -> str:
    """The grammar of one XML call (`xcall`) of function `name` (or of any of `tools`): its parameters in the
    schema's order (the required ones always, the others maybe), each value held to its type."""
    calls, rules = [], []
    for i, function in enumerate(functions_of(tools, name)):
        opening = json.dumps(f"{FUNCTION}{function['name']}>\n")
        if "parameters" not in function:  # any arguments (a function not strict, beside strict ones)
            rules.append(f"any{i}[stop={json.dumps(END)}]: /(?s:.*)/")
            calls.append(f'{opening} ("<parameter=" /[^>\\n]{{1,256}}/ ">\\n" any{i})* "</function>"')
            continue
        schema = function.get("parameters") or {}
        required = set(schema.get("required", []))
        items = []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            tag = json.dumps(f"<parameter={key}>\n", ensure_ascii=False)
            rules.append(f"p{i}_{j}: {tag} {value_rule(f'v{i}_{j}', prop, rules)}")
            items.append(f"p{i}_{j}" + ("" if key in required else "?"))
        calls.append(f'{opening} {" ".join(items)} "</function>"')
    return "\n".join([f"xcall: {' | '.join(calls)}", *rules])


END = "\n</parameter>\n"


def value_rule(rule: str, schema: object, rules: list[str]) -> str:
    """The grammar of one parameter's value and its closing tag, by the parameter's type (a rule `rule` added to
    `rules`)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    end = json.dumps(END)
    values = schema.get("enum") if isinstance(schema, Mapping) else None
    if isinstance(values, list) and values and all(isinstance(value, str) for value in values):  # written bare
        return f"({' | '.join(json.dumps(value, ensure_ascii=False) for value in values)}) {end}"
    if kind in ("integer", "number", "object", "array") or (isinstance(schema, Mapping) and "enum" in schema):
        held = {**schema, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"{rule}: %json {json.dumps(held, ensure_ascii=False)}")
        return f"{rule} {end}"
    if kind == "boolean":
        return f'("true" | "false" | "True" | "False") {end}'
    if kind == "null":
        return f'("null" | "None") {end}'
    # any text up to the closing tag (a length bound there made llguidance's lexer give up on masks)
    rules.append(f"{rule}[stop={end}]: /(?s:.*)/")
    return rule
