"""Tool calls streamed while the model writes them: each call's name as soon as it is written, then its arguments
as they grow, as vLLM's parsers and OpenAI stream them (a client shows a long argument, such as a file's text, as
it comes, not after the answer).

Followed as they are written: JSON calls in `<tool_call>` blocks (Qwen2.5, Qwen3, Hermes, SmolLM2), one call or a
list of them a block, each written name first (`{"name": "f", "arguments": {...}}`, as their templates teach and
a required call's grammar writes), their arguments as the model wrote them; and Qwen3.5's and Qwen3-Coder's XML
calls (`forerun.tool_xml`), their arguments as the JSON object `json.dumps` writes of them: a string parameter's
text as it comes, any other value once its element closes (it is typed by the function's schema); and calls after a
mark the decoded text dropped (`mark_at`: Mistral's `[TOOL_CALLS]`), as a JSON list or one object, or as names each
followed by their arguments (`[TOOL_CALLS]name[ARGS]{...}`). Anything else (a call whose arguments come first or as
a JSON string, bare JSON without a mark, LFM2's Python calls) stops the following, and what was not sent comes
whole once the answer has been read (`forerun.tool_calls.read_calls`). The text is only ever read, never changed.

Example (the answer growing by a few characters; each part: the call's index, its name on its first part, the
arguments written since, and whether the call is whole):
    >>> stream = CallStream({"get_weather"})
    >>> stream.follow('<tool_call>{"name": "get_weather", "argu')
    []
    >>> stream.follow('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    [CallPart(index=0, name='get_weather', arguments='{"city": "Pa', done=False)]
    >>> stream.follow('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}')
    [CallPart(index=0, name=None, arguments='ris"}', done=True)]
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import regex

from forerun.tool_calls import ToolCall, held_back
from forerun.tool_specs import CLOSE, OPEN
from forerun.tool_xml import properties_of, typed

CALL = r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
"""A call written name first, up to its arguments' opening brace."""
FIRST = regex.compile(r"\s*(\[\s*)?" + CALL)
"""A block's first call, perhaps the first of a list."""
NEXT = regex.compile(r"\s*,\s*" + CALL)
"""The next call of a block's list."""
NAMED = regex.compile(r"\s*([A-Za-z0-9_-]{1,64})\{")
"""A call after a mark the decoded text dropped, as Mistral's newer templates write it (`[TOOL_CALLS]name[ARGS]{`,
the marks decoded out): its name, up to its arguments' opening brace."""
BARE_LIST_END = regex.compile(r"\s*\]")
XML_FIRST = regex.compile(r"\s*<function=([A-Za-z0-9_-]{1,64})>\n")
"""A block's XML call, up to its first parameter."""
XML_PARAMETER = regex.compile(r"\s*<parameter=([^>\n]{1,256})>\n")
XML_END = regex.compile(r"\s*</function>\s*" + regex.escape(CLOSE))
VALUE_END = "\n</parameter>"
OBJECT_END = regex.compile(r"\s*\}")
LIST_END = regex.compile(r"\s*\]\s*" + regex.escape(CLOSE))
BLOCK_END = regex.compile(r"\s*" + regex.escape(CLOSE))


@dataclass(frozen=True)
class CallPart:
    """A piece of the answer's `index`-th tool call as a stream sends it: its `name` on its first piece (None
    after), the `arguments` text written since the last piece, and `done` on its last (the arguments whole)."""

    index: int
    name: str | None
    arguments: str
    done: bool


def whole_parts(calls: Sequence[ToolCall], first: int = 0) -> list[CallPart]:
    """Calls read whole, each as one part, numbered from `first`.

    Example:
        >>> whole_parts([ToolCall("f", "{}")], first=2)
        [CallPart(index=2, name='f', arguments='{}', done=True)]
    """
    return [CallPart(first + k, call.name, call.arguments, True) for k, call in enumerate(calls)]


class ObjectEnd:
    """Where a JSON object written from `start` (its `{`) closes, each character read once as the text grows
    (brackets counted outside strings; whether it is JSON is checked once it closes)."""

    def __init__(self, start: int) -> None:
        self.at, self.depth, self.quoted, self.escaped = start, 0, False, False

    def find(self, text: str) -> int | None:
        """The index after the object's closing brace, or None while it is open."""
        for i in range(self.at, len(text)):
            char = text[i]
            if self.quoted:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.quoted = False
            elif char == '"':
                self.quoted = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.at = i + 1
                    return i + 1
        self.at = len(text)
        return None


class CallStream:
    """Follows one answer's calls as it grows (`follow`), then gives what is left once it has been read
    (`finish`). `names`: the functions offered; a call of another stops the following."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self.at = 0
        """Where in the answer reading goes on."""
        self.state = "seek"
        """What comes next: "seek" (a block), "first" / "next" (a call), "arguments", "end" (the call's brace),
        "after" (another call of the list, or the block's end), "stopped" (not followed further)."""
        self.listed = False
        """Whether the open block holds a list of calls."""
        self.started: list[list[str]] = []
        """Each call begun: [name, arguments sent]."""
        self.done = 0
        """Calls whose last part was sent."""
        self.scan: ObjectEnd | None = None
        self.value: tuple[int, object] | None = None
        """Where the XML parameter being read began, and its schema."""
        self.marked, self.named = False, False
        """Whether the calls follow a mark the decoded text dropped (`mark_at`: no block around them), and whether
        the open call was written as its name, then its arguments (Mistral's newer form)."""

    def mark_at(self, at: int) -> None:
        """The calls begin at `at`, after a mark the decoded text dropped (Mistral's `[TOOL_CALLS]`, where
        `forerun.tool_calls.marked_at` found it): read from there as JSON (a list or one object, name first) or as
        names each followed by their arguments. Nothing changes once a block has been found or a call sent."""
        if self.state == "seek" and not self.started:
            self.at, self.state, self.marked = at, "marked", True

    def follow(self, answer: str) -> list[CallPart]:
        """The parts of calls written since the last call, `answer` being the answer's text so far after its
        thought (stop strings cut off; it only grows)."""
        parts: list[CallPart] = []
        while self.state != "stopped" and self.step(answer, parts):
            pass
        return merged(parts)

    def step(self, answer: str, parts: list[CallPart]) -> bool:
        """Read on from `at` by one state; False where the answer must grow first (or following stopped)."""
        if self.state == "seek":
            found = answer.find(OPEN, self.at)
            if found < 0:  # read no further back next time than where a block could still begin
                self.at = max(self.at, len(answer) - len(OPEN) + 1)
                return False
            self.at, self.state = found + len(OPEN), "first"
            return True
        if self.state == "arguments":
            return self.arguments(answer, parts)
        if self.state in ("marked", "named"):
            return self.marked_call(answer, parts)
        if self.state in ("xml", "value"):
            return self.xml_parameter(answer, parts) if self.state == "xml" else self.xml_value(answer, parts)
        pattern = {"first": FIRST, "next": NEXT, "end": OBJECT_END}.get(self.state)
        if pattern is None:  # "after"
            return self.after(answer)
        match = pattern.match(answer, self.at, partial=True)
        if self.state == "first" and (match is None or match.partial):
            xml = XML_FIRST.match(answer, self.at, partial=True)
            if xml is not None and not xml.partial:
                return self.xml_call(xml, parts)
            match = match if match is not None else xml
        if match is None or match.partial:
            self.state = "stopped" if match is None else self.state
            return False
        if self.state == "end":
            parts.append(CallPart(len(self.started) - 1, None, "", True))
            self.done += 1
            self.at, self.state = match.end(), "after"
            return True
        name = match.group(match.re.groups)
        if name not in self.names:
            self.state = "stopped"
            return False
        self.listed = self.listed if self.state == "next" else match.group(1) is not None
        self.begin(name, match.end() - 1, parts)
        return True

    def begin(self, name: str, brace: int, parts: list[CallPart], named: bool = False) -> None:
        """A call of `name` begins: its name is sent, its arguments (from the brace at `brace`) are read next."""
        self.started.append([name, ""])
        parts.append(CallPart(len(self.started) - 1, name, "", False))
        self.at, self.state, self.scan, self.named = brace, "arguments", ObjectEnd(brace), named

    def marked_call(self, answer: str, parts: list[CallPart]) -> bool:
        """After a mark ("marked": JSON or a named call) or a named call ("named": another named call): the next
        call begins, or following waits for more text, or stops where none can begin."""
        json_call = FIRST.match(answer, self.at, partial=True) if self.state == "marked" else None
        if json_call is not None and not json_call.partial:
            self.state = "first"
            return True
        named = NAMED.match(answer, self.at, partial=True)
        if named is not None and not named.partial:
            if named.group(1) not in self.names:
                self.state = "stopped"
                return False
            self.begin(named.group(1), named.end() - 1, parts, named=True)
            return True
        self.state = self.state if json_call is not None or named is not None else "stopped"
        return False

    def arguments(self, answer: str, parts: list[CallPart]) -> bool:
        """Send the open call's arguments written so far; on to its closing brace once they are whole JSON."""
        end = self.scan.find(answer)
        upto = len(answer) if end is None else end
        if upto > self.at:
            parts.append(CallPart(len(self.started) - 1, None, answer[self.at : upto], False))
            self.started[-1][1] += answer[self.at : upto]
            self.at = upto
        if end is None:
            return False
        if not is_object(self.started[-1][1]):
            self.state = "stopped"
            return False
        if self.named:  # the call is whole with its arguments; another may follow
            parts.append(CallPart(len(self.started) - 1, None, "", True))
            self.done += 1
            self.state = "named"
            return True
        self.state = "end"
        return True

    def xml_call(self, match: regex.Match, parts: list[CallPart]) -> bool:
        """An XML call begins: its name is sent, its parameters are read next."""
        name = match.group(1)
        if name not in self.names:
            self.state = "stopped"
            return False
        self.started.append([name, ""])
        parts.append(CallPart(len(self.started) - 1, name, "", False))
        self.at, self.state = match.end(), "xml"
        return True

    def xml_parameter(self, answer: str, parts: list[CallPart]) -> bool:
        """Between an XML call's parameters: the next one's key is sent (a string's opening quote too), or the
        call ends (`}`) with its block."""
        sent = self.started[-1][1]
        opened = XML_PARAMETER.match(answer, self.at, partial=True)
        if opened is not None and not opened.partial:
            key = opened.group(1)
            schema = properties_of(self.names, self.started[-1][0]).get(key)
            text = ("{" if not sent else ", ") + json.dumps(key, ensure_ascii=False) + ": "
            text += '"' if is_string(schema) else ""
            self.send(text, parts)
            self.at, self.state, self.value = opened.end(), "value", (opened.end(), schema)
            return True
        ended = XML_END.match(answer, self.at, partial=True)
        if ended is not None and not ended.partial:
            self.send("}" if sent else "{}", parts, done=True)
            self.at, self.state = ended.end(), "seek"
            return True
        self.state = self.state if opened is not None or ended is not None else "stopped"
        return False

    def xml_value(self, answer: str, parts: list[CallPart]) -> bool:
        """An XML parameter's value: a string's text as it comes (less an end that may be its closing tag's
        beginning), any other value once its element closes, typed by its schema as `forerun.tool_xml` reads it."""
        start, schema = self.value
        end = answer.find(VALUE_END, self.at)  # text before `at` was sent, or holds no closing tag
        if not is_string(schema):
            if end < 0:
                self.at = max(self.at, len(answer) - len(VALUE_END) + 1)
                return False
            self.send(json.dumps(typed(answer[start:end], schema), ensure_ascii=False), parts)
            self.at, self.state = end + len(VALUE_END), "xml"
            return True
        upto = end if end >= 0 else len(answer) - held_back(answer, VALUE_END)
        if upto > self.at:
            self.send(json.dumps(answer[self.at : upto], ensure_ascii=False)[1:-1], parts)
            self.at = upto
        if end < 0:
            return False
        self.send('"', parts)
        self.at, self.state = end + len(VALUE_END), "xml"
        return True

    def send(self, text: str, parts: list[CallPart], done: bool = False) -> None:
        """A piece of the open call's arguments, sent (`done`: its last)."""
        self.started[-1][1] += text
        parts.append(CallPart(len(self.started) - 1, None, text, done))
        self.done += done

    def after(self, answer: str) -> bool:
        """After a call: the list's next call, or the block's end (then the next block is sought)."""
        ends = [(LIST_END, "seek"), (NEXT, "next")] if self.listed else [(BLOCK_END, "seek")]
        if self.marked:  # no block around the calls: a list ends with its bracket, one object with itself
            ends = [(BARE_LIST_END, "stopped"), (NEXT, "next")] if self.listed else []
        waiting = False
        for pattern, state in ends:
            match = pattern.match(answer, self.at, partial=True)
            if match is not None and not match.partial:
                self.at, self.state = (self.at, state) if state == "next" else (match.end(), state)
                return state != "stopped"
            waiting = waiting or match is not None
        self.state = self.state if waiting else "stopped"
        return False

    def finish(self, answer: str, calls: Sequence[ToolCall]) -> list[CallPart]:
        """The parts still to send once the answer is whole (`answer`, as `follow` takes it) and read (`calls`:
        `read_calls`' calls): the calls not yet sent, whole, after the last one followed. Where what was sent is
        not what was read (a call the answer's end cut off, a block that turned out not to be calls), the call
        being written ends as it was written and nothing more is sent: a stream cannot take back what it sent."""
        parts = self.follow(answer)
        if self.done < len(self.started):  # cut off, or not JSON: it ends as written
            parts = merged([*parts, CallPart(self.done, None, "", True)])
            self.done += 1
        if not self.agrees(calls):
            return parts
        return [*parts, *whole_parts(calls[len(self.started) :], len(self.started))]

    def agrees(self, calls: Sequence[ToolCall]) -> bool:
        """Whether every call sent is the call read in its place (its name, and its arguments the same JSON)."""
        if len(calls) < len(self.started):
            return False
        for (name, sent), call in zip(self.started, calls, strict=False):
            if name != call.name or not is_object(sent) or json.loads(sent) != json.loads(call.arguments):
                return False
        return True


def is_string(schema: object) -> bool:
    """Whether a parameter's value is read as it is written (`forerun.tool_xml.typed`: a string's)."""
    return isinstance(schema, Mapping) and schema.get("type") == "string"


def merged(parts: list[CallPart]) -> list[CallPart]:
    """`parts` with each call's consecutive parts joined into one (its name, its arguments, whether it ended).

    Example:
        >>> merged([CallPart(0, "f", "", False), CallPart(0, None, "{}", False), CallPart(0, None, "", True)])
        [CallPart(index=0, name='f', arguments='{}', done=True)]
    """
    joined: list[CallPart] = []
    for part in parts:
        if joined and joined[-1].index == part.index:
            last = joined.pop()
            part = CallPart(part.index, last.name, last.arguments + part.arguments, part.done)
        joined.append(part)
    return joined


def is_object(text: str) -> bool:
    """Whether `text` is one JSON object."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False
