"""Tools a request offers the model (OpenAI's `tools` and `tool_choice`): checked, shown through the chat template,
and, where a call is required, the grammar its answer is held to.

The model learns of the tools from its chat template (`apply_chat_template(messages, tools=...)`) and writes its
calls in the format the template teaches. forerun reads these (`forerun.tool_calls` reads them back): JSON between
`<tool_call>` and `</tool_call>`, as Qwen2.5, Qwen3, Hermes and SmolLM2 are taught; one bare JSON object whose
arguments are its "parameters", as Llama 3.1-3.3 are (`{"name": "get_weather", "parameters": {"city": "Paris"}}`);
and calls after a special token of the tokenizer's own, read off a probe call the template renders
(`forerun.tool_probe`: Mistral's `[TOOL_CALLS] [...]` and `[TOOL_CALLS]name[ARGS]{...}`). A template that writes
calls no such way teaches another format, and its tools are refused by name (`takes_tools`).

`tool_choice`: "auto" (the model decides: its text is plain generate's, the calls read out of it after; where a
function is `strict`, a call the answer opens is held from there to the end, `forerun.tool_grammar`), "none"
(the tools are not shown), "required" (one or more calls) or {"type": "function", "function": {"name": ...}} (one
call of that function). The last two hold the answer to calls in that format, the arguments to the function's
JSON schema (`forerun.tool_grammar`), as `response_format` holds an answer to JSON (`forerun.structured`): a logits
processor, so plain `model.generate` with it writes the same text.

Example:
    >>> tools = check_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    ...     "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    >>> check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    'get_weather'
    >>> check_tool_choice("required", ())
    Traceback (most recent call last):
    ...
    ValueError: tool_choice 'required' needs tools
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from forerun.checks import MAX_DEPTH, check_text, nesting
from forerun.thoughts import thought_marks, thought_terms
from forerun.tool_probe import Written, probed
from forerun.tool_pythonic import CLOSE as PY_CLOSE
from forerun.tool_pythonic import OPEN as PY_OPEN
from forerun.tool_pythonic import TOOL_LIST

MAX_TOOLS = 128
"""As OpenAI."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function's name, as OpenAI allows it."""
MODES = ("none", "auto", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
"""What the block format's calls are written between."""
FUNCTION = "<function="
"""What a chat template teaching XML calls writes (Qwen3.5's, Qwen3-Coder's: `forerun.tool_xml`)."""
PARAMETERS = '"parameters": '
"""What a chat template teaching Llama 3's JSON calls writes before an assistant call's arguments."""
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def check_tools(tools: object) -> tuple[dict, ...]:
    """`tools` as plain JSON copies in OpenAI's form ({"type": "function", "function": {"name", "description",
    "parameters", "strict"}}), or a ValueError naming the first wrong one (`tools[i]...`)."""
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of functions, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools holds {len(tools)} functions; at most {MAX_TOOLS}")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise ValueError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}')
        function = tool["function"]
        if not isinstance(function, Mapping) or set(function) - FUNCTION_KEYS:
            raise ValueError(f"{where}.function must be an object of {sorted(FUNCTION_KEYS)}, got {function!r:.60}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r:.60}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} names two tools")
        if name in MODES:  # tool_choice's words: a function so named could not be the one chosen
            raise ValueError(f"{where}.function.name {name!r} is one of tool_choice's words ({', '.join(MODES)})")
        names.add(name)
        check_function(where, function)
        checked.append({"type": "function", "function": json.loads(json.dumps(dict(function), ensure_ascii=False))})
    return tuple(checked)


def check_function(where: str, function: Mapping) -> None:
    """A function's description, parameters (a JSON schema object, nested at most MAX_DEPTH levels) and strict."""
    if not isinstance(function.get("description", ""), str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object, got {parameters!r:.60}")
    if nesting(parameters) > MAX_DEPTH:
        raise ValueError(f"{where}.function.parameters nests more than {MAX_DEPTH} levels")
    if not isinstance(function.get("strict", False), bool):
        raise ValueError(f"{where}.function.strict must be true or false")
    try:
        text = json.dumps(dict(function), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}.function must be plain JSON: {error}") from None
    check_text(f"{where}.function", text)


def check_tool_choice(choice: object, tools: Sequence[dict]) -> str:
    """OpenAI's `tool_choice` as one string: 'none', 'auto', 'required', or the name of the one function it names
    ({"type": "function", "function": {"name": ...}}, or the name alone); None: 'auto' with tools, 'none' without."""
    if choice is None:
        return "auto" if tools else "none"
    names = names_of(tools)
    if isinstance(choice, str) and choice in names:
        return choice
    if isinstance(choice, str):
        if choice not in MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(MODES)} or a function, got {choice!r:.60}")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return choice
    named = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(f'tool_choice must name a function as {{"type": "function", "function": {{"name": ...}}}}, '
                         f"got {choice!r:.60}")  # fmt: skip
    if name not in names:
        raise ValueError(f"tool_choice names {name!r:.60}, which is not one of the tools")
    return name


def names_of(tools: Sequence[dict]) -> frozenset[str]:
    """The function names of checked `tools`."""
    return frozenset(tool["function"]["name"] for tool in tools)


def functions_of(tools: Sequence[dict], name: str | None) -> list[dict]:
    """The function objects of checked `tools`: the one named `name`, or all (None)."""
    return [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]


def parameters_of(tools: Sequence[dict]) -> dict[str, dict]:
    """The parameters' schema of each of checked `tools`, by function name: the names of the tools a call may
    name, and the types its arguments are read as where they are written as text (`forerun.tool_xml`)."""
    return {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in tools}


def takes_tools(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template (any of its named ones) teaches a call format forerun reads: one it
    knows by sight (`kind_of`), or JSON calls after a special token of the tokenizer's own, read off what the
    template renders of a probe call (`forerun.tool_probe`)."""
    return kind_of(templates(tokenizer)) is not None or probed(tokenizer) is not None


def probed_calls(tokenizer: object) -> Written | None:
    """How the tokenizer's chat template writes calls where that is read off a probe call (`forerun.tool_probe`):
    None where it writes them in a form known by sight (`kind_of`), or teaches none."""
    return None if kind_of(templates(tokenizer)) is not None else probed(tokenizer)


def calls_taught(tokenizer: object) -> str:
    """In words, the call format the tokenizer's chat template teaches, as `forerun serve` says it at start.

    Example:
        >>> class Tokenizer:
        ...     chat_template = "{{ '<tool_call>' }}"
        >>> calls_taught(Tokenizer())
        'JSON in <tool_call> blocks'
    """
    kind = kind_of(templates(tokenizer))
    if kind is not None:
        return {"xml": "XML in <tool_call> blocks (Qwen3.5's)", "blocks": "JSON in <tool_call> blocks",
                "pythonic": f"a Python list of calls between {PY_OPEN} and {PY_CLOSE} (LFM2's)"}.get(
            kind, "one bare JSON object (Llama 3's)"
        )  # fmt: skip
    written = probed(tokenizer)
    if written is None:
        return "none forerun reads (tools are refused)"
    if written.between:
        return f"{written.open}name{written.between}{{arguments}}, read off the template"
    shape = "a JSON list" if written.listed else "JSON"
    return f"{shape} after {written.open}{f' ... {written.close}' if written.close else ''}, read off the template"


def short_call_ids(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template takes only 9-character call ids (Mistral's): the ids an answer's calls
    are given must then go back through it."""
    written = probed_calls(tokenizer)
    return written is not None and written.short_ids


def call_mark(tokenizer: object) -> int | None:
    """The id of the special token a probed template's calls open with (Mistral's `[TOOL_CALLS]`,
    `forerun.tool_probe`): the decoded answer drops it, so where an answer holds it its calls are read from there
    on (`forerun.tool_calls.marked_at`); LFM2's `<|tool_call_start|>` alike; None where the template's calls are
    known by sight (but LFM2's) or not taught."""
    written = probed_calls(tokenizer)
    mark = written.open if written is not None else PY_OPEN if kind_of(templates(tokenizer)) == "pythonic" else ""
    ids = tokenizer(mark, add_special_tokens=False)["input_ids"] if mark else []
    return ids[0] if len(ids) == 1 else None


def kind_of(texts: Sequence[str]) -> str | None:
    """The call format chat templates `texts` teach: "xml" (they write `<tool_call>` and `<function=`: Qwen3.5's,
    Qwen3-Coder's), "blocks" (`<tool_call>`), "json" (Llama 3's bare object: they write `"parameters": ` and take
    `tools`), "pythonic" (LFM2's: they list the tools after `<|tool_list_start|>`, `forerun.tool_pythonic`), or
    None (another, or none)."""
    if any(TOOL_LIST in text for text in texts):
        return "pythonic"
    if any(OPEN in text and FUNCTION in text for text in texts):
        return "xml"
    if any(OPEN in text for text in texts):
        return "blocks"
    if any(PARAMETERS in text and "tools" in text for text in texts):
        return "json"
    return None


@dataclass(frozen=True)
class CallForm:
    """How a chat template writes calls, as a required call's grammar must.

    `kind` "blocks": in `<tool_call>` blocks, one JSON list in one block (`listed`: SmolLM2's) or an object per
    block (Hermes, Qwen); `open` and `close` spell the block's marks for the grammar: as text (`"<tool_call>"`), or
    as the one token of their own a tokenizer gives them (`<tool_call>`: Qwen's, which llguidance reads as a special
    token, never as its text); or marks read off the template's probe call (`forerun.tool_probe`), special tokens
    spelt by id (`<[9]>`: Mistral's `[TOOL_CALLS]`, whose brackets would read as a set of ids). `kind` "xml": such
    blocks, each holding one call as XML (`forerun.tool_xml`: Qwen3.5's). `kind` "named": a call's name between
    two marks before its arguments. `kind` "json": one bare JSON object, its arguments under "parameters" (Llama
    3's templates show one call per assistant message, and refuse more)."""

    listed: bool = False
    open: str = json.dumps(OPEN)
    close: str = json.dumps(CLOSE)
    kind: str = "blocks"
    lead: str | None = None
    """What stands between the opening mark and the JSON (None: "\n" before a block's object, nothing before a
    list), as `trail` between the JSON and the closing mark; a `close` of "" ends the calls where the JSON ends
    (Mistral's `[TOOL_CALLS] [...]`, the end token after it)."""
    trail: str | None = None
    between: str = ""
    """`kind` "named": the mark between a call's name and its arguments' JSON (Mistral's `[ARGS]`, by id)."""
    key: str = ""
    """The key a call's arguments are written under where the template says ("": `arguments` decides)."""
    specials: str = ""
    """The special tokens free text may hold in a lazy grammar ("blocks": a Qwen3's `<think>`, say), as llguidance's
    set of token ids (`<[151643-151656,151659-151664]>`: the marks and the end token left out); "" where none."""
    thought: tuple[str, ...] = ()
    """The grammar's terms of the marks a thought is written between, where the tokenizer has them as tokens of
    their own (`<think>` and `</think>`, or Mistral's `[THINK]` and `[/THINK]`, by id): a required call may then
    follow a thought, as a reasoning model writes one before it answers."""

    @property
    def arguments(self) -> str:
        """The key a call's arguments are written under."""
        return self.key or ("parameters" if self.kind == "json" else "arguments")

    opened: bool = False
    """Whether the generation prompt opens the thought itself (Qwen3.5's ends in `<think>\\n`): the answer then
    begins inside it, and closes it before its calls."""

    @property
    def thinks(self) -> bool:
        """Whether a thought may come first (`thought`)."""
        return bool(self.thought)

    @property
    def gaps(self) -> tuple[str, str]:
        """(`lead`, `trail`) as written, their defaults filled in."""
        default = "" if self.listed else "\n"
        return (default if self.lead is None else self.lead), (default if self.trail is None else self.trail)


def call_form(tokenizer: object, special: Callable[[int], bool], vocab: int = 0, end: int | None = None) -> CallForm:
    """The `CallForm` of a tokenizer's chat template; `special(id)`: whether llguidance reads token `id` as a
    special token, among the `vocab` ids (`end`: the id it reads as the answer's end)."""
    texts = templates(tokenizer)
    kind = kind_of(texts)
    written = probed_calls(tokenizer)
    opening, closing = (written.open, written.close) if written is not None else (OPEN, CLOSE)
    if kind == "pythonic":
        opening, closing = PY_OPEN, PY_CLOSE
    between = written.between if written is not None else ""
    marks = {mark: tokenizer(mark, add_special_tokens=False)["input_ids"] for mark in (opening, closing, between)}
    ids = {mark: found[0] for mark, found in marks.items() if mark and len(found) == 1 and special(found[0])}
    thought, opened = thought_terms(tokenizer, special)
    if kind == "json":
        return CallForm(open="", close="", kind="json", thought=thought, opened=opened)  # no marks
    pair = (marks.opening, marks.closing) if thought and (marks := thought_marks(tokenizer)) else ()
    marked = {*ids.values(), *pair}  # a thought comes whole
    specials = token_set([i for i in range(vocab) if i not in marked and i != end and special(i)])
    if written is not None:
        return replace(probed_form(written, ids, specials, thought), opened=opened)
    listed = kind == "blocks" and any(OPEN + "[" in text for text in texts)
    if kind == "pythonic":  # special tokens, spelt by id (their bars would read as a regex's)
        term = {mark: f"<[{ids[mark]}]>" if mark in ids else json.dumps(mark) for mark in (opening, closing)}
    else:
        term = {mark: mark if mark in ids else json.dumps(mark) for mark in (OPEN, CLOSE)}
    return CallForm(listed, term[opening], term[closing], kind, specials=specials, thought=thought, opened=opened)


def probed_form(written: Written, ids: dict[str, int], specials: str, thought: tuple[str, ...]) -> CallForm:
    """The `CallForm` of calls read off a template's probe call (`forerun.tool_probe`); `ids`: the marks llguidance
    reads as special tokens, spelt by id (such a mark may look like a set of ids: `[TOOL_CALLS]`), the others as
    text."""

    def term(mark: str) -> str:
        return f"<[{ids[mark]}]>" if mark in ids else json.dumps(mark) if mark else ""

    kind = "named" if written.between else "blocks"
    return CallForm(written.listed, term(written.open), term(written.close), kind, written.lead, written.trail,
                    term(written.between), written.arguments, specials, thought)  # fmt: skip


def token_set(ids: Sequence[int]) -> str:
    """llguidance's Lark token set of sorted `ids` ("" for none).

    Example:
        >>> token_set([3, 4, 5, 9]), token_set([])
        ('<[3-5,9]>', '')
    """
    spans: list[list[int]] = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return f"<[{','.join(str(a) if a == b else f'{a}-{b}' for a, b in spans)}]>" if spans else ""


def templates(tokenizer: object) -> list[str]:
    """The texts of the tokenizer's chat templates (one, or several by name)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, Mapping) else [template]
    return [text for text in texts if isinstance(text, str)]


def held_calls(tools: Sequence[dict], choice: str, parallel: bool) -> dict | None:
    """What a request's answer is held to for its tools and checked `choice`: calls where the choice requires them,
    any call the answer opens where it is auto and a function is `strict` ("lazy"), else None (free); as
    `GenerationRequest.held_format` gives it (`forerun.structured.grammar_of` compiles it).

    Example:
        >>> held_calls([{"type": "function", "function": {"name": "now"}}], "required", True)["name"] is None
        True
        >>> held_calls([{"type": "function", "function": {"name": "now"}}], "auto", True) is None
        True
    """
    if not tools or choice == "none":
        return None
    if choice != "auto":
        name = None if choice == "required" else choice
        return {"type": "tool_calls", "tools": tools, "name": name, "parallel": parallel}
    held = strictly_held(tools)
    return None if held is None else {"type": "tool_calls", "tools": held, "name": None, "parallel": parallel,
                                      "lazy": True}  # fmt: skip


def strictly_held(tools: Sequence[dict]) -> tuple[dict, ...] | None:
    """`tools` as a lazy grammar holds them under tool_choice auto, where any function is `strict`: the strict ones'
    calls to their parameters, the others' to any JSON object (OpenAI's `strict` is per function); None where no
    function is strict (the answer stays free)."""
    if not any(tool["function"].get("strict") for tool in tools):
        return None
    return tuple(
        tool if tool["function"].get("strict") else {**tool, "function": {"name": tool["function"]["name"]}}
        for tool in tools
    )


def shipped_template(name: str) -> str:
    """The text of a chat template forerun ships (`chatml-tools`: ChatML, as SmolLM2 and Qwen2.5 write it, with
    tools listed in the system message and calls as SmolLM2 was taught them), or a ValueError naming those there
    are."""
    folder = Path(__file__).parent / "assets" / "chat_templates"
    shipped = sorted(path.stem for path in folder.glob("*.jinja"))
    if name not in shipped:
        raise ValueError(f"no chat template named {name!r} ships with forerun (there are: {', '.join(shipped)})")
    return (folder / f"{name}.jinja").read_text(encoding="utf-8")
