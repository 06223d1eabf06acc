"""vLLM's `/tokenize` and `/detokenize` on a live server (a tiny model, a ChatML template that takes tools): a
conversation's ids are the ones its chat completion reads, counted; ids come back as text; bad bodies are 400s
naming the field, and the API key guards them as every endpoint but /health."""

from __future__ import annotations

import httpx
import pytest
from test_server import LiveServer

from forerun.server import ServerConfig, create_app
from forerun.tool_specs import shipped_template

from tiny_models import byte_tokenizer, tiny_model

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}  # fmt: skip
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = shipped_template("chatml-tools")
    model = tiny_model("llama", "sdpa", vocab_size=len(tokenizer), max_position_embeddings=1024)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    server = LiveServer(create_app(model, tokenizer, ServerConfig("tiny", "plain", api_key="sesame")))
    yield server, tokenizer
    server.stop()


def post(server, path: str, body: dict, headers: dict = KEY) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_a_conversations_ids_are_the_ones_its_chat_completion_reads(served):
    server, tokenizer = served
    answer = post(server, "/tokenize", {"messages": ASK, "tools": [ADD], "return_token_strs": True}).json()
    expected = tokenizer.apply_chat_template(ASK, tools=[ADD], add_generation_prompt=True)["input_ids"]
    assert answer["tokens"] == expected and answer["count"] == len(expected) and answer["max_model_len"] == 1024
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    chat = post(server, "/v1/chat/completions", {"messages": ASK, "tools": [ADD], "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == answer["count"]
    closed = post(server, "/tokenize", {"messages": ASK, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenizer.apply_chat_template(ASK)["input_ids"]
    text = post(server, "/tokenize", {"prompt": "Hello there"}).json()
    assert text["tokens"] == tokenizer("Hello there")["input_ids"] and "token_strs" not in text
    assert post(server, "/detokenize", {"tokens": text["tokens"]}).json() == {"prompt": "Hello there"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/tokenize", {"prompt": "Hi", "messages": ASK}, 400, "prompt", "one of them"),
        ("/tokenize", {}, 400, "prompt", "one of them"),
        ("/tokenize", {"messages": [{"role": "user", "content": ""}]}, 400, "messages", "empty"),
        ("/tokenize", {"messages": ASK, "tools": [{"type": "function"}]}, 400, "tools", "tools[0]"),
        ("/tokenize", {"messages": ASK, "chat_template_kwargs": {"x": 1}}, 400, "chat_template_kwargs", "'x'"),
        ("/tokenize", {"prompt": "Hi", "model": "other"}, 404, "model", "not served here"),
        ("/tokenize", {"prompt": "Hi", "colour": "red"}, 400, "colour", "unrecognized request field"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "tokens[0]"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens", "integer"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(served, path, body, status, param, fragment):
    server, _ = served
    response = post(server, path, body)
    error = response.json()["error"]
    assert response.status_code == status and param in (error["param"] or "") and fragment in error["message"], error


def test_the_api_key_guards_them(served):
    server, _ = served
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body, headers={}).status_code == 401
