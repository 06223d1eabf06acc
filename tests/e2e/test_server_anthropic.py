"""Anthropic's Messages API on a live server (the embedded SmolLM2-135M-Instruct with the shipped `chatml-tools`
template), driven by the official anthropic client and its stream helper: every answer is plain generate's text
from the conversation the blocks stand for, its tool use the chat completion's call; errors come in Anthropic's
shape, naming the field sent, and the key is taken in `x-api-key` as Anthropic's clients send it."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._beta_messages import accumulate_event
from anthropic.types.beta import BetaRawMessageStreamEvent
from openai import OpenAI
from pydantic import TypeAdapter
from test_server import MODEL, LiveServer

import forerun
from forerun.server import ServerConfig, create_app
from forerun.server.context_edits import PLACEHOLDER
from forerun.tool_specs import shipped_template

pytestmark = pytest.mark.real_model
KEY = "k3y"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}  # fmt: skip
ASK = "What is the weather like in Paris today?"
NEW = 24


@pytest.fixture(scope="module")
def served(smollm2):
    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = shipped_template("chatml-tools")  # as `forerun serve --chat-template chatml-tools`
    config = ServerConfig(MODEL, "auto", max_tokens_limit=64, api_key=KEY)
    server = LiveServer(create_app(model, tokenizer, config))
    yield server, model, tokenizer
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0].url, api_key=KEY, max_retries=0, timeout=120)


def plain(served, messages, new: int = NEW, tools=None) -> forerun.GenerationResult:
    _, model, tokenizer = served
    return forerun.Decoder(model, tokenizer, "plain").generate(messages, new, tools=tools)


def test_a_message_is_plain_generates_answer_streamed_or_not(served, client):
    """`system` and the user's message as chat's; the text is plain generate's, `max_tokens` its stop reason, the
    prompt's tokens split between read and cached; streamed through the SDK's helper, the same; counted first."""
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": ASK}]
    expected = plain(served, messages)
    assert expected.finish_reason == "length"
    ask = {"model": MODEL, "max_tokens": NEW, "system": messages[0]["content"], "messages": messages[1:]}
    counted = client.messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"})
    message = client.messages.create(**ask)
    assert message.content[0].text == expected.text and message.stop_reason == "max_tokens"
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.prompt_len
    assert counted.input_tokens == expected.prompt_len and message.usage.output_tokens == NEW
    assert message.id.startswith("msg_") and message.model_extra["forerun"]["forwards"]
    with client.messages.stream(**ask) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == expected.text and len(pieces) > 1
    assert final.content[0].text == expected.text and final.stop_reason == "max_tokens"


def test_a_stop_sequence_ends_the_answer_and_is_named(served, client):
    messages = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    expected = plain(served, messages, 48).text
    words = expected.split()
    stop = words[len(words) // 2]  # a piece the answer holds: it ends where that piece first stands
    message = client.messages.create(model=MODEL, max_tokens=48, messages=messages, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == expected[: expected.index(stop)]


def test_a_tool_use_is_the_chat_completions_call_and_its_result_goes_back(served, client):
    """`tool_choice` any: a tool_use block holding the call the chat completion makes, streamed the same; the
    tool's result sent back is the tool's message, and the answer plain generate's from that conversation."""
    chat = OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}  # fmt: skip
    made = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[tool],
                                        tool_choice="required").choices[0].message.tool_calls[0].function  # fmt: skip
    ask = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": ASK}], "tools": [WEATHER]}
    message = client.messages.create(**ask, tool_choice={"type": "any"})
    (use,) = message.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and message.stop_reason == "tool_use"
    assert (use.name, use.input) == (made.name, {"city": "Paris"}) and made.arguments == '{"city": "Paris"}'
    with client.messages.stream(**ask, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"
    result = '{"sky": "clear", "celsius": 21}'
    back = [
        *ask["messages"],
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]},
    ]
    turns = [ask["messages"][0],
             {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": use.id, "content": result}]  # fmt: skip
    expected = plain(served, turns, 48, tools=[tool])
    answer = client.messages.create(model=MODEL, max_tokens=48, messages=back, tools=[WEATHER])
    assert expected.tool_calls == () and [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == expected.text


def test_context_edits_as_claude_code_asks_answer_the_edited_conversation(served, client):
    """`context_management` (Claude Code sends it): past the trigger the older tool result is the placeholder, and
    the answer is the one to the conversation so edited by hand; the message, its stream's last delta (the SDK's
    beta types) and count_tokens say what was cleared."""
    asked = [{"role": "user", "content": "What is the weather like in Paris and in Lyon?"}]
    for i, (city, said) in enumerate((("Paris", "Sunny and warm, " * 40), ("Lyon", "Rain."))):
        call = {"type": "tool_use", "id": f"t{i}", "name": "get_weather", "input": {"city": city}}
        answered = {"type": "tool_result", "tool_use_id": f"t{i}", "content": said}
        asked += [{"role": "assistant", "content": [call]}, {"role": "user", "content": [answered]}]
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                       {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
                        "keep": {"type": "tool_uses", "value": 1}}]}  # fmt: skip
    ask = {"model": MODEL, "max_tokens": NEW, "tools": [WEATHER], "betas": ["context-management-2025-06-27"]}
    by_hand = copy.deepcopy(asked)
    by_hand[2]["content"][0]["content"] = PLACEHOLDER
    expected = client.beta.messages.create(**ask, messages=by_hand)
    message = client.beta.messages.create(**ask, messages=asked, context_management=edits)
    assert [b.model_dump() for b in message.content] == [b.model_dump() for b in expected.content]
    assert expected.context_management is None
    (applied,) = message.context_management.applied_edits
    assert (applied.type, applied.cleared_tool_uses) == ("clear_tool_uses_20250919", 1)
    counted = client.beta.messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"},
                                                messages=asked, context_management=edits)  # fmt: skip
    whole = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=asked).input_tokens
    assert counted.context_management.original_input_tokens == whole
    assert whole - counted.input_tokens == applied.cleared_input_tokens > 100
    with client.beta.messages.stream(**ask, messages=asked, context_management=edits) as stream:
        final = stream.get_final_message()
    assert final.context_management.applied_edits == message.context_management.applied_edits
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in expected.content]


def test_an_output_format_holds_the_answer_to_its_schema_as_chats_response_format(served, client):
    """`output_config.format` (Anthropic's structured outputs): the text is the chat completion's under the same
    schema as `response_format`, JSON that holds to it."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    chat = OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    made = chat.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}},
    ).choices[0].message.content  # fmt: skip
    message = client.messages.create(model=MODEL, max_tokens=48, messages=[{"role": "user", "content": ASK}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    assert message.content[0].text == made and set(json.loads(made)) == {"city"}


def test_a_request_shaped_as_claude_codes_is_answered_as_its_messages_alone(served, client):
    """Claude Code's request: streamed to `?beta=true` with its beta header, a system prompt in cached blocks,
    metadata, top-level cache_control, `output_config.effort`, adaptive thinking, `context_management`, tools with
    `defer_loading` and `eager_input_streaming`: the answer is the one to its system prompt, messages and tools."""
    system = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
    ask = {"model": MODEL, "max_tokens": NEW, "system": system, "tools": [WEATHER],
           "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}]}]}  # fmt: skip
    expected = client.messages.create(**ask)
    body = {**ask, "stream": True, "metadata": {"user_id": "user_1_account_2_session_3"},
            "cache_control": {"type": "ephemeral"}, "output_config": {"effort": "high"},
            "thinking": {"type": "adaptive"}, "tools": [{**WEATHER, "defer_loading": False,
                                                        "eager_input_streaming": True}],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}  # fmt: skip
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,effort-2025-11-24"}  # fmt: skip
    url = served[0].url + "/v1/messages?beta=true"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        data = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    adapter, snapshot, buffers = TypeAdapter(BetaRawMessageStreamEvent), None, {}
    for event in data:
        snapshot = accumulate_event(event=adapter.validate_python(event), current_snapshot=snapshot,
                                    json_bufs=buffers, request_headers=httpx.Headers())  # fmt: skip
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == [
        b.model_dump(exclude_none=True) for b in expected.content
    ]  # fmt: skip
    assert snapshot.stop_reason == expected.stop_reason and snapshot.context_management.applied_edits == []


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"max_tokens": 100000}, "max_tokens must be between"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' blocks"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
        ({"extra_body": {"betas": ["x"]}}, "unrecognized request field 'betas'"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"extra_body": {"context_management": {"edits": [{"type": "compact_20260112"}]}}}, "edits[0]: compaction"),
    ],
)
def test_errors_come_in_anthropics_shape_naming_the_field(served, client, body, fragment):
    sent = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**sent)
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"], error


def test_the_key_is_taken_as_anthropics_clients_send_it(served):
    url = served[0].url + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    wrong = httpx.post(url, json=body, headers={"x-api-key": "nope"}, timeout=60)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    twice = httpx.post(url, json=body, headers=[("x-api-key", KEY), ("x-api-key", KEY)], timeout=60)
    assert twice.status_code == 400
    bearer = httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def test_a_served_name_of_the_clients_own_is_taken(smollm2):
    """`--served-model-name`: the first name is the model's in every answer, the others taken in a request's
    `model` (Claude Code asks for its quick tasks by a model name of its own); any other name is a 404 naming
    those served."""
    model, tokenizer = smollm2
    config = ServerConfig("local-coder", "plain", max_tokens_limit=8, aliases=("claude-haiku-4-5",))
    server = LiveServer(create_app(model, tokenizer, config))
    try:
        listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert [entry["id"] for entry in listed] == ["local-coder", "claude-haiku-4-5"]
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        message = client.messages.create(
            model="claude-haiku-4-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.model == "local-coder" and message.content
        with pytest.raises(anthropic.NotFoundError) as unknown:
            client.messages.create(model="claude-opus-4-1", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert "'local-coder', 'claude-haiku-4-5'" in unknown.value.body["error"]["message"]
    finally:
        server.stop()


def test_a_prefilled_answer_is_continued_as_plain_generate_continues_it(served, client):
    """Anthropic's prefill (the last message an assistant's words) and vLLM's `continue_final_message` in chat:
    the answer is what follows those words, plain generate's from the template's rendering with them left open;
    counted the same by count_tokens and /tokenize. `add_generation_prompt` false alone is refused by name."""
    server, model, tokenizer = served
    turns = [{"role": "user", "content": "Describe Paris in one sentence."},
             {"role": "assistant", "content": "Paris is a city"}]  # fmt: skip
    request = forerun.GenerationRequest(turns, NEW, continue_final_message=True)
    expected = forerun.Decoder(model, tokenizer, "plain").generate(request)
    message = client.messages.create(model=MODEL, max_tokens=NEW, messages=turns)
    assert message.content[0].text == expected.text and expected.text != plain(served, turns[:1]).text
    chat = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    answer = chat.chat.completions.create(model=MODEL, messages=turns, max_tokens=NEW, extra_body=continued)
    assert answer.choices[0].message.content == expected.text
    counted = client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": turns, "continue_final_message": True},
                           headers={"authorization": f"Bearer {KEY}"}, timeout=60).json()  # fmt: skip
    assert counted == tokenized["count"] == expected.prompt_len
    alone = {"model": MODEL, "messages": turns, "max_tokens": 4, "add_generation_prompt": False}
    refused = httpx.post(server.url + "/v1/chat/completions", json=alone, headers={"authorization": f"Bearer {KEY}"},
                         timeout=60)  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_generation_prompt"


def test_the_three_apis_share_the_batch_and_each_answer_is_its_own(served, client):
    """A chat completion, a Responses request and a Messages request (streamed and not) at once, decoded side by
    side in the continuous batch: each answer is plain generate's for its own conversation."""
    from concurrent.futures import ThreadPoolExecutor

    server = served[0]
    chat = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    asks = ["Name three colours.", "Write a haiku about the sea.", "What is 2 + 2?", "Describe a cat."]
    expected = [plain(served, [{"role": "user", "content": ask}]).text for ask in asks]

    def streamed_message(ask: str) -> str:
        with client.messages.stream(model=MODEL, max_tokens=NEW, messages=[{"role": "user", "content": ask}]) as s:
            return "".join(s.text_stream)

    calls = [
        lambda: chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": asks[0]}],
                                             max_tokens=NEW).choices[0].message.content,
        lambda: chat.responses.create(model=MODEL, input=asks[1], max_output_tokens=NEW).output_text,
        lambda: client.messages.create(model=MODEL, max_tokens=NEW,
                                       messages=[{"role": "user", "content": asks[2]}]).content[0].text,
        lambda: streamed_message(asks[3]),
    ]  # fmt: skip
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: call(), calls))
    assert answers == expected
