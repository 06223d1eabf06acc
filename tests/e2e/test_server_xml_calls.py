"""Qwen3.5's XML calls on a live server (a tiny random model, a template shaped as Qwen3.5's): a required call is
plain generate's held text read as OpenAI's `tool_calls`, and streamed as it is written (its name, then its
arguments in pieces: a string's text as it comes, a number once its element closes), in a chat completion and in
the Messages API alike."""

from __future__ import annotations

import json

import anthropic
import pytest
from openai import OpenAI
from test_server import LiveServer

from forerun.server import ServerConfig, create_app
from forerun.tool_calls import read_calls
from forerun.tool_specs import parameters_of

from tiny_models import byte_tokenizer, tiny_model
from tool_templates import QWEN35_XML, held_answer

PLACE = {"type": "function", "function": {"name": "place", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Oslo", "Paris", "Saint-Étienne"]}, "a": {"type": "integer", "minimum": 0,
    "maximum": 9}}, "required": ["city", "a"], "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "Where?"}]
NEW = 160
MODEL = "tiny-qwen35"


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = QWEN35_XML
    model = tiny_model("llama", "sdpa", seed=1, vocab_size=len(tokenizer), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=NEW)))
    yield server, model, tokenizer
    server.stop()


def test_a_required_xml_call_streams_as_it_is_written_in_chat_and_messages(served):
    server, model, tokenizer = served
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    one = {"tools": [PLACE], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": NEW}
    (call,) = client.chat.completions.create(model=MODEL, messages=ASK, **one).choices[0].message.tool_calls
    text = held_answer(model, tokenizer, ASK, [PLACE], "required", NEW, parallel=False)
    (read,) = read_calls(text, parameters_of([PLACE]))[1]
    assert (call.function.name, call.function.arguments) == (read.name, read.arguments), text
    assert set(json.loads(read.arguments)) == {"city", "a"} and "<function=place>" in text
    plain = {"forerun": {"method": "plain"}}  # a token a step: drafted, a step may bring the whole call
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, extra_body=plain, **one))
    pieces = [c for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls
              for c in chunk.choices[0].delta.tool_calls]  # fmt: skip
    assert pieces[0].function.name == "place" and len(pieces) > 5  # the name, the city's text, `a`
    assert "".join(piece.function.arguments for piece in pieces) == read.arguments
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "place", "input_schema": PLACE["function"]["parameters"]}
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    with messages.messages.stream(
        model=MODEL, max_tokens=NEW, messages=ASK, tools=[tool], tool_choice=any_one, extra_body=plain
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds.count("input_json") > 5 and final.content[0].input == json.loads(read.arguments)
