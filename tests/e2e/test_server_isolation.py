"""A request that fails inside the shared batch ends alone: its neighbours' answers are plain generate's, it gets an
OpenAI-shaped error (a JSON 500, or an error event then [DONE] on a stream), and the failure is counted."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from test_server import MODEL, LiveServer, plain_text

from forerun.row import RowRun
from forerun.server import ServerConfig, create_app

pytestmark = pytest.mark.real_model
HOSTILE = "Zqxjvk wobble frobnicate: say hi."
HONEST = [
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Count from one to ten."}],
]
TOKENS = 24


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    app = create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=64, request_timeout_s=120))
    live = LiveServer(app)
    yield live
    live.stop()


def contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


def streamed(url: str, body: dict) -> tuple[int, str, list[dict], bool]:
    """(status, text, error events, [DONE] seen) of a streamed request."""
    text, errors, done = "", [], False
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, "", [response.json()], False
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event)
            elif event.get("choices"):
                text += event["choices"][0]["delta"].get("content") or ""
    return 200, text, errors, done


def beside_an_honest_request(server, smollm2, fuzz) -> None:
    """Runs `fuzz()` while an honest chat request is in flight: its answer must still be plain generate's."""
    honest = {"messages": HONEST[0], "max_tokens": TOKENS}
    expected = plain_text(smollm2, messages=HONEST[0], max_new_tokens=TOKENS)
    beside: dict[str, httpx.Response] = {}
    neighbour = threading.Thread(
        target=lambda: beside.update(answer=httpx.post(server.url + "/v1/chat/completions", json=honest, timeout=300))
    )
    neighbour.start()
    fuzz()
    neighbour.join(timeout=300)
    assert beside["answer"].json()["choices"][0]["message"]["content"] == expected


def test_a_request_failing_mid_batch_ends_alone(server, smollm2, monkeypatch):
    model, tokenizer = smollm2
    marker = tokenizer.encode("Zqxjvk wobble", add_special_tokens=False)
    original = RowRun.commit

    def commit(row, *args, **kwargs):  # a failure only the hostile rows meet, inside the shared step
        if contains(row.ctx.tokens, marker) and row.stats.forwards >= 1:
            raise OverflowError("cannot convert float infinity to integer")
        return original(row, *args, **kwargs)

    monkeypatch.setattr(RowRun, "commit", commit)
    url = server.url + "/v1/chat/completions"
    hostile = {"messages": [{"role": "user", "content": HOSTILE}], "max_tokens": TOKENS}
    results: dict[str, object] = {}

    def run(name, call):
        results[name] = call()

    calls = {
        "honest-json": lambda: httpx.post(url, json={"messages": HONEST[0], "max_tokens": TOKENS}, timeout=120),
        "honest-stream": lambda: streamed(url, {"messages": HONEST[1], "max_tokens": TOKENS}),
        "hostile-json": lambda: httpx.post(url, json=hostile, timeout=120),
        "hostile-stream": lambda: streamed(url, hostile),
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    answer = results["honest-json"]
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == plain_text(
        smollm2, messages=HONEST[0], max_new_tokens=TOKENS
    )
    status, text, errors, done = results["honest-stream"]
    assert (status, errors, done) == (200, [], True)
    assert text == plain_text(smollm2, messages=HONEST[1], max_new_tokens=TOKENS)
    failure = results["hostile-json"]
    assert failure.status_code == 500
    error = failure.json()["error"]
    assert error["type"] == "server_error" and "OverflowError" in error["message"]
    status, _, errors, done = results["hostile-stream"]
    assert errors and errors[0]["error"]["type"] == "server_error"
    assert status == 500 or done  # refused before its stream began, or ended with an error event and [DONE]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'forerun_requests_total{endpoint="/v1/chat/completions",status="500"}' in metrics
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_the_issue_s_hostile_knob_is_a_400_naming_it(server):
    body = {"prompt": "a b a b a b a b a b a b a b a b", "max_tokens": 16,
            "forerun": {"method": "trie", "prompt_weight": 1e308}}  # fmt: skip
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "prompt_weight" in response.json()["error"]["message"]


def test_a_shutdown_answers_every_request_in_flight(smollm2):
    """SIGTERM with requests generating: uvicorn cancelled them at its deadline (a plain-text 500, a stream cut
    without an error event). Now each gets OpenAI's 503, a stream its error event and [DONE], before the deadline;
    new connections are refused."""
    model, tokenizer = smollm2
    app = create_app(model, tokenizer, ServerConfig(MODEL, "prompt_lookup", max_tokens_limit=2000))
    live = LiveServer(app)
    live.server.config.timeout_graceful_shutdown = 3
    url = live.url + "/v1/chat/completions"
    long = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}], "max_tokens": 1500}
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: results.update(json=httpx.post(url, json=long, timeout=60))),
        threading.Thread(target=lambda: results.update(stream=streamed(url, long))),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while httpx.get(live.url + "/health").json()["running"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # both are generating
    stopping = time.monotonic()
    live.server.handle_exit(signal.SIGTERM, None)
    for thread in threads:
        thread.join(timeout=30)
    assert time.monotonic() - stopping < 4
    answer = results["json"]
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error", answer.text
    status, text, errors, done = results["stream"]
    assert status == 200 and text and done, (status, text[:40], errors)
    assert errors and "shutting down" in errors[0]["error"]["message"]
    live.thread.join(timeout=30)
    with pytest.raises(httpx.ConnectError):
        httpx.get(live.url + "/health", timeout=2)


def test_fuzzed_knobs_never_reach_a_5xx_nor_an_honest_neighbour(server, smollm2):
    """Hypothesis over the `forerun` extension: real method names and knob names (plain and dotted) with values of
    every kind (huge, non-finite, negative, strings, lists, bools), while an honest request runs beside them. Every
    answer is OpenAI-shaped JSON below 500; the honest answer is plain generate's."""
    import dataclasses

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from forerun.methods import METHODS, REGISTRY

    knob_names = [f.name for spec in REGISTRY.values() for f in dataclasses.fields(spec.config)]
    dotted = [f"{name}.{f.name}" for name, spec in REGISTRY.items() for f in dataclasses.fields(spec.config)]
    extremes = [1e308, 1e307, -1e308, 5e-324, -1, 0, 1, 2, 16, 4096, 2**63, 10**30, "4", True, None, [1, 2]]
    values = st.one_of(
        st.sampled_from(extremes),  # first: where a bound is missing, these are what cross it
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
        st.lists(st.integers(min_value=-3, max_value=10**9), max_size=3),
    )
    own = {name: [f.name for f in dataclasses.fields(spec.config)] for name, spec in REGISTRY.items()}
    own |= {"auto": [k for k in dotted if not k.startswith("draft_model.")], "plain": [], "magic": knob_names}
    assert set(own) >= set(METHODS)

    def knobs_for(method: str):  # mostly the method's own knobs (where a bad value gets furthest), sometimes any
        names = own[method] or ["bogus"]
        chosen = st.one_of(st.sampled_from(names), st.sampled_from(knob_names + dotted + ["bogus"]))
        return st.dictionaries(chosen, values, min_size=1, max_size=2).map(lambda k: {"method": method, **k})

    extension = st.sampled_from(sorted(own)).flatmap(knobs_for)
    url = server.url + "/v1/completions"
    seen: list[int] = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(forerun=extension)
    def fuzzed(forerun):
        body = {"prompt": "a b a b a b a b a b a b a b a b", "max_tokens": 6, "forerun": forerun}
        response = httpx.post(url, content=json.dumps(body, allow_nan=True), timeout=120,
                              headers={"content-type": "application/json"})  # fmt: skip
        seen.append(response.status_code)
        assert response.status_code < 500, (forerun, response.text[:300])
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["type"] and error["message"], response.text

    def sweep():  # every method's own knobs at every extreme, one at a time: what random draws rarely hit
        for method in sorted(own):
            for name in own[method]:
                for value in extremes:
                    fuzzed.hypothesis.inner_test(forerun={"method": method, name: value})

    beside_an_honest_request(server, smollm2, lambda: (sweep(), fuzzed()))
    assert 200 in seen and 400 in seen  # the fuzz reached both sides of the checks


def test_fuzzed_response_formats_never_reach_a_5xx_nor_an_honest_neighbour(server, smollm2):
    """Hypothesis over `response_format`: schemas built from JSON Schema's keywords with hostile values (regexes,
    extreme bounds, dangling references, contradictions, deep nesting) and malformed envelopes, while an honest
    request runs beside them. Every answer is OpenAI-shaped JSON below 500 (a json_object one starts an object),
    and the honest answer is plain generate's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    extremes = st.sampled_from([0, -1, 1, 2**63, 1e308, -1e308, 5e-324, 10**30, 0.5])
    patterns = st.sampled_from(["^(a|aa)*$", "[", "(a{1,1000}){1,1000}", "\\d+", ".*", "", "^$", "(?=a)a", "\\p{L}+"])
    types = st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null", "bogus"])

    def keyword_schemas(inner):
        return st.fixed_dictionaries(
            {},
            optional={
                "type": st.one_of(types, st.lists(types, max_size=3)),
                "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3),
                "required": st.lists(st.text(max_size=6), max_size=3),
                "items": inner,
                "anyOf": st.lists(inner, max_size=3),
                "oneOf": st.lists(inner, max_size=3),
                "allOf": st.lists(inner, max_size=3),
                "enum": st.lists(st.one_of(st.text(max_size=4), st.integers(), st.none()), max_size=4),
                "const": st.one_of(st.text(max_size=4), st.integers()),
                "pattern": patterns,
                "minLength": extremes,
                "maxLength": extremes,
                "minimum": extremes,
                "maximum": extremes,
                "minItems": extremes,
                "maxItems": extremes,
                "additionalProperties": st.one_of(st.booleans(), inner),
                "$ref": st.sampled_from(["#", "#/nowhere", "#/properties/a", "http://example.com/x.json"]),
                "format": st.sampled_from(["date-time", "email", "uuid", "bogus"]),
            },
        )

    schemas = st.recursive(keyword_schemas(st.just({})), keyword_schemas, max_leaves=12)
    envelopes = st.one_of(
        schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": s}}),
        st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}, {"type": 5}, {}]),
        st.dictionaries(st.sampled_from(["type", "json_schema", "schema"]), st.one_of(st.text(max_size=5), schemas)),
    )
    url = server.url + "/v1/chat/completions"
    seen: list[int] = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(response_format=envelopes)
    def fuzzed(response_format):
        body = {"messages": [{"role": "user", "content": "Some JSON, please."}], "max_tokens": 6}
        response = httpx.post(url, json={**body, "response_format": response_format}, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, (response_format, response.text[:300])
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["type"] and error["message"], response.text
        elif response_format.get("type") == "json_object":
            assert response.json()["choices"][0]["message"]["content"].lstrip().startswith("{")

    beside_an_honest_request(server, smollm2, fuzzed)
    assert seen.count(200) >= 10 and 400 in seen, seen  # the fuzz reached both sides of the checks


def test_fuzzed_prompts_and_echoes_never_reach_a_5xx_nor_an_honest_neighbour(server, smollm2):
    """Completions' prompts in every form a client might send (token ids in and out of the vocabulary, nested
    lists, mixed kinds, empty ones, booleans) with `echo`, `logprobs`, `max_tokens` 0 and `n`: each is answered
    (200) or refused by name (400), never a 5xx, every place it took given back, and an honest request in flight
    beside them gets plain generate's answer."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    valid = st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=12)
    bad = st.sampled_from([-1, 49152, 2**63, True, 1.5, "x", None, []])
    spoiled = st.tuples(valid, bad, st.integers(0, 12)).map(lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]])
    prompts = st.one_of(
        st.text(min_size=1, max_size=12),
        st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
        valid,
        st.lists(valid, min_size=1, max_size=3),
        spoiled,  # one bad id among good ones
        st.lists(st.one_of(st.text(max_size=3), valid, bad), max_size=3),  # kinds mixed, empty lists
        st.sampled_from(["", " ", [], [[]], {"a": 1}]),
    )
    bodies = st.fixed_dictionaries(
        {"prompt": prompts},
        optional={
            "echo": st.booleans(),
            "logprobs": st.sampled_from([0, 1, 5, 6, -1]),
            "max_tokens": st.sampled_from([0, 1, 4, -1]),
            "n": st.sampled_from([1, 2, 17]),
            "temperature": st.sampled_from([0.0, 1.0]),
            "stream": st.booleans(),
        },
    )
    url = server.url + "/v1/completions"
    seen: list[int] = []

    @settings(max_examples=80, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def fuzzed(body):
        response = httpx.post(url, json=body, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, (body, response.text[:300])
        if response.status_code == 400:
            assert response.json()["error"]["param"], response.text
        elif response.status_code == 200 and not body.get("stream"):
            choices = response.json()["choices"]
            assert sorted(c["index"] for c in choices) == list(range(len(choices)))

    beside_an_honest_request(server, smollm2, fuzzed)
    assert seen.count(200) >= 10 and 400 in seen, seen  # the fuzz reached both sides of the checks
    assert httpx.get(server.url + "/health").json()["queue"] == 0
