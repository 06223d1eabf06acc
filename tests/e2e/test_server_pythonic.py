"""LFM2's calls on a live server (a tiny random model, a template shaped as LFM2's, its special tokens): a required
call is plain generate's held text read as OpenAI's `tool_calls`, streamed whole; a conversation that sends the
call back shows it to the template as the model writes it (in the assistant's content, between its marks)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from test_server import LiveServer

from forerun.server import ServerConfig, create_app
from forerun.tool_pythonic import pythonic_calls

from tiny_models import byte_tokenizer, tiny_model
from tool_templates import LFM2_MARKS, LFM2_PYTHONIC, held_answer

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 9}, "unit": {"enum": ["m", "s"]}},
    "required": ["a"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "Add 2 and 3."}]
NEW = 48


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": LFM2_MARKS})
    tokenizer.chat_template = LFM2_PYTHONIC
    model = tiny_model("llama", "sdpa", vocab_size=len(tokenizer), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    server = LiveServer(create_app(model, tokenizer, ServerConfig("tiny-lfm2", "auto", max_tokens_limit=NEW)))
    yield server, model, tokenizer
    server.stop()


def test_a_required_call_is_generates_held_text_streamed_whole_and_shown_back(served):
    server, model, tokenizer = served
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    one = {"tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": NEW}
    response = client.chat.completions.create(model="tiny-lfm2", messages=ASK, **one)
    (call,) = response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "tool_calls" and response.choices[0].message.content is None
    text = held_answer(model, tokenizer, ASK, [ADD], "required", NEW, parallel=False)
    assert pythonic_calls(text) == [(call.function.name, json.loads(call.function.arguments))], text
    chunks = list(client.chat.completions.create(model="tiny-lfm2", messages=ASK, stream=True, **one))
    streamed = [d.tool_calls for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
    content = "".join(d.content or "" for c in chunks if c.choices and (d := c.choices[0].delta))
    assert content == "" and streamed[0][0].function.arguments == call.function.arguments
    made = {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made]},
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    counted = httpx.post(server.url + "/tokenize", json={"messages": turns, "tools": [ADD]}, timeout=60).json()
    shown = tokenizer.decode(counted["tokens"])
    assert f"<|tool_call_start|>{text}<|tool_call_end|>" in shown  # as the model wrote it
    answered = client.chat.completions.create(model="tiny-lfm2", messages=turns, tools=[ADD], max_tokens=4)
    assert answered.usage.prompt_tokens == counted["count"]
