"""Tools on a live server (the embedded SmolLM2-135M-Instruct with the shipped `chatml-tools` template), driven by the
official openai client: required and named calls, streamed and not, a conversation that answers a call, and the
free answer beside tools; every text what plain generate writes from the same prompt."""

from __future__ import annotations

import copy
import json

import pytest
from openai import OpenAI
from test_server import MODEL, LiveServer

import forerun
from forerun.server import ServerConfig, create_app
from forerun.tool_specs import shipped_template

from tool_templates import LLAMA3_JSON, MISTRAL_NAMED, MISTRAL_TOOLS, held_answer

pytestmark = pytest.mark.real_model
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}}  # fmt: skip
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"],
    "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


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


def held_generate(model, tokenizer, messages, choice, tools=TOOLS, new: int = 64, parallel: bool = True) -> str:
    """Plain generate's text from the prompt with the tools, held by the request's constraint."""
    return held_answer(model, tokenizer, messages, tools, choice, new, parallel)


def test_a_required_call_is_the_models_own_held_to_the_tools(served, client):
    """The model picks the function and fills its arguments; the call is plain generate's constrained text, read
    out; `finish_reason` says tool_calls and there is no content."""
    _, model, tokenizer = served
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    text = held_generate(model, tokenizer, ASK, "required")
    assert text == f'<tool_call>[{{"name": "get_weather", "arguments": {call.function.arguments}}}]</tool_call>'
    assert response.forerun["tokens_per_forward"] > 1.5  # the call's text is drafted: names and keys from the prompt


def test_a_named_call_streams_as_it_is_written(served, client):
    """Streamed, the call's id and name come first, then its arguments in pieces as the model writes them (the
    openai SDK's stream helper joins them), the same arguments as the answer not streamed, then the finish
    reason; no content. Drafted (`auto`), a step may bring the whole call; `plain` brings a token a step."""
    named = {"type": "function", "function": {"name": "add"}}
    ask = [{"role": "user", "content": "What is 17 plus 25?"}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice=named)
    plain = {"forerun": {"method": "plain"}}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice=named,
                                                 stream=True, extra_body=plain))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    pieces = [call for d in deltas if d.tool_calls for call in d.tool_calls]
    assert len(pieces) > 5 and all(piece.index == 0 for piece in pieces)
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "add"
    assert all(piece.id is None and piece.function.name is None for piece in pieces[1:])
    arguments = "".join(piece.function.arguments for piece in pieces)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(arguments) == {"a": 17, "b": 25}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(model=MODEL, messages=ask, tools=TOOLS, tool_choice=named) as stream:
        kinds = [event.type for event in stream]  # drafted: one delta or more
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    assert final.choices[0].message.tool_calls[0].function.arguments == arguments


def test_a_long_argument_streams_in_many_pieces_equal_to_the_whole(served, client):
    """A note's text as the argument: its pieces come token by token (the request decodes `plain`: a token a step,
    whatever the load), and joined they are the answer not streamed, which is plain generate's held text."""
    _, model, tokenizer = served
    note = {"type": "function", "function": {"name": "save_note", "description": "Save a note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}  # fmt: skip
    ask = [{"role": "user", "content": "Save a note that says: buy milk, eggs, bread and two apples."}]
    named = {"type": "function", "function": {"name": "save_note"}}
    whole = client.chat.completions.create(model=MODEL, messages=ask, tools=[note], tool_choice=named,
                                           max_tokens=64)  # fmt: skip
    chunks = client.chat.completions.create(model=MODEL, messages=ask, tools=[note], tool_choice=named,
                                            max_tokens=64, stream=True,
                                            extra_body={"forerun": {"method": "plain"}})  # a token a step  # fmt: skip
    pieces = [call.function.arguments for c in chunks if c.choices and c.choices[0].delta.tool_calls
              for call in c.choices[0].delta.tool_calls]  # fmt: skip
    text = held_generate(model, tokenizer, ask, named, tools=[note], new=64)
    assert len(pieces) > 8 and "".join(pieces) in text and text.startswith('<tool_call>[{"name": "save_note"')
    assert whole.choices[0].finish_reason == "tool_calls" and json.loads("".join(pieces))["text"]
    assert "".join(pieces) == whole.choices[0].message.tool_calls[0].function.arguments


def test_a_conversation_answers_with_the_tools_result(served, client):
    """The call and the tool's answer go back to the model; it answers in words (tool_choice auto), the text
    plain generate writes from the same conversation with the tools, streamed the same."""
    _, model, tokenizer = served
    made = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "celsius": 21}'}]  # fmt: skip
    response = client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=48)
    choice = response.choices[0]
    template_turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {**made, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, turns[2]]  # fmt: skip
    expected = forerun.Decoder(model, tokenizer, "plain").generate(template_turns, 48, tools=TOOLS)
    assert expected.tool_calls == () and choice.message.tool_calls is None
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    stream = client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=48, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text


def test_strict_functions_under_auto_answer_as_generate_with_the_lazy_mask(served, client):
    """Strict functions under tool_choice auto: the answer is free until it opens a call (this model answers in
    words), plain generate's text with that mask, streamed the same; the mask is on (a processed request)."""
    _, model, tokenizer = served
    strict = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    assert forerun.GenerationRequest(ASK, 48, tools=strict).held_format["lazy"]
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=strict, max_tokens=48)
    expected = held_generate(model, tokenizer, ASK, "auto", strict, 48)
    assert response.choices[0].message.content == expected and response.choices[0].message.tool_calls is None
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=strict, max_tokens=48, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_tools_on_a_template_without_them_are_a_400_naming_tools(smollm2):
    """The embedded model's own template teaches no calls: tools are refused by name, tool_choice none is fine."""
    import httpx

    model, tokenizer = smollm2
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "plain", max_tokens_limit=8)))
    try:
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 4}
        refused = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
        assert "--chat-template" in refused.json()["error"]["message"]
        fine = httpx.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
        assert fine.status_code == 200 and "tool_calls" not in fine.json()["choices"][0]["message"]
    finally:
        server.stop()


def test_hostile_tools_are_400s_and_the_server_goes_on(served, client):
    """A schema no grammar holds, a call on a user's message, arguments that are not an object: each a 400 naming
    its field, and the next request is answered."""
    import httpx

    url = served[0].url + "/v1/chat/completions"
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}}  # fmt: skip
    made = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
    cases = [
        ({"messages": ASK, "tools": [broken], "tool_choice": "required"}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [made]}], "tools": TOOLS},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "tool_calls": [made]}], "tools": TOOLS},
            "messages[1].tool_calls[0]",
        ),
        ({"messages": ASK, "tools": [WEATHER] * 2}, "tools"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [made | {"function": {"name": "f",
          "arguments": "[" * 100000}}]}], "tools": TOOLS}, "messages[1].tool_calls[0]"),
    ]  # fmt: skip
    for body, param in cases:
        refused = httpx.post(url, json={**body, "max_tokens": 4}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices[0].message.content


def test_fuzzed_tools_never_reach_a_5xx_nor_an_honest_neighbour(served):
    """Hypothesis over tools (hostile names, schemas with dangling references, contradictions, extreme bounds),
    tool_choice and a conversation's calls, while an honest request runs beside them: every answer is OpenAI-shaped
    JSON below 500, a 200's calls are of the offered tools, and the honest answer is plain generate's."""
    import threading

    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    server, model, tokenizer = served
    url = server.url + "/v1/chat/completions"
    names = st.one_of(st.sampled_from(["get_weather", "add", "f", "a-b_9", "auto", "x" * 64]), st.text(max_size=8))
    leaf = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "bogus"])}),
        st.sampled_from([{"$ref": "#/nowhere"}, {"minimum": 5, "maximum": 1}, {"maxLength": -1}, {"enum": []},
                         {"pattern": "(a{1,1000}){1,1000}"}, {}, {"type": "string", "maxLength": 3}]),
    )  # fmt: skip
    parameters = st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=5), leaf, max_size=3)},
            optional={"required": st.lists(st.text(max_size=5), max_size=2), "additionalProperties": st.booleans()},
        ),  # fmt: skip
        st.sampled_from([{}, {"type": "array"}, "not a schema", None]),
    )
    functions = st.fixed_dictionaries(
        {"name": names},
        optional={"parameters": parameters, "description": st.text(max_size=20), "strict": st.booleans()},
    )
    tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "code"]),
                                            "function": functions}), max_size=3)  # fmt: skip
    choices = st.one_of(
        st.sampled_from([None, "auto", "none", "required", "any", 3]),
        names.map(lambda name: {"type": "function", "function": {"name": name}}),
    )
    arguments = st.sampled_from(['{"city": "Oslo"}', "{}", "[1]", "{", '"x"', '{"a": 1}'])
    function_calls = st.fixed_dictionaries({"name": names, "arguments": arguments})
    calls = st.lists(st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"),
                                            "function": function_calls}), max_size=2)  # fmt: skip
    seen: list[int] = []

    @settings(max_examples=50, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(tools=tools, choice=choices, made=calls, parallel=st.sampled_from([None, True, False]))
    def fuzzed(tools, choice, made, parallel):
        messages = [*ASK, *([{"role": "assistant", "content": None, "tool_calls": made}] if made else [])]
        body = {"messages": messages, "max_tokens": 8, "tools": tools}
        body |= {"tool_choice": choice} if choice is not None else {}
        body |= {"parallel_tool_calls": parallel} if parallel is not None else {}
        response = httpx.post(url, json=body, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, (body, response.text[:300])
        if response.status_code != 200:
            assert response.json()["error"]["param"], response.text
            return
        offered = {tool["function"]["name"] for tool in tools}
        for call in response.json()["choices"][0]["message"].get("tool_calls") or []:
            assert call["function"]["name"] in offered and json.loads(call["function"]["arguments"]) is not None

    expected = forerun.Decoder(model, tokenizer, "plain").generate(ASK, 24, tools=TOOLS).text
    beside: dict = {}
    honest = {"messages": ASK, "max_tokens": 24, "tools": TOOLS}
    neighbour = threading.Thread(target=lambda: beside.update(answer=httpx.post(url, json=honest, timeout=300)))
    neighbour.start()
    fuzzed()
    neighbour.join(timeout=300)
    assert beside["answer"].json()["choices"][0]["message"]["content"] == expected
    assert seen.count(200) >= 5 and 400 in seen, seen  # the fuzz reached both sides of the checks


def test_cli_generate_prints_the_calls_as_json_lines(served, tmp_path):
    """`forerun generate --tools FILE --tool-choice required --chat-template chatml-tools`: the call the server
    makes, one JSON line; a bad choice or file is one error line before the model loads."""
    from typer.testing import CliRunner

    from forerun.cli import app

    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    question = ASK[0]["content"]
    args = ["generate", question, "--tools", str(path), "--tool-choice", "required", "--chat-template", "chatml-tools",
            "--threads", "2", "-n", "64"]  # fmt: skip
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    for bad, fragment in [(["--tool-choice", "sunny"], "--tool-choice"), (["--tools", str(tmp_path / "x")], "--tools")]:
        refused = CliRunner().invoke(app, ["generate", question, "--tools", str(path), *bad])
        assert refused.exit_code == 2 and fragment in refused.output, refused.output


def test_a_llama_template_served_from_a_file_makes_bare_json_calls(smollm2, tmp_path):
    """`forerun serve --chat-template FILE` with a template teaching Llama 3's calls: a required call is one bare
    object (its arguments the function's parameters), plain generate's held text, streamed whole; the conversation
    goes on with it; two calls in one assistant message, which the template refuses, are a 400."""
    import httpx

    from forerun.cli.common import read_chat_template

    model, tokenizer = smollm2
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3_JSON)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = read_chat_template(str(path))
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=64)))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
        (call,) = response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls" and response.choices[0].message.content is None
        text = held_generate(model, tokenizer, ASK, "required")
        assert text == f'{{"name": "{call.function.name}", "parameters": {call.function.arguments}}}'
        assert call.function.name in ("get_weather", "add") and json.loads(call.function.arguments)
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                     stream=True))  # fmt: skip
        streamed = [d.tool_calls for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
        assert len(streamed) == 1 and streamed[0][0].function.arguments == call.function.arguments
        made = {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}  # fmt: skip
        turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]  # fmt: skip
        assert client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=8).choices
        two = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made, made]}]
        refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": two, "tools": TOOLS}, timeout=60)
        assert refused.status_code == 400 and "one tool call per message" in refused.text, refused.text
    finally:
        server.stop()


def test_a_mistral_template_makes_calls_after_its_own_token_with_ids_it_takes_back(smollm2):
    """A template teaching Mistral's calls (a list after a special token of the tokenizer's own: SmolLM2 has no
    `[TOOL_CALLS]`, so one of its own special tokens stands in for it): a required call is plain generate's held
    text, read from the answer the mark is decoded out of; its id is 9 letters and digits, as the template takes
    back in the conversation that goes on (an OpenAI-shaped id there is the template's 400)."""
    import httpx

    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = MISTRAL_TOOLS.replace("[TOOL_CALLS]", "<jupyter_code>")
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=64)))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        one = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}  # it would call on and on
        response = client.chat.completions.create(model=MODEL, messages=ASK, **one)
        (call,) = response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls" and response.choices[0].message.content is None
        assert len(call.id) == 9 and call.id.isalnum()
        text = held_generate(model, tokenizer, ASK, "required", parallel=False)
        assert text == f' [{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}]', text
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **one))
        streamed = [d.tool_calls[0] for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
        assert len(streamed[0].id) == 9 and all(piece.id is None for piece in streamed[1:])  # the id once, first
        assert "".join(piece.function.arguments for piece in streamed) == call.function.arguments
        made = {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}  # fmt: skip
        turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]  # fmt: skip
        assert client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=8).choices
        turns[1] = {**turns[1], "tool_calls": [{**made, "id": "call_0"}]}
        refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": turns, "tools": TOOLS}, timeout=60)
        assert refused.status_code == 400 and "9 letters and digits" in refused.text, refused.text
    finally:
        server.stop()


def test_mistrals_newer_calls_name_their_function_between_marks_and_stream_as_written(smollm2):
    """A template teaching Mistral's newer calls (`[TOOL_CALLS]name[ARGS]{...}`; two of SmolLM2's own special tokens
    stand in for the marks): a required call, streamed or not, is plain generate's held text, read from the
    answer the marks are decoded out of (`name{...}`), which no content chunk shows; streamed (`plain`: a token a
    step), its arguments come in pieces; the conversation goes on."""
    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    template = MISTRAL_NAMED.replace("[TOOL_CALLS]", "<jupyter_code>").replace("[ARGS]", "<jupyter_output>")
    tokenizer.chat_template = template
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=64)))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        one = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        response = client.chat.completions.create(model=MODEL, messages=ASK, **one)
        (call,) = response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls" and response.choices[0].message.content is None
        text = held_generate(model, tokenizer, ASK, "required", parallel=False)
        assert text == f"{call.function.name}{call.function.arguments}", text
        plain = {"forerun": {"method": "plain"}}
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, extra_body=plain, **one))
        content = "".join(d.content or "" for c in chunks if c.choices and (d := c.choices[0].delta))
        streamed = [d.tool_calls[0] for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
        assert content == "" and streamed[0].function.name == call.function.name and len(streamed) > 3
        assert "".join(piece.function.arguments for piece in streamed) == call.function.arguments
        made = {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}  # fmt: skip
        turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]  # fmt: skip
        assert client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=8).choices
    finally:
        server.stop()
