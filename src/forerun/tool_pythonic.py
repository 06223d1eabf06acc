"""Calls written as a Python list of calls with keyword arguments, as LFM2's chat template teaches them, between two
special tokens of the tokenizer's own (which the decoded text drops): `<|tool_call_start|>[get_weather(city="Paris"),
add(a=1, b=2)]<|tool_call_end|>`, words perhaps after them. Such a template lists the tools in the system message
and writes an assistant's earlier calls only as its content, so a conversation's calls go back into the content
in this form (`into_content`).

Reading parses the list with Python's own parser (`ast`) and evaluates only literals (`ast.literal_eval`: strings,
numbers, True/False/None, lists, dicts); anything else (a name, a call inside, a positional argument) is not a
call. A required call's grammar (`pythonic_rules`) holds the function's name and its parameters' names, and each
value to its type's literal (a string in double quotes, an integer, True/False...).

Example:
    >>> pythonic_calls('[get_weather(city="Paris"), add(a=1, b=2.5)]')
    [('get_weather', {'city': 'Paris'}), ('add', {'a': 1, 'b': 2.5})]
    >>> pythonic_calls("[get_weather(Paris)]") is None, list_end('[f(a="]")] Done.')
    (True, 10)
    >>> written([{"function": {"name": "add", "arguments": '{"a": 1, "flag": true}'}}])
    '[add(a=1, flag=True)]'
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
"""What LFM2's calls are written between (special tokens of its tokenizer)."""
TOOL_LIST = "<|tool_list_start|>"
"""What a chat template teaching these calls writes before the tools it lists."""
MAX_CHARACTERS = 100_000
"""Longest list of calls parsed (Python's parser builds a tree of it)."""
PAIRS = {"(": ")", "[": "]", "{": "}"}


def pythonic_calls(text: str) -> list[tuple[str, dict]] | None:
    """(name, arguments) of each call of `text`, a Python list of calls each by a plain name with keyword
    arguments whose values are literals, or None where it is not that (or longer than MAX_CHARACTERS)."""
    if len(text) > MAX_CHARACTERS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {k.arg: json_value(ast.literal_eval(k.value)) for k in node.keywords if k.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if len(arguments) != len(node.keywords):  # a **mapping
            return None
        calls.append((node.func.id, arguments))
    return calls


def json_value(value: object) -> object:
    """A literal as JSON holds it (a tuple as a list); a ValueError for what JSON has no value for (bytes, sets,
    complex numbers, dicts with keys that are not strings, infinities)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: json_value(item) for key, item in value.items()}
    raise ValueError(f"not a JSON value: {type(value).__name__}")


def list_end(text: str) -> int | None:
    """Where the list that `text` opens with "[" ends (the index after its "]"), brackets inside strings skipped;
    None where it does not open with one or never closes."""
    if not text.startswith("["):
        return None
    closing: list[str] = []
    quote, escaped = "", False
    for at, char in enumerate(text[:MAX_CHARACTERS]):
        if quote:
            escaped, quote = (not escaped and char == "\\"), ("" if char == quote and not escaped else quote)
        elif char in "\"'":
            quote = char
        elif char in PAIRS:
            closing.append(PAIRS[char])
        elif closing and char == closing[-1]:
            closing.pop()
            if not closing:
                return at + 1
    return None


def written(calls: Sequence[Mapping]) -> str:
    """OpenAI's call objects (their arguments JSON text, or an object) as the Python list a template teaching these
    calls shows: `[name(key=value, ...)]`."""
    parts = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        parts.append(f"{function['name']}({', '.join(f'{k}={literal(v)}' for k, v in arguments.items())})")
    return f"[{', '.join(parts)}]"


def literal(value: object) -> str:
    """A JSON value as a Python literal (`true` as True, strings in double quotes)."""
    if value is None or isinstance(value, bool):
        return {None: "None", True: "True", False: "False"}[value]
    if isinstance(value, list):
        return f"[{', '.join(literal(item) for item in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def into_content(messages: Sequence[Mapping]) -> list[dict]:
    """`messages` as a template teaching these calls takes them: an assistant's `tool_calls` written at the head of
    its content between the marks (the template shows no `tool_calls`), the rest as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            out.append(dict(message))
            continue
        content = f"{OPEN}{written(calls)}{CLOSE}{message.get('content') or ''}"
        out.append({key: value for key, value in message.items() if key != "tool_calls"} | {"content": content})
    return out


STRING = r'/"(?:[^"\\\x00-\x1f]|\\["\\nrt])*"/'
"""A string literal in double quotes (the escapes Python and JSON read alike), where no schema types it."""
LEXEMES = (
    f"PYSTR: {STRING}\nPYNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n"
    'pyvalue: PYSTR | PYNUM | "True" | "False" | "None" | "[" (pyvalue (", " pyvalue)*)? "]"\n'
    '    | "{" (PYSTR ": " pyvalue (", " PYSTR ": " pyvalue)*)? "}"\n'
    'pyargs: pykey "=" pyvalue (", " pykey "=" pyvalue)*\npykey: /[A-Za-z_][A-Za-z0-9_]*/'
)
"""Python literals of any type, and keyword arguments of any names: the values of a schema forerun does not type
(several types, `anyOf`, an object's own keys), and the arguments of a function that declares no parameters."""


def pythonic_rules(functions: Sequence[Mapping]) -> str:
    """The Lark rules of one call, `pcall`, of any of `functions` (OpenAI's function objects): its name, then in
    parentheses its keyword arguments, each one of its parameters' names (any number of them, in any order) and a
    literal its schema allows (`typed`); a function that declares no parameters takes any keyword arguments."""
    rules = ["pcall: " + " | ".join(f"pcall{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        properties = (function.get("parameters") or {}).get("properties") or {}
        named = [(key, schema) for key, schema in properties.items() if key.isidentifier()]
        opening = json.dumps(f"{function['name']}(")
        if not named:  # no parameters declared (or none a keyword can name)
            rules.append(f'pcall{i}: {opening} {"" if properties else "pyargs? "}")"')
            continue
        required = set((function.get("parameters") or {}).get("required") or ())
        rules.append(f'pcall{i}: {opening} a{i}_0{"" if required & {key for key, _ in named} else "?"} ")"')
        rules.extend(ordered(named, required, f"{i}_"))
        for j, (_, schema) in enumerate(named):
            rules.extend(typed(schema, f"v{i}_{j}"))
    return "\n".join([*rules, LEXEMES])


def ordered(named: Sequence[tuple[str, object]], required: set, tag: str) -> list[str]:
    """Rules of keyword arguments in the schema's order, each at most once, the required ones always: `a{tag}k`
    the arguments from parameter k on with none written before, `n{tag}k` with some written before (each after
    ", ")."""
    rules, last = [], len(named) - 1
    for k in range(last, -1, -1):
        key, skip = json.dumps(named[k][0] + "="), named[k][0] not in required
        optional = not any(name in required for name, _ in named[k + 1 :])  # nothing after must be written
        after = (f" n{tag}{k + 1}" + ("?" if optional else "")) if k < last else ""
        if k > 0:  # the first parameter is never written after another
            rules.append(f'n{tag}{k}: ", " {key} v{tag}{k}{after}' + (f" | n{tag}{k + 1}" if skip and k < last else ""))
        rules.append(f"a{tag}{k}: {key} v{tag}{k}{after}" + (f" | a{tag}{k + 1}" if skip and k < last else ""))
    return rules


def typed(schema: object, rule: str) -> list[str]:
    """The Lark rules of `rule`, a literal that `schema` (one parameter's) allows: its enum's values; a string or a
    number as JSON writes it (which Python reads alike), held to the schema's bounds and length; True or False; an
    array's items typed in turn; any literal where the schema says no single type (an object, several types)."""
    if not isinstance(schema, Mapping):
        return [f"{rule}: pyvalue"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return [f"{rule}: " + " | ".join(json.dumps(literal(value), ensure_ascii=False) for value in schema["enum"])]
    kind = schema.get("type")
    if kind in ("string", "integer", "number"):
        held = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return [f"{rule}: %json {json.dumps(held, ensure_ascii=False)}"]
    if kind == "array":
        item = f"{rule}_item"
        return [f'{rule}: "[" ({item} (", " {item})*)? "]"', *typed(schema.get("items"), item)]
    return [f"{rule}: " + {"boolean": '"True" | "False"', "null": '"None"'}.get(kind, "pyvalue")]
