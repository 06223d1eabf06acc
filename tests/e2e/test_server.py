"""A live `forerun serve` app on 127.0.0.1, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from openai import OpenAI
from transformers import LogitsProcessorList

from forerun.penalties import OccurrencePenalty
from forerun.server import ServerConfig, create_app
from forerun.server.lifecycle import GracefulServer
from forerun.server.protocol import guarded_h11
from forerun.structured import Grammars

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m"


class LiveServer:
    def __init__(self, app, http=None):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            http=http or guarded_h11(),
        )  # as `forerun serve` runs it
        self.server = GracefulServer(config, drain=app.state.worker.shutdown)  # as `forerun serve` runs it
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def queue_after(self, seconds: float) -> int:
        """The queue's length once it is empty or `seconds` have passed (what a cancelled request gives back)."""
        deadline = time.monotonic() + seconds
        while httpx.get(self.url + "/health").json()["queue"] and time.monotonic() < deadline:
            time.sleep(0.1)
        return httpx.get(self.url + "/health").json()["queue"]


@pytest.fixture(scope="module")
def live(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    cache = tmp_path_factory.mktemp("cache") / "trie.safetensors"
    app = create_app(
        model, tokenizer, ServerConfig(MODEL, "trie", {"max_nodes": 5000}, cache_path=str(cache), max_tokens_limit=64)
    )
    server = LiveServer(app)
    yield server, app, cache
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def plain_text(smollm2, prompt=None, messages=None, max_new_tokens=16) -> str:
    model, tokenizer = smollm2
    if messages is not None:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_models_and_health(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live[0].url + "/health").json()["status"] == "ok"


def test_completion_equals_plain_generate(smollm2, client):
    prompt = "def fibonacci(n):\n    "
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert response.choices[0].text == plain_text(smollm2, prompt=prompt)
    assert response.usage.completion_tokens == 16
    assert response.model_extra["forerun"]["method"] == "trie"


def test_self_drafting_per_request_equals_plain_generate(smollm2, client):
    prompt = "def fibonacci(n):\n    "
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"forerun": {"method": "draft_model", "self_draft_layers": 10}},
    )
    assert response.choices[0].text == plain_text(smollm2, prompt=prompt)
    assert response.model_extra["forerun"]["method"] == "draft_model"


def test_chat_streaming_and_not_equal_plain_generate(smollm2, client):
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = plain_text(smollm2, messages=messages)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert response.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"forerun": {"method": "prompt_lookup"}},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_streamed_chunks_carry_the_logprobs_of_their_tokens(smollm2, client):
    """Each chunk's logprobs are those of the tokens whose text it brings: joined, they are the whole answer's, as
    the same request answers them without streaming."""
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected] and len(expected) > 0
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in expected]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_a_streamed_answer_carries_its_end_tokens_logprob(client):
    """The end token writes no text, yet the answer not streamed lists its entry: the stream sends it too, in a
    last chunk without text (decoded a token a step, it comes in a step of its own)."""
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0, "logprobs": True,
           "extra_body": {"forerun": {"method": "plain"}}}  # fmt: skip
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert whole.choices[0].finish_reason == "stop" and expected[-1].token == "<|im_end|>"
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in expected]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_logit_bias_is_what_transformers_sequence_bias_writes(smollm2, client):
    """OpenAI's logit_bias: a banned token (-100) and a favoured one, the answer plain generate's with
    `sequence_bias` (and not plain generate's own)."""
    model, tokenizer = smollm2
    prompt = "def fibonacci(n):\n    "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    own = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    bias = {own[0]: -100.0, own[3]: 4.0}
    biased = model.generate(ids, max_new_tokens=16, do_sample=False, sequence_bias={(t,): b for t, b in bias.items()})
    reference = tokenizer.decode(biased[0, ids.shape[1] :], skip_special_tokens=True)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logit_bias={str(t): b for t, b in bias.items()}
    )
    assert response.choices[0].text == reference != plain_text(smollm2, prompt=prompt)


def test_frequency_and_presence_penalties_are_what_plain_generate_writes_with_them(smollm2, client):
    """OpenAI's penalties, greedy (completions, and chat streamed): the answer is plain generate's with forerun's
    processor as its `logits_processor`, counting the answer's tokens only (and not plain generate's own answer)."""
    model, tokenizer = smollm2
    prompt = "List the numbers from one to twenty, one per line:\n"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    penalty = LogitsProcessorList([OccurrencePenalty(1.1, 0.6, ids.shape[1])])
    penalised = model.generate(ids, max_new_tokens=24, do_sample=False, logits_processor=penalty)
    reference = tokenizer.decode(penalised[0, ids.shape[1] :], skip_special_tokens=True)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, frequency_penalty=1.1, presence_penalty=0.6
    )
    assert response.choices[0].text == reference != plain_text(smollm2, prompt=prompt, max_new_tokens=24)
    messages = [{"role": "user", "content": "Count from one to twenty."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    penalty = LogitsProcessorList([OccurrencePenalty(-0.4, 1.5, ids["input_ids"].shape[1])])
    penalised = model.generate(**ids, max_new_tokens=24, do_sample=False, logits_processor=penalty)
    reference = tokenizer.decode(penalised[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, frequency_penalty=-0.4, presence_penalty=1.5,
        stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference != plain_text(smollm2, messages=messages, max_new_tokens=24)


def test_vllms_ignore_eos_and_stop_token_ids_end_answers_as_generate_with_those_ids(smollm2, client):
    """vLLM's `ignore_eos` runs past the model's end-of-text token to max_tokens (what plain generate writes with
    no EOS ids); `stop_token_ids` end the answer at the first of them, kept, besides the model's own."""
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Say hi."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    start = ids["input_ids"].shape[1]
    own = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert own.choices[0].finish_reason == "stop" and own.usage.completion_tokens < 40  # the control: it ends
    past = model.generate(**ids, max_new_tokens=40, do_sample=False, eos_token_id=[])
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == tokenizer.decode(past[0, start:], skip_special_tokens=True)
    assert reply.usage.completion_tokens == 40 and reply.choices[0].finish_reason == "length"
    third = past[0, start + 2].item()  # an ordinary token of the answer: it ends there, and stays in the text
    eos = model.generation_config.eos_token_id
    stopped = model.generate(**ids, max_new_tokens=40, do_sample=False, eos_token_id=[eos, third])
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [third]}
    )
    assert reply.choices[0].message.content == tokenizer.decode(stopped[0, start:], skip_special_tokens=True)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "stop"


def test_response_format_answers_are_generates_with_the_constraint(smollm2, client):
    """OpenAI's `response_format` (chat, also streamed; completions as vLLM takes it): the answer is plain generate's
    with the constraint as its `logits_processor`, one JSON object (the free answer is not JSON: the control)."""
    model, tokenizer = smollm2
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "math", "schema": schema}}
    messages = [{"role": "user", "content": 'What is 7 times 6? Reply in JSON with the key "answer".'}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    grammars = Grammars(tokenizer, model.config.vocab_size, tokenizer.eos_token_id)
    constraint = grammars.constraint(response_format, ids["input_ids"].shape[1], frozenset({tokenizer.eos_token_id}))
    held = model.generate(**ids, max_new_tokens=48, do_sample=False, logits_processor=LogitsProcessorList([constraint]))
    reference = tokenizer.decode(held[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert isinstance(json.loads(reference)["answer"], int)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, response_format=response_format
    )
    assert reply.choices[0].message.content == reference != plain_text(smollm2, messages=messages, max_new_tokens=48)
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, response_format=response_format, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference
    prompt = 'A JSON object describing a cat, with keys "name" and "age":\n'
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].text), dict)
    else:
        assert reply.choices[0].text.startswith("{")


def test_vllms_min_tokens_holds_the_end_back_as_generate_with_min_new_tokens(smollm2, client):
    """vLLM's `min_tokens`: no end-of-text token before that many tokens, the answer plain generate's with
    `min_new_tokens` (the control: the model's own answer ends sooner)."""
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Say hi."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    own = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    assert own.usage.completion_tokens < 30 and own.choices[0].finish_reason == "stop"
    held = model.generate(**ids, max_new_tokens=48, do_sample=False, min_new_tokens=30)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, extra_body={"min_tokens": 30}
    )
    start = ids["input_ids"].shape[1]
    assert reply.choices[0].message.content == tokenizer.decode(held[0, start:], skip_special_tokens=True)
    assert reply.usage.completion_tokens >= 30


def test_stop_strings_are_cut_like_openai(client):
    response = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[","])
    assert "," not in response.choices[0].text
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be between 1 and 64"),
        ({"prompt": "hi", "max_tokens": 65}, "max_tokens must be between 1 and 64"),
        ({"prompt": "hi", "n": 17}, "n must be between 1 and 16"),
        ({"prompt": "hi", "forerun": {"method": "medusa"}}, "unknown method 'medusa'"),
        ({"prompt": "hi", "forerun": {"method": "draft_model"}}, "start the server with --draft-model"),
        ({"prompt": "hi", "forerun": {"method": "jacobi", "windw": 3}}, "unknown knob(s) ['windw']"),
        ({"prompt": "word " * 8200, "max_tokens": 4}, "exceeds the model context"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty must be between -2 and 2"),
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format's type must be one of"),
        (
            {
                "prompt": "hi",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/x"}}},
            },
            "response_format's schema is not one forerun can hold",
        ),
        (
            {"prompt": "hi", "response_format": {"type": "json_object"}, "ignore_eos": True},
            "with ignore_eos, give stop_token_ids",
        ),
    ],
)
def test_bad_requests_get_openai_style_400(live, body, fragment):
    response = httpx.post(live[0].url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]
    if "response_format" in body:
        assert response.json()["error"]["param"] in ("response_format", "ignore_eos")


def test_a_lone_surrogate_in_a_schema_is_a_400_naming_response_format(live):
    schema = b'{"type": "json_schema", "json_schema": {"name": "\\ud800", "schema": {}}}'  # JSON's own escape
    body = b'{"prompt": "hi", "response_format": ' + schema + b"}"
    response = httpx.post(live[0].url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format", response.text
    assert "lone surrogate (U+D800" in response.json()["error"]["message"]


def test_invalid_json_unknown_model_and_server_keeps_serving(live, client):
    response = httpx.post(
        live[0].url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "error" in response.json()
    response = httpx.post(live[0].url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert response.status_code == 404
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_api_key_checked_on_every_endpoint_but_health(smollm2):
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "plain", api_key="s3cret")))
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            response = httpx.get(server.url + path)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        good = OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        server.stop()


def test_bounded_load_8_clients_x_10_requests(live, client):
    def one(i: int) -> bool:
        if i % 2:
            stream = client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=6, stream=True)
            chunks = list(stream)
            return chunks[-1].choices[0].finish_reason is not None
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=6
        )
        return response.choices[0].finish_reason is not None

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(80)))
    assert all(results) and len(results) == 80
    decoder = live[1].state.decoders["trie"]
    assert len(decoder.trie_drafter().trie) <= 5000  # the shared cache stays within its bound


def test_client_disconnect_mid_stream_does_not_affect_the_next_request(smollm2, live, client):
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 64, "stream": True}
    with httpx.stream("POST", live[0].url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                break  # one chunk read, then hang up
    prompt = "The capital of France is"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert response.choices[0].text == plain_text(smollm2, prompt=prompt, max_new_tokens=8)


def test_metrics_report_requests_tokens_and_acceptance(live, client):
    client.completions.create(model=MODEL, prompt="a b c a b c a b", max_tokens=8)
    text = httpx.get(live[0].url + "/metrics").text
    for name in (
        "forerun_requests_total",
        "forerun_generated_tokens_total",
        "forerun_tokens_per_forward_bucket",
        "forerun_request_seconds_bucket",
        "forerun_queue_length",
    ):
        assert name in text
    assert 'method="trie"' in text


def test_cache_saved_at_shutdown_and_loaded_at_start(smollm2, tmp_path):
    model, tokenizer = smollm2
    path = tmp_path / "trie.safetensors"
    config = ServerConfig(MODEL, "trie", cache_path=str(path))
    server = LiveServer(create_app(model, tokenizer, config))
    OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL, prompt="one two three", max_tokens=8
    )
    server.stop()
    assert path.is_file()
    app = create_app(model, tokenizer, config)
    second = LiveServer(app)
    try:
        assert len(app.state.decoders["trie"].trie_drafter().trie) > 0
    finally:
        second.stop()
