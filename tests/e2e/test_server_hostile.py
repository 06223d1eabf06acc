"""The server under hostile input and real clients: no hang, no 500, nothing lost; the new API surface."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from test_server import MODEL, LiveServer, plain_text

from forerun.server import ServerConfig, create_app
from forerun.server.app import CacheError
from forerun.server.protocol import ConnectionGuard, guarded_h11

pytestmark = pytest.mark.real_model
KEY = "k3y"
LONG = {"messages": [{"role": "user", "content": "Write a very long story about the sea, with many chapters."}]}
"""A request the model answers at length (600 tokens take ~30 s here)."""


@pytest.fixture(scope="module")
def guarded(smollm2, tmp_path_factory):
    """A server with an API key, a cache and generous limits."""
    model, tokenizer = smollm2
    cache = tmp_path_factory.mktemp("cache") / "trie.safetensors"
    config = ServerConfig(MODEL, "auto", api_key=KEY, cache_path=str(cache), max_tokens_limit=600, request_timeout_s=60)
    app = create_app(model, tokenizer, config)
    server = LiveServer(app)
    yield server, app, cache
    server.stop()


@pytest.fixture(scope="module")
def client(guarded):
    return OpenAI(base_url=guarded[0].url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body, **kwargs):
    headers = {"authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)


def queue_of(server) -> int:
    return httpx.get(server.url + "/health", timeout=10).json()["queue"]


def test_a_huge_stop_list_is_refused_at_once(guarded):
    body = {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 8,
        "stop": [f"zz{i}" for i in range(10_000)],
    }
    started = time.monotonic()
    response = post(guarded[0], "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
    assert time.monotonic() - started < 5


def test_a_chunked_body_over_the_limit_is_cut_while_reading(guarded):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"x" * 100_000  # 5 MB in all, no Content-Length
        yield b'"}'

    started = time.monotonic()
    response = httpx.post(
        guarded[0].url + "/v1/completions", content=chunks(), headers={"authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert response.status_code == 413 and "request body over" in response.json()["error"]["message"]
    assert time.monotonic() - started < 10
    assert httpx.get(guarded[0].url + "/health").status_code == 200


def test_unauthenticated_random_paths_do_not_grow_metrics(guarded):
    for i in range(300):
        httpx.get(f"{guarded[0].url}/{'a' * 200}{i}")
    text = httpx.get(guarded[0].url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    assert len(text) < 30_000 and "a" * 50 not in text
    assert 'endpoint="other",status="401"' in text


def test_a_dropped_non_streaming_request_stops_generating(guarded):
    with pytest.raises(httpx.ReadTimeout):
        post(guarded[0], "/v1/chat/completions", {**LONG, "max_tokens": 600}, timeout=1.0)
    deadline = time.monotonic() + 3
    while queue_of(guarded[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert queue_of(guarded[0]) == 0  # 600 tokens would take ~30 s; the drop stopped it


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-300}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 5e-324, "repetition_penalty": 5e-324}', None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [""]}', "stop"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}', "max_completion_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', "tools"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}', "max_tokens"),
        (b'\xff\xfe{"messages": []}', None),
        # a private Decoder from these knobs: 100 million probes a step took 12 GB and minutes (no knob had a ceiling)
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "forerun": {"method": "jacobi", "window": 100000, '
            b'"ngram": 1000}}',
            "forerun",
        ),
    ],
)
def test_former_500s_are_400s_in_openai_shape(guarded, raw, param):
    refused_naming(guarded[0], "/v1/chat/completions", raw, param)


def refused_naming(server, path: str, raw: bytes, param: str | None) -> None:
    """`raw` posted to `path` is a 400 in OpenAI's shape, naming `param` where one is given."""
    response = httpx.post(
        server.url + path,
        content=raw,
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param, error


def test_timeout_is_a_504_not_a_finished_answer(smollm2):
    """A server with a 2 s deadline (its own: the other tests must not race one): 600 tokens take far longer."""
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=600,
                                                                  request_timeout_s=2)))  # fmt: skip
    try:
        body = {**LONG, "max_tokens": 600}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "timeout"
    finally:
        server.stop()


def test_content_parts_equal_plain_content(smollm2, client):
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=12)
    expected = plain_text(smollm2, messages=[{"role": "user", "content": "Name three colours."}], max_new_tokens=12)
    assert response.choices[0].message.content == expected
    with pytest.raises(Exception, match="image_url"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )


CODE = "def add(a, b):\n    total = a + b\n    return total\n"


def test_predicted_outputs_with_the_openai_client(smollm2, client):
    messages = [{"role": "user", "content": f"Repeat this code exactly, nothing else:\n\n{CODE}"}]
    expected = plain_text(smollm2, messages=messages, max_new_tokens=48)
    prediction = {"type": "content", "content": "```python\n" + CODE + "```"}
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, prediction=prediction)
    assert response.choices[0].message.content == expected
    details = response.usage.completion_tokens_details
    # The code is in the prompt too: prompt lookup proposes the same tokens, and fused nodes' credit is shared, so
    # the prediction's count depends on which tree each step fed (9 since batch prefills verify a first tree).
    assert details.accepted_prediction_tokens > 5 and details.rejected_prediction_tokens >= 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=48,
        prediction=prediction,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    # The trie learned this very answer from the first request and now drafts much of it too (its tokens are
    # credited to it), so the prediction's share varies (4-8 here, in the single and the batched engine alike).
    streamed = chunks[-1].usage.completion_tokens_details
    assert streamed.accepted_prediction_tokens > 0, (streamed, details)
    total = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert streamed.accepted_prediction_tokens + streamed.rejected_prediction_tokens == total  # the prediction's size


def test_logprobs_with_the_openai_client_equal_plain_generate(smollm2, client):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Name three colours."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=2
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(
        ids["input_ids"], max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    content = response.choices[0].logprobs.content
    assert len(content) == len(out.logits)
    for entry, row, token in zip(content, out.logits, out.sequences[0, ids["input_ids"].shape[1] :], strict=False):
        logprobs = torch.log_softmax(row[0].float(), -1)
        assert entry.token == tokenizer.decode([int(token)])
        assert entry.logprob == pytest.approx(float(logprobs[token]), abs=1e-3)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, logprobs=2)
    assert len(completion.choices[0].logprobs.tokens) == 5
    assert all(len(top) == 2 for top in completion.choices[0].logprobs.top_logprobs)


def test_auth_details_error_shapes_and_schema(guarded):
    url = guarded[0].url
    lower = httpx.get(url + "/v1/models", headers={"authorization": f"bearer {KEY}"})
    assert lower.status_code == 200
    assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}x"}).status_code == 401
    for header in (f"Basic {KEY}", f"Token {KEY}", KEY, f"Bearer{KEY}"):  # the key, but not as a bearer token
        assert httpx.get(url + "/v1/models", headers={"authorization": header}).status_code == 401, header
    for path in ("/healthz", "/health/", "/health/../v1/models", "/v1/models?/health"):  # only /health is open
        assert httpx.get(url + path).status_code == 401, path
    for response, status in (
        (httpx.get(url + "/nope", headers={"authorization": f"Bearer {KEY}"}), 404),
        (httpx.get(url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}), 405),
    ):
        assert response.status_code == status and set(response.json()) == {"error"}
    schema = httpx.get(url + "/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()
    text = json.dumps(schema)
    assert '"422"' not in text and '"400"' in text


def test_host_header_checked_without_an_api_key(smollm2):
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "plain")))
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/health", headers={"host": f"localhost:{server.port}"}).status_code == 200
        rebinding = httpx.get(server.url + "/v1/models", headers={"host": "evil.example.com"})
        assert rebinding.status_code == 403 and "Host not allowed" in rebinding.json()["error"]["message"]
    finally:
        server.stop()
    opened = create_app(model, tokenizer, ServerConfig(MODEL, "plain", allowed_hosts=("*",)))
    server = LiveServer(opened)
    try:
        assert httpx.get(server.url + "/health", headers={"host": "anything.example"}).status_code == 200
    finally:
        server.stop()


def test_cache_files_are_checked_at_start_and_saved_atomically(smollm2, tmp_path):
    model, tokenizer = smollm2
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00" * 100)
    with pytest.raises(CacheError, match="cannot be read .* delete it or give another path"):
        create_app(model, tokenizer, ServerConfig(MODEL, "trie", cache_path=str(corrupt)))
    with pytest.raises(CacheError, match="does not exist or is not writable"):
        create_app(model, tokenizer, ServerConfig(MODEL, "trie", cache_path=str(tmp_path / "no" / "c.safetensors")))
    with pytest.raises(CacheError, match="keeps no trie"):
        create_app(model, tokenizer, ServerConfig(MODEL, "prompt_lookup", cache_path=str(tmp_path / "c.safetensors")))


def test_shutdown_cancels_in_flight_work_and_still_saves_the_cache(smollm2, tmp_path):
    model, tokenizer = smollm2
    path = tmp_path / "trie.safetensors"
    config = ServerConfig(MODEL, "trie", cache_path=str(path), max_tokens_limit=600, request_timeout_s=600)
    server = LiveServer(create_app(model, tokenizer, config))
    OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL, prompt="one two three", max_tokens=8
    )

    def long_request():
        try:
            httpx.post(server.url + "/v1/chat/completions", json={**LONG, "max_tokens": 600}, timeout=120)
        except httpx.HTTPError:
            pass

    threading.Thread(target=long_request, daemon=True).start()
    time.sleep(1.5)
    started = time.monotonic()
    server.stop()
    assert not server.thread.is_alive() and time.monotonic() - started < 20  # not 30 s of generation
    assert path.is_file() and not list(tmp_path.glob("*.tmp-*"))
    again = create_app(model, tokenizer, config)
    assert len(again.state.pool.trie_decoder().trie_drafter().trie) > 0


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"input": [{"role": "user", "content": "a\\ud800b"}]}', "input[0].content"),
        (b'{"input": [{"type": "function_call", "call_id": "c", "name": "f\\udfff", "arguments": "{}"}]}', None),
        (b'{"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "' + b"[" * 50000 + b'"}]}',
         "input[0].arguments"),
        (b'{"input": [{"role": "user", "content": [' + b"[" * 5000 + b"]" * 5000 + b"]}]}", None),
        (b'{"input": [{"role": "user", "content": [1, null]}]}', "input[0].content[0]"),
        (b'{"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}', "input[0].output"),
        (b'{"input": "hi", "tools": [1]}', "tools[0]"),
        (b'{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]}', "tools"),
        (b'{"input": "hi", "text": {"format": 1}}', "text.format"),
        (b'{"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}', "text.format"),
        (b'{"input": "hi", "tool_choice": {"type": "function"}}', "tool_choice"),
        (b'{"input": "hi", "reasoning": {"effort": 5}}', None),
        (b'{"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 1}]}]}', "input[0]"),
        (b'{"input": "hi", "max_output_tokens": 1e999}', "max_output_tokens"),
        (b'{"input": [' + b'{"role": "user", "content": "x"},' * 3000 + b'{"role": "user", "content": "x"}]}', None),
    ],
)  # fmt: skip
def test_hostile_responses_bodies_are_400s_naming_what_was_sent(guarded, raw, param):
    refused_naming(guarded[0], "/v1/responses", raw, param)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", '
        b'"name": "f", "input": {"a": ' + b"[" * 3000 + b"]" * 3000 + b"}}]}]}",
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 1}]}]}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": [null]}], "system": [1]}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", '
        b'"input_schema": {"type": "nope"}}], "tool_choice": {"type": "any"}}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", '
        b'"budget_tokens": "x", "x": 1}}',
        b'{"max_tokens": -1, "messages": [{"role": "user", "content": "hi"}]}',
        b'{"max_tokens": 4, "messages": []}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", '
        b'"content": "x"}]}, "oops"], "context_management": {"edits": [{"type": "clear_tool_uses_20250919", '
        b'"trigger": {"type": "input_tokens", "value": 0}, "keep": {"type": "tool_uses", "value": 0}}]}}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "context_management": {"edits": ['
        + b'{"type": "clear_thinking_20251015"},' * 99
        + b'{"type": "clear_thinking_20251015"}]}}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "context_management": {"edits": '
        b'[{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 1e999}}]}}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"format": '
        b'{"type": "json_schema", "schema": {"type": "nope"}}}}',
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": ["max"]}}',
    ],
)
def test_hostile_anthropic_bodies_are_400s_in_anthropics_shape(guarded, raw):
    response = httpx.post(
        guarded[0].url + "/v1/messages",
        content=raw,
        headers={"x-api-key": KEY, "content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_schemathesis_finds_no_server_error(guarded):
    """A bounded property-based run over every operation of /openapi.json (with the key): no 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    url = guarded[0].url
    headers = {"authorization": f"Bearer {KEY}"}
    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json", headers=headers).json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 5
    for operation in operations:

        @settings(
            max_examples=15, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(case=operation.as_strategy())
        def no_server_error(case):
            field = "max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"
            tokens = case.body.get(field) if isinstance(case.body, dict) else None
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 8:
                case.body[field] = 8  # keep the run short; validation of other values is what is tested
            if isinstance(case.body, dict) and not {field, "max_completion_tokens"} & set(case.body):
                case.body[field] = 8  # not the server's default of 128 tokens either
            response = case.call(base_url=url, headers=headers, timeout=120)
            assert response.status_code < 500, (case.operation.label, case.body, response.text[:300])

        no_server_error()


def test_a_flood_beyond_max_queue_gets_429_and_nothing_else_breaks(smollm2):
    """8 clients at once against a queue of 2, half of them streaming: the overflow is refused at once (429,
    Retry-After, OpenAI's error shape; a stream too, before any event), every admitted request completes, and the
    server answers normally afterwards."""
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "prompt_lookup", max_queue=2)))
    try:
        body = {"messages": [{"role": "user", "content": "Count from one to twenty in words."}], "max_tokens": 48}
        responses: list[httpx.Response] = []
        streams: list[tuple[int, str]] = []  # (status, body) of the streaming clients

        def call() -> None:
            responses.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120))

        def stream() -> None:
            url = server.url + "/v1/chat/completions"
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
                text = response.read().decode()
                streams.append((response.status_code, text))
                if response.status_code == 429:
                    responses.append(response)

        threads = [threading.Thread(target=call if i % 2 else stream) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        refused_streams = [text for status, text in streams if status == 429]
        assert refused_streams and all(json.loads(t)["error"]["type"] == "rate_limit_exceeded" for t in refused_streams)
        assert all(text.endswith("data: [DONE]\n\n") and '"error"' not in text for st, text in streams if st == 200)
        statuses = sorted(r.status_code for r in responses) + [200] * sum(st == 200 for st, _ in streams)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "2" and refused.json()["error"]["type"] == "rate_limit_exceeded"
        health = httpx.get(server.url + "/health").json()
        assert health["rejected"] == statuses.count(429) and health["queue"] == 0 and health["max_queue"] == 2
        assert "forerun_rejected_total" in httpx.get(server.url + "/metrics").text
        again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
        # 3 sampled choices are 3 generations, more than the queue ever holds: a 400 naming n, not a 429 forever;
        # 3 greedy ones are one generation shown three times
        sampled = httpx.post(server.url + "/v1/chat/completions", json={**body, "n": 3, "temperature": 1}, timeout=60)
        assert sampled.status_code == 400 and sampled.json()["error"]["param"] == "n", sampled.text
        greedy = httpx.post(server.url + "/v1/chat/completions", json={**body, "n": 3, "max_tokens": 8}, timeout=60)
        assert greedy.status_code == 200, greedy.text
        assert len({c["message"]["content"] for c in greedy.json()["choices"]}) == 1
        assert [c["index"] for c in greedy.json()["choices"]] == [0, 1, 2]
        # three prompts are three generations (an echo of each, six places): a 400 naming the prompt
        url = server.url + "/v1/completions"
        several = httpx.post(url, json={"prompt": ["a", "b", "c"], "max_tokens": 4}, timeout=60)
        assert several.status_code == 400 and several.json()["error"]["param"] == "prompt", several.text
        echoed = httpx.post(url, json={"prompt": ["a"], "max_tokens": 4, "echo": True}, timeout=60)
        assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"].startswith("a")
        assert httpx.get(server.url + "/health").json()["queue"] == 0
    finally:
        server.stop()


def test_a_stream_that_cannot_start_gets_its_status_not_an_event(smollm2):
    """Errors found before a stream's first step are HTTP statuses, as for a plain request: the openai client
    raises its typed errors (BadRequestError for a prompt over the context, RateLimitError for a full queue)."""
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "prompt_lookup", max_queue=1,
                                                                  max_tokens_limit=600)))  # fmt: skip
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    body = {**LONG, "max_tokens": 600}
    busy = threading.Thread(target=post, args=(server, "/v1/chat/completions", body), kwargs={"timeout": 120})
    try:
        over = [{"role": "user", "content": "word " * 9000}]  # ~9000 tokens, the model's context is 8192
        with pytest.raises(openai.BadRequestError, match="exceeds the model context"):
            client.chat.completions.create(model=MODEL, messages=over, max_tokens=8, stream=True)
        busy.start()
        deadline = time.monotonic() + 30
        while queue_of(server) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=LONG["messages"], max_tokens=8, stream=True)
        assert httpx.get(server.url + "/health").json()["rejected"] == 1
    finally:
        server.stop()
        if busy.is_alive():
            busy.join()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_clients_gone_while_queued_leave_the_queue_at_once(smollm2, max_batch):
    """Clients that vanish while their requests wait (streaming or not) free their places of --max-queue within
    a step, not when the running requests finish: a flood of dead connections must not lock out live clients."""
    model, tokenizer = smollm2
    config = ServerConfig(MODEL, "prompt_lookup", max_tokens_limit=600, max_batch=max_batch)
    server = LiveServer(create_app(model, tokenizer, config))
    body = {**LONG, "max_tokens": 600}
    busy = [
        threading.Thread(target=post, args=(server, "/v1/chat/completions", body), kwargs={"timeout": 120})
        for _ in range(max_batch)
    ]
    try:
        for thread in busy:
            thread.start()
        deadline = time.monotonic() + 30
        while queue_of(server) < max_batch and time.monotonic() < deadline:
            time.sleep(0.05)
        sockets = []
        for i in range(6):
            raw = json.dumps({**body, "max_tokens": 50, "stream": i % 2 == 0}).encode()
            connection = socket.create_connection(("127.0.0.1", server.port))
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            connection.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            sockets.append(connection)
        while queue_of(server) < max_batch + 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queue_of(server) == max_batch + 6
        for connection in sockets:
            connection.close()
        gone = time.monotonic() + 10  # 600 tokens take ~30 s: the running requests are still running
        while queue_of(server) > max_batch and time.monotonic() < gone:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health").json()
        assert health["queue"] == max_batch and health["running"] == max_batch and health["queued"] == 0, health
    finally:
        server.stop()
        for thread in busy:
            if thread.is_alive():
                thread.join()


def test_slow_heads_slow_bodies_and_connection_floods_do_not_lock_out_clients(smollm2):
    """Slowloris: a head sent a byte at a time is cut at its deadline; a body that does not arrive in time gets
    408 and its connection closed; connections beyond the cap are closed as they come. A live client is answered
    after each, and the server's own limits hold (nothing is left open)."""
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "prompt_lookup", body_timeout_s=1.0)),
                        http=guarded_h11(ConnectionGuard(head_timeout_s=1.0, cap=20)))  # fmt: skip
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", server.port), timeout=10)

    def closed(connection: socket.socket) -> bytes:
        """What the server sent before closing (b"" if nothing); fails if it keeps the connection open."""
        received = b""
        while chunk := connection.recv(65536):  # the 10 s socket timeout fails the test if it never closes
            received += chunk
        return received

    try:
        head = connect()
        head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        began = time.monotonic()
        for _ in range(3):
            time.sleep(0.4)
            try:
                head.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        assert closed(head) == b"" and time.monotonic() - began < 5
        raw = json.dumps(body).encode()
        slow = connect()
        slow.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw[:5])  # fmt: skip
        answer = closed(slow)
        assert answer.startswith(b"HTTP/1.1 408") and b"request body not received within 1 s" in answer, answer
        began = time.monotonic()
        flood = [connect() for _ in range(40)]  # that send nothing at all
        assert all(closed(c) == b"" for c in flood[20:])  # beyond the cap: closed as they come
        assert time.monotonic() - began < 0.9
        assert all(closed(c) == b"" for c in flood[:20])  # the rest when their heads are overdue
        for connection in flood:
            connection.close()
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    finally:
        server.stop()


def test_after_the_guard_has_answered_the_connection_is_closed(smollm2):
    """A head declaring 2 MB gets 413; one more byte then silence kept the connection open for minutes, and a
    slow body went on trickling after its 408. Both are closed once answered, whatever the client still sends."""
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "prompt_lookup", body_timeout_s=1.0)),
                        http=guarded_h11(ConnectionGuard(head_timeout_s=1.0, cap=20)))  # fmt: skip

    def answered_then_closed(connection: socket.socket, trickle: bool) -> bytes:
        """The server's answer; the client trickles a byte every 0.5 s until it comes (`trickle`), sends one more
        byte after it, and the server must then close (or reset) the connection within 8 s."""
        received, began, poked = b"", time.monotonic(), False
        connection.settimeout(0.5)
        while time.monotonic() - began < 8:
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                chunk = None
            except ConnectionResetError:  # closed with our byte unread: closed all the same
                return received
            if chunk == b"":
                return received
            received += chunk or b""
            answered = b"\r\n\r\n" in received
            if (trickle and not answered) or (answered and not poked):
                poked = answered
                try:
                    connection.sendall(b"x")
                except OSError:
                    return received
        raise AssertionError(f"still open after 8 s; received {received[:80]!r}")

    try:
        big = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        big.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2000000\r\n\r\n")
        assert answered_then_closed(big, trickle=False).startswith(b"HTTP/1.1 413")
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        assert answered_then_closed(slow, trickle=True).startswith(b"HTTP/1.1 408")
    finally:
        server.stop()


def test_host_values_are_parsed_not_prefixed(smollm2):
    """Host values that only begin like a local name are refused, and so is a request without a Host header."""
    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "plain")))
    try:
        for host in ("[::1].evil.example", "[::1]evil", "127.0.0.1:80@evil.example", "localhost:80x", "localhost."):
            response = httpx.get(server.url + "/v1/models", headers={"host": host})
            assert response.status_code == 403, host
        for host in ("[::1]", "[::1]:8000", "LOCALHOST", "127.0.0.1:1"):
            assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200, host
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            raw.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
            answer = raw.recv(65536)
        assert answer.startswith(b"HTTP/1.1 403"), answer[:60]
    finally:
        server.stop()


def test_contract_details(guarded):
    server, app, _ = guarded
    two_keys = httpx.get(server.url + "/v1/models", headers=[("authorization", f"Bearer {KEY}"),
                                                             ("authorization", "Bearer other")])  # fmt: skip
    assert two_keys.status_code == 400 and "more than one authorization header" in two_keys.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    wrong = httpx.get(server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    schema = app.openapi()["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(schema) == ["text/plain"]
    hi = [{"role": "user", "content": "hi"}]
    refused = {
        "store": {"messages": hi, "store": True},
        "service_tier": {"messages": hi, "service_tier": "flex"},
        "tools": {"messages": hi, "tools": [{"type": "function", "function": {"name": "now"}}]},
        "prediction": {"messages": hi, "prediction": {"type": "content", "content": "x", "extra": 1}},
        "messages[0].content[0]": {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]
        },
    }
    for param, body in refused.items():
        response = post(server, "/v1/chat/completions", {**body, "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (param, response.text)
    typed = post(server, "/v1/chat/completions", {"messages": hi, "temperature": "0.5", "max_tokens": 2})
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "temperature"
    assert "must be a number" in typed.json()["error"]["message"]
    empty = post(server, "/v1/completions", {"prompt": "", "max_tokens": 2})
    assert empty.status_code == 400 and "prompt is empty" in empty.json()["error"]["message"]
    over = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}],
                                                 "max_tokens": 4})  # fmt: skip
    assert over.status_code == 400 and over.json()["error"]["param"] == "messages"
    assert "context" in over.json()["error"]["message"]


def test_a_cache_path_that_cannot_be_written_stops_the_start(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(CacheError, match="cannot write in /proc"):
        create_app(model, tokenizer, ServerConfig(MODEL, "trie", cache_path="/proc/x.safetensors"))
