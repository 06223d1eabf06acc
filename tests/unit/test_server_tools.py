"""A chat request's tools, without a model or a server: what translates (tools, tool_choice, a conversation's calls
and answers), every refusal naming its field, and the response's calls."""

from __future__ import annotations

import json

import pytest
import torch

from forerun.decoder import GenerationResult
from forerun.server import shaping
from forerun.server.schemas import ChatRequest
from forerun.server.translate import APIError, Limits, translate
from forerun.stats import GenerationStats
from forerun.tool_calls import ToolCall
from forerun.tool_stream import CallPart

TAKES = Limits(model_name="tiny", method="auto", max_tokens_limit=64, vocab_size=1000, tools=True)
PLAIN = Limits(model_name="tiny", method="auto", max_tokens_limit=64, vocab_size=1000)
HI = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
DEEP = '{"a":' * 80 + "1" + "}" * 80
"""Arguments nested 80 levels: JSON, but deeper than anything a request may nest."""
MADE = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def chat(limits=TAKES, **fields):
    return translate(ChatRequest(**{"messages": HI, **fields}), limits)


def test_tools_and_a_conversations_calls_reach_the_request():
    args = chat(tools=[WEATHER])
    assert args.tools == (WEATHER,) and args.tool_choice == "auto" and args.parallel_tool_calls
    request = args.request()
    assert request.shown_tools == (WEATHER,) and request.held_format is None
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False).request()  # fmt: skip
    assert named.held_format == {"type": "tool_calls", "tools": (WEATHER,), "name": "get_weather", "parallel": False}
    assert chat(tools=[WEATHER], tool_choice="none").request().shown_tools is None
    assert chat(PLAIN, tools=[WEATHER], tool_choice="none").tool_choice == "none"  # shown to no template: fine
    turns = [*HI, {"role": "assistant", "tool_calls": [MADE]},
             {"role": "tool", "tool_call_id": "call_9", "content": '{"sky": "clear"}'}]  # fmt: skip
    assert chat(messages=turns, tools=[WEATHER]).prompt[1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_9"},
    ]  # fmt: skip


def made(**function) -> dict:
    return {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}", **function}}


@pytest.mark.parametrize(
    ("limits", "fields", "param", "fragment"),
    [
        (PLAIN, {"tools": [WEATHER]}, "tools", "its chat template does not teach tool calls"),
        (PLAIN, {"messages": [*HI, {"role": "assistant", "tool_calls": [made()]}]}, "messages[1].tool_calls",
         "cannot be shown"),
        (TAKES, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
        (TAKES, {"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "must be one of"),
        (TAKES, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice",
         "not one of the tools"),
        (TAKES, {"tool_choice": "required"}, "tool_choice", "needs tools"),
        (TAKES, {"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "together"),
        (TAKES, {"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "stop_token_ids"),
        (TAKES, {"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}],
                 "ignore_eos": True}, "ignore_eos", "stop_token_ids"),  # held once a call opens
        (TAKES, {"messages": [{"role": "user", "content": "x", "tool_calls": [made()]}]}, "messages[0].tool_calls",
         "only an assistant's"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [made(arguments="[1]")]}]},
         "messages[1].tool_calls[0]", "a JSON object's text"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [made(arguments="{")]}]},
         "messages[1].tool_calls[0]", "a JSON object's text"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [made(arguments="[" * 100000)]}]},
         "messages[1].tool_calls[0]", "a JSON object's text"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [made(arguments=DEEP)]}]},
         "messages[1].tool_calls[0]", "nest more than 64"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "c", "function": "x"}]}]},
         "messages[1].tool_calls[0]", "must be"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [made(name=3)]}]},
         "messages[1].tool_calls[0]", "needs a name"),
        (TAKES, {"messages": [*HI, {"role": "assistant", "tool_calls": [made()] * 129}]}, "messages[1].tool_calls",
         "at most 128"),
        (TAKES, {"messages": [*HI, {"role": "tool", "content": "x", "tool_call_id": "a\ud800"}]},
         "messages[1].tool_call_id", "lone surrogate"),
        (TAKES, {"functions": [{"name": "a"}]}, "functions", "old form"),
        (TAKES, {"function_call": "auto"}, "function_call", "old form"),
    ],
)  # fmt: skip
def test_each_tools_refusal_is_a_400_naming_the_field(limits, fields, param, fragment):
    with pytest.raises(APIError) as caught:
        chat(limits, **fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert fragment in caught.value.message


class Pieces:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(str, ids))


def result(text: str, calls: tuple | None, reason: str) -> GenerationResult:
    stats = GenerationStats(forwards=2, new_tokens=4)
    sequences = torch.tensor([[7, 7, 0, 1, 2, 3]])
    return GenerationResult(sequences, 2, text, stats, ["model"] * 4, None, 0, reason, None, calls)


def test_a_response_carries_the_calls_its_content_and_reason():
    answer = shaping.Answer("chatcmpl-1", 5, "m", chat=True)
    text = 'Checking.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    calls = (ToolCall("get_weather", '{"city": "Oslo"}'),)
    message = shaping.completion(answer, [result(text, calls, "tool_calls")], "auto", Pieces())["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Checking."
    (made,) = message["message"]["tool_calls"]
    assert made["id"].startswith("call_") and made["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    bare = shaping.completion(answer, [result(text.split("\n")[1], calls, "tool_calls")], "auto", Pieces())
    assert bare["choices"][0]["message"]["content"] is None
    words = shaping.completion(answer, [result("Sunny.", (), "stop")], "auto", Pieces())["choices"][0]
    assert words["message"] == {"role": "assistant", "content": "Sunny.", "refusal": None}  # no tool_calls key
    first = json.loads(shaping.call_chunk(answer, CallPart(1, "get_weather", '{"ci', False), index=1)[6:])
    (choice,) = first["choices"]
    (opened,) = choice["delta"]["tool_calls"]
    assert choice["index"] == 1 and opened["index"] == 1 and opened["id"].startswith("call_") and opened["type"]
    assert opened["function"] == {"name": "get_weather", "arguments": '{"ci'} and first["object"].endswith("chunk")
    later = json.loads(shaping.call_chunk(answer, CallPart(1, None, 'ty": "Oslo"}', True), index=1)[6:])
    assert later["choices"][0]["delta"]["tool_calls"] == [{"index": 1, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert shaping.call_chunk(answer, CallPart(1, None, "", True)) is None  # a call's end alone carries nothing
