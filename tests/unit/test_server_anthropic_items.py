"""Anthropic's Messages API without a model or uvicorn: its content blocks read as chat messages
(`server.anthropic_input`), its errors naming the fields sent, and its messages and events
(`server.anthropic_shaping`) as Anthropic's SDK validates and accumulates them."""

from __future__ import annotations

import json

import pytest
import torch
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from forerun.decoder import GenerationResult
from forerun.server.anthropic_input import chat_request
from forerun.server.anthropic_shaping import Events, Reply, answered, stop_of
from forerun.server.fields import APIError
from forerun.server.schemas import AnthropicRequest
from forerun.server.translate import Limits, translate
from forerun.stats import GenerationStats
from forerun.thoughts import Thought
from forerun.tool_calls import ToolCall
from forerun.tool_stream import CallPart

USE = {"type": "tool_use", "id": "t1", "name": "now", "input": {"zone": "UTC"}}


def messages(blocks, **fields) -> list[dict]:
    chat, _ = chat_request(AnthropicRequest(max_tokens=8, messages=blocks, **fields))
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_blocks_are_chat_messages_tool_results_first_and_an_assistants_blocks_one_message():
    cached = {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
    got = messages([{"role": "user", "content": "What time is it?"},
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                                      {"type": "text", "text": "Let me see."}, USE]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon"},
                                                 {"type": "text", "text": "Thanks."}]}],
                   system=[cached, {"type": "text", "text": "Use French."}])  # fmt: skip
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "user"]
    assert got[0]["content"] == "Be brief.\n\nUse French." and got[4]["content"] == "Thanks."
    assert got[2]["reasoning_content"] == "Hm." and got[2]["content"] == "Let me see."
    assert got[2]["tool_calls"][0]["function"] == {"name": "now", "arguments": '{"zone": "UTC"}'}
    assert got[3] == {"role": "tool", "content": "noon", "tool_call_id": "t1"}


def test_tools_tool_choice_and_thinking_in_chats_shape():
    tool = {"name": "now", "description": "The time", "input_schema": {"type": "object"}}
    chat, _ = chat_request(AnthropicRequest(max_tokens=8, messages=[{"role": "user", "content": "Hi"}], tools=[tool],
                                            tool_choice={"type": "tool", "name": "now",
                                                         "disable_parallel_tool_use": True}))  # fmt: skip
    assert chat.tools == [{"type": "function", "function": {"name": "now", "description": "The time",
                                                            "parameters": {"type": "object"}}}]  # fmt: skip
    assert chat.tool_choice == {"type": "function", "function": {"name": "now"}} and chat.parallel_tool_calls is False
    hi = [{"role": "user", "content": "Hi"}]
    think = {"type": "disabled"}
    chat, _ = chat_request(AnthropicRequest(max_tokens=8, messages=hi, thinking=think), frozenset({"enable_thinking"}))
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    chat, _ = chat_request(AnthropicRequest(max_tokens=8, messages=hi, thinking=think))  # the template reads none
    assert chat.chat_template_kwargs is None


def test_claude_codes_fields_are_taken_effort_as_the_templates_and_a_format_as_a_json_schema():
    """What Claude Code sends beside its messages: `output_config.effort` is the template's `reasoning_effort`
    where it reads one (OpenAI's scale, max as high) and changes nothing elsewhere; `output_config.format` is
    chat's `response_format`; speed, top-level cache_control, metadata and ids, and its tools' `defer_loading`,
    `eager_input_streaming` and `input_examples` are taken."""
    hi = [{"role": "user", "content": "Hi"}]
    tool = {"name": "now", "input_schema": {"type": "object"}, "defer_loading": True, "eager_input_streaming": True,
            "input_examples": [{}], "allowed_callers": ["direct"], "cache_control": {"type": "ephemeral"}}  # fmt: skip
    body = AnthropicRequest(max_tokens=8, messages=hi, tools=[tool], output_config={"effort": "max"}, speed="fast",
                            cache_control={"type": "ephemeral"}, metadata={"user_id": "u"}, inference_geo="us",
                            diagnostics={}, user_profile_id="p", workspace_id="w",
                            thinking={"type": "adaptive", "display": "summarized"})  # fmt: skip
    chat, _ = chat_request(body, frozenset({"reasoning_effort"}))
    assert chat.chat_template_kwargs == {"reasoning_effort": "high"} and chat.tools[0]["function"]["name"] == "now"
    assert chat_request(body)[0].chat_template_kwargs is None
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    shaped = {"format": {"type": "json_schema", "schema": schema}}
    chat, _ = chat_request(AnthropicRequest(max_tokens=8, messages=hi, output_config=shaped))
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema,
                                                                           "strict": True}}  # fmt: skip


def test_thinking_omitted_shows_an_empty_thinking_block():
    reply = Reply("msg_1", "m", 2, thoughts=False)
    assert Message.model_validate(answered(reply, answer(), "auto", []))  # the SDK's own type
    assert answered(reply, answer(), "auto", [])["content"][0] == {"type": "thinking", "thinking": "",
                                                                    "signature": ""}  # fmt: skip
    events = Events(reply)
    sent = [*events.opening(), *events.reasoning("Hm"), *events.text("Hi")]
    assert not any("thinking_delta" in event for event in sent) and "content_block_start" in sent[1]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "system", "content": "Hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "assistant", "content": [{**USE, "input": "x"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
         "messages[0].content[0]"),
        ({"system": [{"type": "text", "text": 1}]}, "system[0]"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"thinking": {"type": "on"}}, "thinking"),
        ({"mcp_servers": [{}]}, "mcp_servers"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"task_budget": {"type": "tokens", "total": 9}}}, "output_config"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
        ({"speed": "warp"}, "speed"),
        ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking.display"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "allowed_callers": ["code_execution_20250825"]}]},
         "tools[0].allowed_callers"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "It is "}]},
         "messages[1].content"),
    ],
)  # fmt: skip
def test_each_refusal_names_the_field_sent(fields, param):
    with pytest.raises(APIError) as refused:
        chat_request(AnthropicRequest(**{"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **fields}))
    assert refused.value.param == param, refused.value.message


def test_translates_errors_name_anthropics_fields():
    limits = Limits(model_name="m", max_tokens_limit=8)
    for fields, param in (({"max_tokens": 9}, "max_tokens"), ({"stop_sequences": ["a"] * 5}, "stop_sequences"),
                          ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content")):  # fmt: skip
        body = AnthropicRequest(**{"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **fields})
        chat, rename = chat_request(body)
        with pytest.raises(APIError) as refused:
            translate(chat, limits)
        error = rename(refused.value)
        assert error.param == param and error.message.startswith(param.split("[")[0]), error.message


class Pieces:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(["<think>", "Hm", "</think>", "Hi", "!"][i] for i in ids)


def answer(reason="stop", calls=None, stop_at=None) -> GenerationResult:
    stats = GenerationStats(forwards=3, new_tokens=5, cached_prompt_tokens=1)
    return GenerationResult(torch.tensor([[9, 9, 0, 1, 2, 3, 4]]), 2, "Hm Hi!", stats, ["model"] * 5,
                            finish_reason=reason, tool_calls=calls, thought=Thought(0, 2, 3, 3),
                            stop_at=stop_at)  # fmt: skip


def test_a_whole_message_is_the_sdks_message():
    body = answered(Reply("msg_1", "m"), answer("tool_calls", (ToolCall("now", "{}"),)), "auto", [])
    message = Message.model_validate(body)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.stop_reason == "tool_use" and message.usage.input_tokens + message.usage.cache_read_input_tokens == 2
    assert stop_of(answer(stop_at=3), ["Hi", "!"]) == ("stop_sequence", "Hi")
    assert stop_of(answer("length"), []) == ("max_tokens", None)


def test_streamed_events_accumulate_in_the_sdk_to_the_message():
    events = Events(Reply("msg_1", "m", 2))
    sent = [*events.opening(), *events.reasoning("H"), *events.reasoning("m"), *events.text("Hi"),
            *events.text("!"), *events.call(CallPart(0, "now", '{"a', False)),
            *events.call(CallPart(0, None, '": 1', False)), *events.call(CallPart(0, None, "}", True)),
            *events.call(CallPart(1, "now", "{}", True)),
            *events.finish(answer("tool_calls", (ToolCall("now", '{"a": 1}'), ToolCall("now", "{}"))),
                           "auto")]  # fmt: skip
    adapter, snapshot, buffers = TypeAdapter(RawMessageStreamEvent), None, {}
    for event in sent:
        kind, data = event.split("\n")[0].removeprefix("event: "), json.loads(event.split("data: ", 1)[1])
        parsed = adapter.validate_python(data)
        assert parsed.type == kind
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=buffers)
    assert [block.type for block in snapshot.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert (snapshot.content[0].thinking, snapshot.content[1].text) == ("Hm", "Hi!")
    assert snapshot.content[2].input == {"a": 1} and snapshot.stop_reason == "tool_use"  # its input in 3 deltas
    assert snapshot.content[3].input == {} and snapshot.content[2].id != snapshot.content[3].id
    failed = Events(Reply("msg_2", "m"))
    last = [*failed.opening(), *failed.text("Hi"), *failed.fail(APIError(500, "gone"))]
    assert json.loads(last[-1].split("data: ", 1)[1]) == {"type": "error", "error": {"type": "api_error",
                                                                                     "message": "gone"}}  # fmt: skip
