"""Tool calls read out of a model's text: the `<tool_call>` blocks its chat template taught it to write
(`forerun.tool_specs`), each holding one call as JSON, or a list of them, as Qwen2.5/Qwen3/Hermes and SmolLM2 write:

    I will look it up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, as Llama 3.1-3.3 are taught, a whole answer that is only calls as bare JSON (`{"name": "get_weather",
"parameters": {"city": "Paris"}}`; several separated by "; ", as Llama 3.2 writes them), or as names each followed
by their arguments (`get_weather{"city": "Paris"}`: Mistral's newer calls, their special tokens decoded out), or as
a Python list of calls (`[get_weather(city="Paris")]`: LFM2's, `forerun.tool_pythonic`).

Reading changes nothing the model wrote: the text is the model's own (plain generate's), split after. A block that
is not calls (not JSON, no name, arguments that are not an object) makes the whole text the answer's content and
no call, as a client would rather see what the model wrote than lose it; a last block the answer's end cut off
(`max_tokens`) stays in the content, after the calls made before it.

Example:
    >>> call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    >>> read_calls(f"I will look it up.\\n<tool_call>\\n{call}\\n</tool_call>")
    ('I will look it up.', (ToolCall(name='get_weather', arguments='{"city": "Paris"}'),))
    >>> read_calls('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>')
    (None, (ToolCall(name='a', arguments='{}'), ToolCall(name='b', arguments='{"x": 1}')))
    >>> read_calls("<tool_call>not JSON</tool_call>")
    ('<tool_call>not JSON</tool_call>', ())
    >>> read_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call>\\n<tool_call>{"name": "b", "argu')
    ('<tool_call>{"name": "b", "argu', (ToolCall(name='a', arguments='{}'),))
    >>> read_calls('{"name": "get_weather", "arguments": {"city": "Paris"}}', names={"get_weather"})
    (None, (ToolCall(name='get_weather', arguments='{"city": "Paris"}'),))
    >>> read_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', names={"a", "b"})[1]
    (ToolCall(name='a', arguments='{}'), ToolCall(name='b', arguments='{"x": 1}'))
    >>> read_calls('get_weather{"city": "Paris"}add{"a": 1}', names={"get_weather", "add"})[1]
    (ToolCall(name='get_weather', arguments='{"city": "Paris"}'), ToolCall(name='add', arguments='{"a": 1}'))
    >>> before_calls("Sure. <tool_c"), before_calls("Sure. <tool_call>{"), before_calls("Sure.")
    (6, 6, 5)
    >>> before_calls(' {"name', bare=True), before_calls("Sure.", bare=True), before_calls("```js", bare=True)
    (0, 5, 0)
    >>> before_calls("get_wea", bare=True, names={"get_weather"}), before_calls("get it", True, {"get_weather"})
    (0, 6)
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from forerun.text import complete
from forerun.thoughts import Thought, split
from forerun.tool_pythonic import list_end, pythonic_calls
from forerun.tool_specs import CLOSE, OPEN
from forerun.tool_xml import xml_call

FENCE = "```json"
"""How a Markdown fence of JSON opens."""
APART = re.compile(r"\s*;?\s*")
"""What may stand between bare calls."""
NAMED = re.compile(r"([A-Za-z0-9_-]{1,64})\{")
"""A function's name right before its arguments' JSON (Mistral's newer calls, their marks decoded out)."""
SPACES = re.compile(r"\s*")
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
"""A call block; the last may be cut off by the answer's end (its JSON then decides whether it is calls)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the function's name and its arguments as JSON text (an object), as OpenAI sends
    them."""

    name: str
    arguments: str

    def as_openai(self, ident: str | None = None, short: bool = False) -> dict:
        """OpenAI's tool call object, with `ident` (by default a fresh id: `call_...`, or 9 letters and digits where
        `short`, as Mistral's chat templates take no others)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": ident or fresh_call_id(short), "type": "function", "function": function}


def fresh_call_id(short: bool = False) -> str:
    """A new call's id: `call_` and 24 hex digits, or 9 where `short` (Mistral's chat templates take no others)."""
    return uuid.uuid4().hex[:9] if short else f"call_{uuid.uuid4().hex[:24]}"


def read_calls(
    text: str, names: Collection[str] = (), at: int | None = None
) -> tuple[str | None, tuple[ToolCall, ...]]:
    """(content, calls) of an answer: the text outside the blocks (stripped; None where only calls were written)
    and each block's calls in order; (text, ()) where no block is there or one is not calls. An answer without
    blocks that is nothing but calls of functions in `names` (the tools offered), as JSON (alone, or in one
    Markdown ```json fence), is read as those calls: Llama 3's templates teach calls so, and small models drop the
    tags theirs teach. `at`: where a mark the decoded text dropped opened the calls (`marked_at`: Mistral's
    `[TOOL_CALLS]` after a thought or words): the text from there on is read so, the text before it is content; or
    LFM2's `<|tool_call_start|>`, whose Python list of calls words may follow (content too)."""
    if at is not None and 0 <= at <= len(text):
        listed = listed_calls(text[at:], names)  # LFM2's: its Python list, then perhaps words
        if listed is not None:
            words = " ".join(part for part in (text[:at].strip(), listed[1].strip()) if part)
            return words or None, listed[0]
        found = read_calls(text[at:], names) if at > 0 else (None, ())
        if found[1] and found[0] is None:
            return text[:at].strip() or None, found[1]
    if OPEN not in text:
        body = unfenced(text.strip())
        bare = bare_calls(body) if body[:1] in ("{", "[") else named_calls(body)
        if bare is None and body[:1] == "[":  # a Python list of calls, the marks dropped or never written
            bare = python_calls(body)
        if bare and all(call.name in names for call in bare):
            return None, tuple(bare)
        return text, ()
    calls: list[ToolCall] = []
    kept: list[str] = []  # the content: text outside the blocks, and a last block cut off before it made calls
    end = 0
    for match in BLOCK.finditer(text):
        found = calls_in(match.group(1))
        if found is None and (xml := xml_call(match.group(1), names)) is not None:  # Qwen3.5's XML
            found = [ToolCall(xml[0], json.dumps(xml[1], ensure_ascii=False))]
        if found is None and match.group(0).endswith(CLOSE):
            return text, ()
        kept.append(text[end : match.start()] if found is not None else text[end : match.end()])
        calls.extend(found or ())
        end = match.end()
    content = "".join([*kept, text[end:]]).strip()
    return (content or None) if calls else content, tuple(calls)


def read_answer(
    shown: str, thought: Thought | None, names: Collection[str] = (), at: int | None = None
) -> tuple[str | None, tuple[ToolCall, ...]]:
    """`read_calls` of an answer's text after its thought (`forerun.thoughts`: calls come after it), `at` counted in
    the whole `shown` text."""
    answer = split(shown, thought)[1]
    if at is not None:
        at -= len(shown) - len(answer)
    return read_calls(answer, names, at)


def listed_calls(text: str, names: Collection[str]) -> tuple[tuple[ToolCall, ...], str] | None:
    """(calls, the words after them) where `text` opens with a Python list of calls of functions in `names`
    (`forerun.tool_pythonic`: LFM2's, its marks decoded out), else None."""
    end = list_end(text)
    calls = python_calls(text[:end]) if end is not None else None
    if not calls or not all(call.name in names for call in calls):
        return None
    return tuple(calls), text[end:]


def python_calls(text: str) -> list[ToolCall] | None:
    """The calls of a Python list of calls (`forerun.tool_pythonic.pythonic_calls`), or None where it is not one."""
    found = pythonic_calls(text)
    return None if found is None else [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in found]


def marked_at(tokenizer, ids: Sequence[int], mark: int | None) -> int | None:
    """Where in the decoded text of answer `ids` (special tokens skipped) the first `mark` token stood (a probed
    template's opening mark, `forerun.tool_specs.call_mark`), or None where it does not."""
    if mark is None or mark not in ids:
        return None
    before = list(ids[: list(ids).index(mark)])
    return len(complete(tokenizer.decode(before, skip_special_tokens=True)))


def calls_in(body: str) -> list[ToolCall] | None:
    """The calls of one block's JSON (`calls_of`), or None where it is not calls."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # a model may write "[" a thousand times: not calls, and no failure
        return None
    return calls_of(value)


def bare_calls(body: str) -> list[ToolCall] | None:
    """The calls of JSON values written one after another, apart by spaces or one ";" (`calls_of` each), or None
    where any is not calls."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        found = calls_of(value)
        if found is None:
            return None
        calls.extend(found)
        at = APART.match(body, at).end()
    return calls


def named_calls(body: str) -> list[ToolCall] | None:
    """The calls of names each followed by their arguments' JSON object (`get_weather{"city": "Paris"}`: what is
    left of Mistral's newer calls once their marks are decoded out), apart by spaces at most, or None where `body`
    is not that."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        named = NAMED.match(body, at)
        if named is None:
            return None
        try:
            arguments, at = decoder.raw_decode(body, named.end() - 1)
        except (ValueError, RecursionError):
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(named.group(1), json.dumps(arguments, ensure_ascii=False)))
        at = SPACES.match(body, at).end()
    return calls or None


def calls_of(value: object) -> list[ToolCall] | None:
    """The calls in a JSON value (an object or a list of objects, each with a name and an arguments object, or
    parameters; arguments written as a JSON string are read too), or None where it is not that."""
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def unfenced(text: str) -> str:
    """`text` without the Markdown fence it is wholly inside (```json ... ```), or as it is."""
    if text.startswith(FENCE) and text.endswith("```") and len(text) > len(FENCE) + 3:
        return text[len(FENCE) : -3].strip()
    return text


def before_calls(text: str, bare: bool = False, names: Collection[str] = ()) -> int:
    """How much of a growing answer may be streamed as content: up to its first block, less an end that could
    still become one (`<tool_c`); none of an answer that could still be bare calls (`bare`: it starts as JSON,
    in a ```json fence or not, or with nothing but spaces so far, or as one of `names` then `{`)."""
    start = text.lstrip()
    if start.startswith(FENCE):
        start = start[len(FENCE) :].lstrip()
    if bare and (start[:1] in ("", "{", "[") or FENCE.startswith(start)):
        return 0
    if bare and any(start.startswith(name + "{") or (name + "{").startswith(start) for name in names):
        return 0
    start = text.find(OPEN)
    if start >= 0:
        return start
    return len(text) - held_back(text, OPEN)


def held_back(text: str, closing: str) -> int:
    """How many of `text`'s last characters may be the beginning of `closing` (held until it is known).

    Example:
        >>> held_back("Paris\\n</par", "\\n</parameter>"), held_back("Paris", "\\n</parameter>")
        (6, 0)
    """
    for length in range(min(len(closing) - 1, len(text)), 0, -1):
        if text.endswith(closing[:length]):
            return length
    return 0
