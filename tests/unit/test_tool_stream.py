"""Calls followed while they are written (`forerun.tool_stream`): an answer fed a few characters at a time gives
each call's name first and its arguments as they grow; joined, they are the calls `read_calls` reads from the whole
answer, and what is not followed comes whole at the end."""

from __future__ import annotations

import json
import random

import pytest

from forerun.tool_calls import ToolCall, read_calls
from forerun.tool_stream import CallPart, CallStream

NAMES = {"get_weather", "add", "write_file"}
CODE = 'def f(x):\n    return {"a": [x, "}"]}  # a brace in a string: \\"}\\"'


def streamed(answer: str, seed: int = 0, names=NAMES) -> list[CallPart]:
    """Every part a stream sends for `answer` fed in pieces of 1-7 characters, then finished as it is read."""
    stream, parts, at = CallStream(names), [], 0
    pick = random.Random(seed)
    while at < len(answer):
        at = min(len(answer), at + pick.randint(1, 7))
        parts += stream.follow(answer[:at])
    return parts + stream.finish(answer, read_calls(answer, names)[1])


def joined(parts: list[CallPart]) -> list[ToolCall]:
    """The calls the parts make, each part's arguments joined in order; every call named once, first, and ended
    once, last."""
    calls: dict[int, list] = {}
    for part in parts:
        if part.name is not None:
            assert part.index not in calls and part.index == len(calls)
            calls[part.index] = [part.name, "", False]
        entry = calls[part.index]
        assert not entry[2], "a part after the call's end"
        entry[1] += part.arguments
        entry[2] = part.done
    assert all(entry[2] for entry in calls.values())
    return [ToolCall(name, arguments) for name, arguments, _ in calls.values()]


def same(calls: list[ToolCall], read: tuple[ToolCall, ...]) -> bool:
    return [c.name for c in calls] == [c.name for c in read] and all(
        json.loads(c.arguments) == json.loads(r.arguments) for c, r in zip(calls, read, strict=True)
    )


ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LISTED = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'  # noqa: E501
TWO = f'Let me check.\n{ONE}\n<tool_call>\n{{"name": "add", "parameters": {{"a": 17, "b": 25}}}}\n</tool_call>'
FILE = json.dumps({"name": "write_file", "arguments": {"path": "f.py", "text": CODE}})


@pytest.mark.parametrize("answer", [ONE, LISTED, TWO, f"<tool_call>{FILE}</tool_call>", ONE.replace(" ", "")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_followed_calls_are_the_calls_read_from_the_whole_answer(answer, seed):
    """Name first, arguments as written; joined they are `read_calls`' calls, nothing sent whole at the end."""
    parts = streamed(answer, seed)
    assert same(joined(parts), read_calls(answer, NAMES)[1])
    assert sum(1 for part in parts if part.done and part.arguments == "" and part.name is None) <= 2


def test_a_long_argument_goes_out_as_it_is_written():
    """A file's text in the arguments comes in many parts, each the characters written since the last, exactly
    as the model wrote them (the escapes of its JSON string kept)."""
    text = "\n".join(f"line {i}: {{'k': [{i}]}}" for i in range(300))
    body = json.dumps({"name": "write_file", "arguments": {"path": "a.txt", "text": text}})
    answer = f"<tool_call>\n{body}\n</tool_call>"
    parts = streamed(answer, seed=3)
    arguments = [part.arguments for part in parts if part.arguments]
    assert len(arguments) > 100
    assert "".join(arguments) == json.dumps({"path": "a.txt", "text": text})
    assert joined(parts)[0].name == "write_file"


def test_calls_not_written_name_first_come_whole_at_the_end():
    """Arguments before the name, arguments as a JSON string, a function not offered (JSON or XML), bare JSON:
    nothing is followed, and the calls read come whole, one part each, after the stream."""
    answers = [
        '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "<tool_call>\n<function=other>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        '<tool_call>{"name": "other", "arguments": {"a": 1}}</tool_call>',
        '{"name": "add", "arguments": {"a": 1}}',
    ]
    for answer in answers:
        stream = CallStream(NAMES)
        assert all(stream.follow(answer[:at]) == [] for at in range(len(answer) + 1)), answer
        read = read_calls(answer, NAMES | {"other"})[1]
        assert read and stream.finish(answer, read) == [CallPart(0, c.name, c.arguments, True) for c in read]


def test_a_call_followed_after_one_that_was_not_keeps_its_place():
    """A list whose second call is not written name first: the first goes out as written, the second whole."""
    answer = '<tool_call>[{"name": "add", "arguments": {"a": 1}}, {"arguments": {}, "name": "add"}]</tool_call>'
    parts = streamed(answer)
    assert [part.index for part in parts if part.name] == [0, 1] and parts[-1] == CallPart(1, "add", "{}", True)
    assert same(joined(parts), read_calls(answer, NAMES)[1])


def test_a_call_cut_off_ends_as_written_and_nothing_more_is_sent():
    """The answer's end (max_tokens) cuts the arguments: `read_calls` keeps that block as content, but a stream
    cannot take back what it sent: the call ends with the arguments it had; a call after a block that turns out
    not to be calls ends the calls sent too."""
    cut = '<tool_call>{"name": "add", "arguments": {"a": 1, "b'
    parts = streamed(cut)
    assert joined(parts) == [ToolCall("add", '{"a": 1, "b')] and read_calls(cut, NAMES)[1] == ()
    broken = ONE + '\n<tool_call>{"name": "add", "arguments": {"a": }}</tool_call>'
    parts = streamed(broken)
    assert [call.name for call in joined(parts)] == ["get_weather", "add"] and read_calls(broken, NAMES)[1] == ()


def test_hostile_arguments_are_read_once_and_never_raise():
    """Thousands of brackets, quotes and escapes, a name past 64 characters, stray closers: followed or stopped,
    never an exception, and the closing brace found by reading each character once."""
    deep = '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
    assert same(joined(streamed(deep)), read_calls(deep, NAMES)[1]) or read_calls(deep, NAMES)[1] == ()
    for answer in [
        '<tool_call>{"name": "' + "a" * 80 + '", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": "\\\\\\"}}"}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {]]]}}</tool_call>',
        "<tool_call>" * 50,
    ]:
        joined(streamed(answer))
    long = '<tool_call>{"name": "add", "arguments": {"a": "' + "x" * 200_000 + '"}}</tool_call>'
    stream = CallStream(NAMES)
    sent = sum(len(part.arguments) for at in range(0, len(long), 5) for part in stream.follow(long[: at + 5]))
    assert sent == 200_000 + len('{"a": ""}') and stream.scan.at <= len(long)


SCHEMAS = {"write_file": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"},
                                                           "mode": {"type": "integer"}, "tags": {"type": "array"}}},
           "add": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}  # fmt: skip


def xml(name: str, **values: str) -> str:
    """One XML call as Qwen3.5's template writes it."""
    written = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{written}</function>\n</tool_call>"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_xml_calls_stream_as_the_json_read_from_the_whole_answer(seed):
    """Qwen3.5's XML calls: the name first, a string parameter's text as it comes (a closing tag's beginning held
    back, quotes and newlines escaped as JSON), a typed value once its element closes; joined, the arguments are
    exactly the `arguments` read from the whole answer (`json.dumps` of the typed values), nothing sent at the end."""
    answer = "I will write it.\n" + xml("write_file", path="a.py", text=CODE + "\n</para", mode="420",
                                         tags='["x", 1]') + "\n" + xml("add", a="1.5", b="2")  # fmt: skip
    parts = streamed(answer, seed, names=SCHEMAS)
    read = read_calls(answer, SCHEMAS)[1]
    assert joined(parts) == list(read) and len(read) == 2
    assert json.loads(read[0].arguments) == {"path": "a.py", "text": CODE + "\n</para", "mode": 420, "tags": ["x", 1]}
    text = [part.arguments for part in parts if part.index == 0 and part.arguments]
    assert len(text) > 10  # the file's text in pieces as it was written
    empty = xml("add")
    assert (
        joined(streamed(empty, seed, names=SCHEMAS)) == [ToolCall("add", "{}")] == list(read_calls(empty, SCHEMAS)[1])
    )


def test_xml_calls_without_schemas_send_their_values_once_read():
    """Offered by name only (no schemas): no value is known to be a string, so each goes whole once its element
    closes, typed as `forerun.tool_xml` reads it."""
    answer = xml("add", a="1", b="two")
    parts = streamed(answer, names={"add"})
    assert joined(parts) == list(read_calls(answer, {"add"})[1]) == [ToolCall("add", '{"a": 1, "b": "two"}')]


def streamed_after_mark(answer: str, at: int, names=NAMES, seed: int = 0) -> list[CallPart]:
    """Every part a stream sends for `answer` whose calls begin at `at`, after a mark the decoded text dropped."""
    stream, parts, upto = CallStream(names), [], 0
    pick = random.Random(seed)
    while upto < len(answer):
        upto = min(len(answer), upto + pick.randint(1, 7))
        if upto >= at:
            stream.mark_at(at)
        parts += stream.follow(answer[:upto])
    stream.mark_at(at)
    return parts + stream.finish(answer, read_calls(answer, names, at)[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_calls_after_a_mark_stream_as_mistrals_templates_write_them(seed):
    """After `[TOOL_CALLS]` (decoded out): Mistral's newer `name[ARGS]{...}` calls one after another, and v0.3's JSON
    list; each goes out as it is written, joined the calls `read_calls` reads from the mark on. LFM2's Python list
    (after its own mark) and a function not offered are not followed: they come whole at the end."""
    words = "Let me add."
    for calls in ('add{"a": 1, "b": 2}write_file{"path": "x", "text": "' + "y" * 60 + '"}',
                  ' [{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                  '{"name": "add", "arguments": {"a": 1}}'):  # fmt: skip
        answer = words + calls
        parts = streamed_after_mark(answer, len(words), seed=seed)
        read = read_calls(answer, NAMES, len(words))[1]
        assert read and same(joined(parts), read), calls
        assert len([part for part in parts if part.arguments]) > len(read), calls  # in pieces, not whole
    python = words + "[add(a=1)]"
    assert streamed_after_mark(python, len(words), seed=seed) == [CallPart(0, "add", '{"a": 1}', True)]
    assert streamed_after_mark(words + 'other{"a": 1}', len(words), seed=seed) == []
