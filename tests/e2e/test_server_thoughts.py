"""A reasoning model served: its thought comes as `reasoning` (and `reasoning_content`) beside the answer's
`content`, streamed or not, counted in `reasoning_tokens`; `chat_template_kwargs` turn it off where the template
reads such a variable; a thought sent back in the conversation reaches the template. A tiny random model with
`<think>` tokens of its own stands in for a Qwen3, nudged towards `</think>` by a logit bias, and every text is
plain generate's from the same prompt, with the same bias."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from test_server import LiveServer
from transformers import LogitsProcessorList

import forerun
from forerun.server import ServerConfig, create_app
from forerun.text import complete
from forerun.thoughts import split, thought_in, thought_marks

from tiny_models import byte_tokenizer, tiny_model

MODEL = "tiny-thinker"
TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{% endif %}"
)
"""A Qwen3-shaped template: the generation prompt opens the thought unless `enable_thinking` is false."""
ASK = [{"role": "user", "content": "Add 2 and 3."}]
NEW = 40
BIAS = 0.3
"""Added to `</think>`'s logit: the seed-0 model closes its thought at its 32nd token, once."""


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("llama", "sdpa", seed=0, vocab_size=len(tokenizer), max_position_embeddings=1024)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    server = LiveServer(create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_tokens_limit=NEW)))
    yield server, model, tokenizer
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def closing_bias(tokenizer) -> dict[str, float]:
    return {str(tokenizer.convert_tokens_to_ids("</think>")): BIAS}


def plain(model, tokenizer, messages, biased: bool = True, **template) -> tuple[str | None, str, int]:
    """(reasoning, content, reasoning tokens) of plain generate's answer with the same bias (the random model's
    bytes may end inside a character: the answer ends before it, as the server's)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                        **template)["input_ids"]  # fmt: skip
    closing = tokenizer.convert_tokens_to_ids("</think>")
    bias = {"sequence_bias": {(closing,): BIAS}} if biased else {}
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **bias)
    new = out[0, ids.shape[1] :].tolist()
    marks = thought_marks(tokenizer)
    thought = thought_in(tokenizer, marks, new, opened=marks.opening in ids[0, -3:].tolist())
    reasoning, content = split(complete(tokenizer.decode(new, skip_special_tokens=True)), thought)
    return reasoning, content, 0 if thought is None else thought.tokens


def test_the_thought_comes_apart_from_the_answer_streamed_or_not(served, client):
    _, model, tokenizer = served
    bias = closing_bias(tokenizer)
    reasoning, content, tokens = plain(model, tokenizer, ASK)
    assert reasoning and content and 0 < tokens < NEW  # the test means something: a thought, then an answer
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW, logit_bias=bias)
    message = whole.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (reasoning, reasoning, content)
    assert whole.usage.completion_tokens_details.reasoning_tokens == tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW, logit_bias=bias,
                                                 stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert all(getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(thought) == reasoning and len(thought) > 1  # streamed piece by piece
    assert "".join(d.content or "" for d in deltas) == content
    scored = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW, logit_bias=bias,
                                                 stream=True, logprobs=True))  # fmt: skip
    entries = [e for c in scored if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == whole.usage.completion_tokens  # the thought's tokens ride with its deltas


def test_a_response_gives_the_thought_as_a_reasoning_item_and_takes_it_back(served, client):
    """The Responses API: the thought is a reasoning item (its text whole: nothing is summarised), the answer the
    message after it, streamed as reasoning_text then output_text events; a reasoning item sent back before the
    assistant's message reaches the template as that message's thought, as chat's `reasoning_content` does."""
    _, model, tokenizer = served
    bias = {"logit_bias": closing_bias(tokenizer)}  # vLLM's extension, as in chat
    reasoning, content, tokens = plain(model, tokenizer, ASK)
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=NEW, extra_body=bias)
    thought, message = response.output
    assert (thought.type, thought.content[0].text, thought.summary) == ("reasoning", reasoning, [])
    assert response.output_text == content and response.usage.output_tokens_details.reasoning_tokens == tokens
    one_by_one = {**bias, "forerun": {"method": "plain"}}  # the trie has learnt this answer: it would come at once
    with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=NEW, extra_body=one_by_one) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    pieces = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(pieces) == reasoning and len(pieces) > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    back = [
        *ASK,
        {
            "type": "reasoning",
            "id": thought.id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}],
        },
        {"role": "assistant", "content": content},
        {"role": "user", "content": "And 4?"},
    ]
    again = client.responses.create(model=MODEL, input=back, max_output_tokens=4)
    turns = [*ASK, {"role": "assistant", "content": content, "reasoning_content": reasoning}, back[-1]]
    chat = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=4)
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.output_text == (chat.choices[0].message.content or "")


def test_anthropics_thinking_blocks_and_its_thinking_switch(served):
    """Anthropic's Messages API: the thought is a thinking block (streamed as thinking deltas), and `thinking`
    disabled turns the template's `enable_thinking` off; each text plain generate's."""
    import anthropic

    server, model, tokenizer = served
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    reasoning, content, _ = plain(model, tokenizer, ASK, biased=False)
    assert reasoning and not content  # unbiased, the seed-0 model thinks past NEW tokens
    message = client.messages.create(model=MODEL, max_tokens=NEW, messages=ASK)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", reasoning)]
    assert message.stop_reason == "max_tokens"
    with client.messages.stream(model=MODEL, max_tokens=NEW, messages=ASK) as stream:
        pieces = [event.thinking for event in stream if event.type == "thinking"]
    assert "".join(pieces) == reasoning
    off = client.messages.create(model=MODEL, max_tokens=NEW, messages=ASK, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == plain(model, tokenizer, ASK, False, enable_thinking=False)[1]


def test_template_kwargs_turn_the_thought_off_and_unknown_ones_are_refused(served, client):
    server, model, tokenizer = served
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reasoning, content, _ = plain(model, tokenizer, ASK, biased=False, enable_thinking=False)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW, extra_body=off)
    message = whole.choices[0].message
    assert reasoning is None and getattr(message, "reasoning", None) is None and message.content == content
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    for kwargs, named in (({"enable_thinkng": False}, "'enable_thinkng' is not a variable"),
                          ({"chat_template": "{{ 1 }}"}, "'chat_template' is not a variable"),
                          ({"eos_token": "x"}, "'eos_token' is not a variable"),
                          ([1], "valid dictionary")):  # fmt: skip
        body = {"messages": ASK, "max_tokens": 4, "chat_template_kwargs": kwargs}
        refused = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 400 and named in refused.text, refused.text
    effort = {"messages": ASK, "max_tokens": 4, "reasoning_effort": "low"}  # the template reads none
    refused = httpx.post(server.url + "/v1/chat/completions", json=effort, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"


def test_a_thought_sent_back_reaches_the_template_as_the_server_sent_it(served, client):
    server, model, tokenizer = served
    first = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW,
                                           logit_bias=closing_bias(tokenizer))  # fmt: skip
    said = first.choices[0].message.model_dump(exclude_none=True)  # as clients send it back
    turns = [*ASK, said, {"role": "user", "content": "And 4?"}]
    again = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=4)
    bare = [*ASK, {"role": "assistant", "content": said["content"]}, turns[-1]]
    without = client.chat.completions.create(model=MODEL, messages=bare, max_tokens=4)
    thought = len(tokenizer.encode(f"<think>\n{said['reasoning_content']}\n</think>\n\n", add_special_tokens=False))
    assert again.usage.prompt_tokens == without.usage.prompt_tokens + thought
    back = [*ASK, {k: v for k, v in said.items() if k != "reasoning"}, turns[-1]]
    expected = plain(model, tokenizer, back, biased=False)
    assert again.choices[0].message.content == expected[1][: len(again.choices[0].message.content or "")]
    url = server.url + "/v1/chat/completions"
    not_said = {"role": "user", "content": "x", "reasoning_content": "y"}
    for message, named in (({**said, "reasoning": "other"}, "differ"), (not_said, "only an assistant's")):
        refused = httpx.post(url, json={"messages": [*ASK, message], "max_tokens": 4}, timeout=60)
        assert refused.status_code == 400 and named in refused.text, refused.text


def test_the_library_gives_the_thought_apart_and_the_whole_text_as_generate_wrote_it(served):
    _, model, tokenizer = served
    closing = tokenizer.convert_tokens_to_ids("</think>")
    decoder = forerun.Decoder(model, tokenizer, "auto")
    result = decoder.generate(ASK, NEW, sequence_bias={(closing,): BIAS})
    reasoning, content, _ = plain(model, tokenizer, ASK)
    assert (result.reasoning, result.content) == (reasoning, content)
    assert result.text.startswith(reasoning) and result.text.endswith(content)
    off = decoder.generate(forerun.GenerationRequest(ASK, NEW, chat_template_kwargs={"enable_thinking": False}))
    assert off.reasoning is None and off.content == plain(model, tokenizer, ASK, False, enable_thinking=False)[1]
    with pytest.raises(ValueError, match="'enable_thinkng' is not a variable"):
        decoder.generate(forerun.GenerationRequest(ASK, 4, chat_template_kwargs={"enable_thinkng": False}))


def test_a_servers_own_template_variables_hold_for_every_request_and_are_checked_at_start(served):
    _, model, tokenizer = served
    config = ServerConfig(MODEL, "plain", max_tokens_limit=NEW, chat_template_kwargs={"enable_thinking": False})
    server = LiveServer(create_app(model, tokenizer, config))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW).choices[0].message
        assert getattr(message, "reasoning", None) is None
        assert message.content == plain(model, tokenizer, ASK, False, enable_thinking=False)[1]
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        thinking = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=NEW, extra_body=on)
        assert thinking.choices[0].message.reasoning == plain(model, tokenizer, ASK, False)[0]
    finally:
        server.stop()
    with pytest.raises(ValueError, match="'enable_thinkng' is not a variable"):
        create_app(model, tokenizer, ServerConfig(MODEL, "plain", chat_template_kwargs={"enable_thinkng": False}))


def test_a_json_answer_follows_the_thought_the_prompt_opened(served):
    """`response_format` holds the answer after the thought: the thought is free and comes apart, the JSON is the
    content; the text is plain generate's with the request's constraint (and the bias). A seed-1 model: it closes
    its thought after 21 tokens, then opens its object."""
    _, _, tokenizer = served
    model = tiny_model("llama", "sdpa", seed=1, vocab_size=len(tokenizer), max_position_embeddings=1024)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "x-guidance": {"whitespace_flexible": False}}
    held = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    decoder = forerun.Decoder(model, tokenizer, "auto")
    ids = decoder.encode(ASK)
    ends = frozenset({tokenizer.eos_token_id})
    constraint = decoder.grammars.constraint(held, ids.shape[1], ends, ids[0].tolist())
    closing = tokenizer.convert_tokens_to_ids("</think>")
    bias = {(closing,): 0.35}
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, sequence_bias=bias,
                         logits_processor=LogitsProcessorList([constraint]))  # fmt: skip
    new = out[0, ids.shape[1] :].tolist()
    thought = thought_in(tokenizer, thought_marks(tokenizer), new, opened=True)
    reasoning, content = split(complete(tokenizer.decode(new, skip_special_tokens=True)), thought)
    assert reasoning and content.startswith("{")  # a thought, then JSON (cut off by max_tokens, perhaps)
    result = decoder.generate(ASK, NEW, response_format=held, sequence_bias=bias)
    assert result.sequences[0, ids.shape[1] :].tolist() == new
    assert (result.reasoning, result.content) == (reasoning, content)


def test_a_jsonl_run_writes_the_thought_apart_and_takes_a_records_template_variables(served, tmp_path):
    """`forerun run`: a record's row carries `reasoning` and `content` where the model thought (its `text` still
    the whole text), and a record's own `chat_template_kwargs` reach the template (a misspelt one fails only its
    record)."""
    from forerun.runner import parse_record, run_records

    _, model, tokenizer = served
    lines = [{"id": "think", "messages": ASK},
             {"id": "off", "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
             {"id": "bad", "messages": ASK, "chat_template_kwargs": {"enable_thinkng": False}}]  # fmt: skip
    records = [parse_record(json.dumps(line), k + 1, {"max_new_tokens": NEW}, k) for k, line in enumerate(lines)]
    out = tmp_path / "out.jsonl"
    run_records(forerun.Decoder(model, tokenizer, "auto"), records, out, batch_size=2)
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    reasoning, content, _ = plain(model, tokenizer, ASK, biased=False)
    assert (rows["think"]["reasoning"], rows["think"]["content"]) == (reasoning, content)
    assert rows["think"]["text"].startswith(reasoning)
    assert "reasoning" not in rows["off"]
    assert rows["off"]["text"] == plain(model, tokenizer, ASK, False, enable_thinking=False)[1]
    assert "'enable_thinkng' is not a variable" in rows["bad"]["error"]


def test_the_terminal_chat_keeps_a_thought_apart_in_its_history(served):
    """`forerun chat`: an answer goes into the history as its content, its thought as `reasoning_content` (where the
    template shows thoughts it takes them so; a thought whose marks the text drops would read as words)."""
    import io

    from rich.console import Console

    from forerun.chat import answer_once

    _, model, tokenizer = served
    closing = tokenizer.convert_tokens_to_ids("</think>")
    decoder = forerun.Decoder(model, tokenizer, "auto")
    message = answer_once(decoder, list(ASK), NEW, Console(file=io.StringIO()), {"sequence_bias": {(closing,): BIAS}})
    reasoning, content, _ = plain(model, tokenizer, ASK)
    assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    plain_answer = answer_once(forerun.Decoder(model, tokenizer, "plain"), list(ASK), 4, Console(file=io.StringIO()),
                               {"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert set(plain_answer) == {"role", "content"}
