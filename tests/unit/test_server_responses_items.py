"""The Responses API without a model or uvicorn: its items read as chat messages (`server.responses_input`), its
errors naming the fields sent, and its response objects and events (`server.responses_shaping`) in the order
OpenAI's SDK accumulates them."""

from __future__ import annotations

import json

import pytest
import torch
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from forerun.decoder import GenerationResult
from forerun.server.fields import APIError
from forerun.server.responses_input import chat_request
from forerun.server.responses_shaping import Events, Reply, answered, settings_of
from forerun.server.schemas import ResponsesRequest
from forerun.server.translate import Limits, translate
from forerun.stats import GenerationStats
from forerun.thoughts import Thought
from forerun.tool_calls import ToolCall
from forerun.tool_stream import CallPart

CALL = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"}
THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]}


def messages(items, **fields) -> list[dict]:
    chat, _ = chat_request(ResponsesRequest(input=items, **fields))
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_an_assistants_words_and_calls_are_one_turn_and_a_thought_joins_the_message_after_it():
    items = [{"role": "user", "content": "Hi"}, THOUGHT, {"role": "assistant", "content": "Let me see."}, CALL,
             {**CALL, "call_id": "c2"}, {"type": "function_call_output", "call_id": "c1", "output": "noon"},
             THOUGHT, CALL]  # fmt: skip
    got = messages(items)
    assert [m["role"] for m in got] == ["user", "assistant", "tool", "assistant"]
    assert got[1]["reasoning_content"] == "Hm." and got[1]["content"] == "Let me see."
    assert [call["id"] for call in got[1]["tool_calls"]] == ["c1", "c2"]
    assert got[2] == {"role": "tool", "content": "noon", "tool_call_id": "c1"}
    assert got[3]["reasoning_content"] == "Hm." and got[3]["tool_calls"][0]["function"]["name"] == "now"


def test_text_parts_are_joined_and_a_string_input_is_the_users_message():
    parts = [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b", "annotations": []}]
    assert messages([{"type": "message", "role": "developer", "content": parts}]) == [
        {"role": "developer", "content": "ab"}
    ]
    assert messages("Hi", instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


@pytest.mark.parametrize(
    ("items", "fields", "param"),
    [
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], {}, "input[0].content[0]"),
        ([{"role": "tool", "content": "x"}], {}, "input[0].role"),
        ([{"role": "user", "content": 5}], {}, "input[0].content"),
        ([{"role": "user", "content": "Hi", "cache_control": {}}], {}, "input[0]"),
        (["Hi"], {}, "input[0]"),
        ([{"type": "function_call_output", "output": "x"}], {}, "input[0].call_id"),
        ([{**CALL, "arguments": "{"}], {}, "input[0].arguments"),
        ([{**CALL, "arguments": "[" * 100000}], {}, "input[0].arguments"),
        ([{"type": "reasoning", "content": "Hm."}], {}, "input[0]"),
        ([{"type": "mcp_call"}], {}, "input[0].type"),
        ("Hi", {"tools": [{"type": "function", "name": "f", "function": {}}]}, "tools[0]"),
        ("Hi", {"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ("Hi", {"text": {"verbosity": "low"}}, "text"),
        ("Hi", {"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ("Hi", {"top_logprobs": 3}, "top_logprobs"),
        ("Hi", {"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ("Hi", {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
        ("Hi", {"background": True}, "background"),
        ("Hi", {"conversation": "conv_1"}, "conversation"),
        ("Hi", {"max_tool_calls": 2}, "max_tool_calls"),
    ],
)
def test_each_refusal_names_the_responses_field(items, fields, param):
    with pytest.raises(APIError) as refused:
        chat_request(ResponsesRequest(input=items, **fields))
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_translates_errors_name_the_item_the_message_came_from():
    limits = Limits(model_name="m", max_tokens_limit=8)
    chat, rename = chat_request(ResponsesRequest(input=[{"role": "user", "content": " "}], instructions=" "))
    with pytest.raises(APIError) as refused:
        translate(chat, limits)
    assert rename(refused.value).param == "input"
    chat, rename = chat_request(ResponsesRequest(input="Hi", max_output_tokens=9))
    with pytest.raises(APIError) as refused:
        translate(chat, limits)
    error = rename(refused.value)
    assert error.param == "max_output_tokens" and error.message.startswith("max_output_tokens must be")
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    chat, _ = chat_request(ResponsesRequest(input="Hi", tools=[tool], tool_choice={"type": "function", "name": "f"}))
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "strict": True}}]  # fmt: skip
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}


class Pieces:
    PIECES = ["<think>", "Hm", "</think>", "Hi", "!"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids)


def answer(reason="stop", calls=None, thought=True) -> GenerationResult:
    stats = GenerationStats(forwards=3, new_tokens=5)
    text = "Hm Hi!" if thought else "Hi!"
    return GenerationResult(
        torch.tensor([[9, 0, 1, 2, 3, 4]]),
        1,
        text,
        stats,
        ["model"] * 5,
        finish_reason=reason,
        tool_calls=calls,
        thought=Thought(0, 2, 3, 3) if thought else None,
    )


def test_a_whole_response_has_its_thought_its_message_and_its_calls_in_order():
    reply = Reply("resp_1", 5, "m", settings_of(ResponsesRequest(input="Hi")))
    body = answered(reply, answer("tool_calls", (ToolCall("now", "{}"),)), Pieces(), "auto", False)
    assert Response.model_validate(body).output_text == "Hi!"  # every field OpenAI's SDK requires, of its types
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "Hm" and body["output"][1]["content"][0]["text"] == "Hi!"
    assert body["status"] == "completed" and body["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert answered(reply, answer("length", thought=False), Pieces(), "auto", False)["incomplete_details"] == {
        "reason": "max_output_tokens"
    }


def replayed(events: list[str]):
    """The events through the SDK's own stream state (it raises where their order or ids are not OpenAI's)."""
    state = ResponseStreamState(input_tools=[], text_format=omit)
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(json.loads(event.split("data: ", 1)[1])) for event in events]
    for event in parsed:
        state.handle_event(event)
    return parsed


def test_streamed_events_are_in_the_order_the_sdk_accumulates():
    events = Events(Reply("resp_1", 5, "m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}))
    sent = [*events.opening(), *events.reasoning("H"), *events.reasoning("m"), *events.text("Hi", None),
            *events.text("!", None), *events.call(CallPart(0, "now", "", False)),
            *events.call(CallPart(0, None, "{", False)), *events.call(CallPart(0, None, "}", True)),
            *events.call(CallPart(1, "add", '{"a": 1}', True)),
            *events.finish(answer("tool_calls", (ToolCall("now", "{}"), ToolCall("add", '{"a": 1}'))),
                           "auto")]  # fmt: skip
    parsed = replayed(sent)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    final = parsed[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == [
        "reasoning", "message", "function_call", "function_call"
    ]  # fmt: skip
    assert [(item.name, item.arguments, item.status) for item in final.output[2:]] == [
        ("now", "{}", "completed"), ("add", '{"a": 1}', "completed")
    ]  # fmt: skip
    assert sum(e.type == "response.function_call_arguments.delta" for e in parsed) == 3
    assert final.output[1].content[0].text == "Hi!" and final.output[0].content[0].text == "Hm"
    assert all(event.startswith(f"event: {e.type}\n") for event, e in zip(sent, parsed, strict=True))


def test_an_empty_answer_is_an_empty_message_and_a_failure_keeps_what_was_written():
    events = Events(Reply("resp_1", 5, "m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}))
    parsed = replayed([*events.opening(), *events.finish(answer(thought=False), "plain")])
    assert parsed[-1].response.output[0].content[0].text == ""
    events = Events(Reply("resp_2", 5, "m", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}))
    gone = APIError(500, "gone", kind="server_error")
    parsed = replayed([*events.opening(), *events.text("Hi", None), *events.fail(gone)])
    assert parsed[-1].type == "response.failed" and parsed[-1].response.error.message == "gone"
    assert parsed[-1].response.output[0].status == "incomplete"
