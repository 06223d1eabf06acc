"""OpenAI's Responses API on a live server (the embedded SmolLM2-135M-Instruct with the shipped `chatml-tools`
template), driven by the official openai client and its strict stream helper: every answer is plain generate's
text from the conversation the items stand for (or the chat completion's where that is tested against it), its
calls, its JSON and its log-probabilities the chat completion's; stateless fields and hosted tools are 400s that
name what the client sent."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from openai import BadRequestError, OpenAI
from test_server import MODEL, LiveServer

import forerun
from forerun.server import ServerConfig, create_app
from forerun.tool_specs import shipped_template

pytestmark = pytest.mark.real_model
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}  # fmt: skip
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ASK = "What is the weather like in Paris today?"
NEW = 24


@pytest.fixture(scope="module")
def served(smollm2):
    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = shipped_template("chatml-tools")  # as `forerun serve --chat-template chatml-tools`
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=64)))
    yield server, model, tokenizer
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def plain(served, messages, new: int = NEW, tools=None) -> forerun.GenerationResult:
    _, model, tokenizer = served
    return forerun.Decoder(model, tokenizer, "plain").generate(messages, new, tools=tools)


def test_a_response_is_plain_generates_answer_streamed_or_not(served, client):
    """`instructions` and the input are the system's and the user's messages; the text is plain generate's,
    `incomplete` where it reached `max_output_tokens`; streamed through the SDK's strict helper, the same."""
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": ASK}]
    expected = plain(served, messages)
    assert expected.finish_reason == "length"  # the test means something: the answer was cut, and said so
    response = client.responses.create(model=MODEL, instructions=messages[0]["content"], input=ASK,
                                       max_output_tokens=NEW, temperature=0, store=False)  # fmt: skip
    assert response.output_text == expected.text and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == NEW and response.usage.input_tokens == expected.prompt_len
    assert response.id.startswith("resp_") and response.store is False and response.model_extra["forerun"]
    with client.responses.stream(model=MODEL, instructions=messages[0]["content"], input=ASK,
                                 max_output_tokens=NEW, temperature=0) as stream:  # fmt: skip
        events = list(stream)
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.text and len(deltas) > 1
    assert events[-1].type == "response.incomplete"  # as OpenAI ends such a stream (not response.completed)
    assert events[-1].response.output_text == expected.text and events[-1].response.usage.output_tokens == NEW


def test_a_developer_message_joins_the_instructions_as_the_system_message(served, client):
    """Codex sends its instructions as a developer message: this template names no such role, so it is a system
    message, one with `instructions` (a template takes a system message only first), as plain generate reads it."""
    items = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": ASK}]
    merged = [{"role": "system", "content": "Answer in one sentence.\n\nAnswer in French."}, items[1]]
    expected = plain(served, merged)
    response = client.responses.create(model=MODEL, instructions="Answer in one sentence.", input=items,
                                       max_output_tokens=NEW)  # fmt: skip
    assert response.output_text == expected.text and response.usage.input_tokens == expected.prompt_len


def test_a_required_call_is_the_chat_completions_call(client):
    """Tools in the Responses shape; a required call comes as a function_call item, the same call the chat
    completion makes; streamed, its arguments come in the events OpenAI sends."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          tools=[CHAT_WEATHER], tool_choice="required")  # fmt: skip
    made = chat.choices[0].message.tool_calls[0].function
    response = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required")
    (call,) = response.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, call.arguments) == (made.name, made.arguments) == ("get_weather", '{"city": "Paris"}')
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    assert final.output[0].arguments == made.arguments and kinds[-1] == "response.completed"


def test_a_calls_output_goes_back_as_the_tools_message(served, client):
    """A function call and its output sent back as items are the assistant's call and the tool's message: the
    answer is plain generate's from that conversation."""
    output = '{"sky": "clear", "celsius": 21}'
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": output}]  # fmt: skip
    turns = [{"role": "user", "content": ASK},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": output}]  # fmt: skip
    expected = plain(served, turns, 48, tools=[CHAT_WEATHER])
    response = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=48)
    assert expected.tool_calls == () and response.output_text == expected.text
    assert [item.type for item in response.output] == ["message"]


def test_json_and_logprobs_are_the_chat_completions(client):
    """`text.format` holds the answer to a schema as `response_format` does; asked by `include`, the message's
    log-probabilities are the chat completion's, streamed or not. A token a step (`plain`): drafted trees of other
    shapes may take the other side of a near-tie, and this asks for the same computation, not for exactness."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    ask = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    plain = {"forerun": {"method": "plain"}}
    chat = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=32, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        extra_body=plain)  # fmt: skip
    kwargs = {"model": MODEL, "input": ask, "max_output_tokens": 32, "top_logprobs": 2,
              "include": ["message.output_text.logprobs"], "extra_body": plain,
              "text": {"format": {"type": "json_schema", "name": "city", "schema": schema}}}  # fmt: skip
    response = client.responses.create(**kwargs)
    assert response.output_text == chat.choices[0].message.content and json.loads(response.output_text)["city"]
    logprobs = response.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert same_logprobs(logprobs, expected) and len(logprobs) == chat.usage.completion_tokens
    with client.responses.stream(**kwargs) as stream:
        streamed = [e for event in stream if event.type == "response.output_text.delta" for e in event.logprobs]
    assert same_logprobs(streamed, expected)


def same_logprobs(got, expected) -> bool:
    """The same tokens and alternatives, their log-probabilities equal up to a forward's rounding (each request's
    tree, drafted from what the trie learnt by then, is another shape of the same computation)."""
    tokens = [(e.token, [t.token for t in e.top_logprobs]) for e in got]
    values = [[e.logprob, *(t.logprob for t in e.top_logprobs)] for e in got]
    wanted = [[e.logprob, *(t.logprob for t in e.top_logprobs)] for e in expected]
    return tokens == [(e.token, [t.token for t in e.top_logprobs]) for e in expected] and values == [
        pytest.approx(row, abs=1e-4) for row in wanted
    ]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "not stored"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]", "input_image"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "web_search"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens must be"),
        ({"input": [{"role": "user", "content": "\ud800"}]}, "input[0].content", "surrogate"),
        ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f",
          "arguments": "[1]"}]}, "input[1].arguments", "object"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         "text.format", ""),
        ({"include": ["file_search_call.results"]}, "include", "file_search_call"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning.effort is not supported"),
        ({"truncation": "auto"}, "truncation", "refused, not cut"),
        ({"unknown_field": 1}, "unknown_field", "unrecognized"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field_sent(served, body, param, fragment):
    url = served[0].url + "/v1/responses"
    sent = json.dumps({"model": MODEL, "input": "Hi", "max_output_tokens": 4, **body})  # lone surrogates escaped
    refused = httpx.post(url, content=sent, headers={"content-type": "application/json"}, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_a_bad_request_leaves_the_next_one_answered(served, client):
    with pytest.raises(BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "computer_call"}])
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=4).output_text


def test_a_stream_the_client_leaves_stops_and_frees_its_place(served, client):
    """A Responses stream read to its first delta, then dropped: its generation stops (the queue empties at once,
    not after 64 tokens) and the next request is answered as plain generate writes it; metrics count the route."""
    server = served[0]
    body = {"model": MODEL, "input": "Write a long story about a lighthouse keeper.", "max_output_tokens": 64,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                break  # one delta read, then hang up
    assert server.queue_after(10) == 0
    messages = [{"role": "user", "content": "Name three colours."}]
    assert client.responses.create(model=MODEL, input=messages, max_output_tokens=8).output_text == (
        plain(served, messages, 8).text
    )
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'forerun_requests_total{endpoint="/v1/responses",status="200"}' in metrics
