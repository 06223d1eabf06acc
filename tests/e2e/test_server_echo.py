"""Completions as evaluation harnesses call them (lm-evaluation-harness's `local-completions`): prompts as token ids
and lists of prompts, `echo` with `logprobs` (the prompt's own tokens scored), `max_tokens` 0; on the continuous
batch (the prompt scored a chunk at a time between the rows' steps) and on the one-at-a-time worker."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from openai import OpenAI
from test_server import MODEL, LiveServer, plain_text

from forerun.server import ServerConfig, create_app

pytestmark = pytest.mark.real_model
CHUNK = 8
"""Prompt tokens a piece: a prompt of a few dozen tokens is scored in several pieces."""


@pytest.fixture(scope="module", params=["batched", "one-at-a-time"])
def served(request, smollm2):
    model, tokenizer = smollm2
    batch = 8 if request.param == "batched" else 1
    config = ServerConfig(MODEL, "auto", max_tokens_limit=64, max_batch=batch, prefill_chunk=CHUNK)
    server = LiveServer(create_app(model, tokenizer, config))
    yield server, OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def reference(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of one forward of the whole prompt: row i chooses token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def test_echoed_logprobs_are_the_prompt_scored_by_one_forward(smollm2, served):
    model, tokenizer = smollm2
    ids = ids_of(tokenizer, "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is")
    assert len(ids) > 2 * CHUNK
    answer = served[1].completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=2, max_tokens=1)
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    expected = reference(model, ids)
    chosen = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1 : len(ids)]), chosen, rtol=0, atol=1e-4)
    best = expected[:-1].topk(2, dim=-1)
    for position, top in enumerate(logprobs.top_logprobs[1 : len(ids)]):
        assert list(top) == [tokenizer.decode([t]) for t in best.indices[position].tolist()]
    first = plain_text(smollm2, tokenizer.decode(ids), max_new_tokens=1)
    assert choice.text == tokenizer.decode(ids) + first and answer.usage.prompt_tokens == len(ids)
    # the generation read the scored prompt from the prefix cache: one prefill, not two (the root is always fed)
    assert answer.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    salted = {
        "model": MODEL,
        "prompt": [ids],
        "echo": True,
        "logprobs": 0,
        "max_tokens": 1,
        "extra_body": {"cache_salt": "t1"},
    }
    assert served[1].completions.create(**salted).usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    others = served[1].completions.create(model=MODEL, prompt=[ids], max_tokens=1, extra_body={"cache_salt": "t2"})
    assert others.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's echo is not read


def test_a_harness_loglikelihood_and_greediness_of_a_continuation(smollm2, served):
    """What lm-evaluation-harness reads: token_logprobs[ctxlen:-1] and whether each is its position's top one."""
    model, tokenizer = smollm2
    context = ids_of(tokenizer, "Question: What is two plus two?\nAnswer:")
    written = plain_text(smollm2, tokenizer.decode(context), max_new_tokens=8)
    own = ids_of(tokenizer, tokenizer.decode(context) + written)[len(context) :]
    other = ids_of(tokenizer, " Paris is the capital of France")
    payload = {"model": MODEL, "prompt": [context + own, context + other], "max_tokens": 1, "logprobs": 1}
    answer = served[1].completions.create(**payload, echo=True, temperature=0, seed=1234)
    verdicts = []
    for choice, continuation in zip(sorted(answer.choices, key=lambda c: c.index), [own, other], strict=True):
        values = choice.logprobs.token_logprobs[len(context) : -1]
        tops = choice.logprobs.top_logprobs[len(context) : -1]
        assert len(values) == len(continuation)
        verdicts.append(all(value >= max(top.values()) for value, top in zip(values, tops, strict=True)))
        expected = reference(model, context + continuation)[len(context) - 1 : -1]
        total = float(expected.gather(1, torch.tensor(continuation)[:, None]).sum())
        assert sum(values) == pytest.approx(total, abs=1e-3)
    assert verdicts == [True, False]  # the model's own greedy answer is greedy; another is not


def test_max_tokens_0_returns_the_prompt_alone_streamed_or_not(smollm2, served):
    _, tokenizer = smollm2
    client = served[1]
    answer = client.completions.create(model=MODEL, prompt="One, two, three,", echo=True, max_tokens=0, logprobs=0)
    choice = answer.choices[0]
    assert choice.text == "One, two, three," and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids_of(tokenizer, "One, two, three,"))
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(choice.logprobs.tokens)
    usage = {"include_usage": True}
    stream = client.completions.create(
        model=MODEL, prompt=["One,", "Two,"], echo=True, max_tokens=0, stream=True, stream_options=usage
    )
    chunks = list(stream)
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: "One,", 1: "Two,"} and chunks[-1].usage.completion_tokens == 0


def test_several_prompts_are_groups_of_n_choices_each_plain_generates(smollm2, served):
    _, tokenizer = smollm2
    prompts = ["def add(a, b):", "Once upon a time"]
    answer = served[1].completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=12, temperature=0)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    expected = [plain_text(smollm2, p, max_new_tokens=12) for p in prompts]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]
    assert answer.usage.prompt_tokens == sum(len(ids_of(tokenizer, p)) for p in prompts)
    as_ids = served[1].completions.create(model=MODEL, prompt=[ids_of(tokenizer, p) for p in prompts], max_tokens=12)
    assert [c.text for c in sorted(as_ids.choices, key=lambda c: c.index)] == expected
    sampled = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    whole = served[1].completions.create(**sampled, echo=True)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [t.startswith(p) for t, p in zip(texts, [prompts[0]] * 2 + [prompts[1]] * 2, strict=True)] == [True] * 4
    alone = served[1].completions.create(**{**sampled, "prompt": prompts[1], "seed": 8})  # prompt 1, choice 1
    assert texts[3] == prompts[1] + alone.choices[0].text
    streamed = ["", "", "", ""]
    for event in served[1].completions.create(**sampled, echo=True, stream=True):
        for choice in event.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_a_streamed_echo_sends_the_prompt_first_then_plain_generates_answer(smollm2, served):
    stream = served[1].completions.create(
        model=MODEL, prompt="def fib(n):", echo=True, logprobs=1, max_tokens=16, stream=True, temperature=0
    )
    chunks = [c for c in stream if c.choices and c.choices[0].text]
    assert chunks[0].choices[0].text == "def fib(n):" and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks) == "def fib(n):" + plain_text(smollm2, "def fib(n):", None, 16)


def test_a_long_echo_beside_a_stream_hurts_neither_and_bad_prompts_are_400s(smollm2, served):
    model, tokenizer = smollm2
    server, client = served
    long = ids_of(tokenizer, "Count with me: " + ", ".join(str(i) for i in range(120)))  # dozens of pieces
    question = [{"role": "user", "content": "Name a colour."}]
    with ThreadPoolExecutor(2) as pool:
        scored = pool.submit(client.completions.create, model=MODEL, prompt=long, echo=True, logprobs=1, max_tokens=0)
        chat = pool.submit(
            lambda: "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model=MODEL, messages=question, max_tokens=16, stream=True)
                if c.choices
            )
        )
        assert chat.result() == plain_text(smollm2, messages=question, max_new_tokens=16)
        values = scored.result().choices[0].logprobs.token_logprobs
    expected = reference(model, long)[:-1].gather(1, torch.tensor(long[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(values[1:]), expected, rtol=0, atol=1e-4)
    too_long = [5] * (model.config.max_position_embeddings + 1)
    bodies = [
        {"prompt": [5, 10**6], "max_tokens": 0},
        {"prompt": too_long, "echo": True, "max_tokens": 0},
        {"prompt": [[5, 6], too_long], "echo": True, "logprobs": 1, "max_tokens": 1, "n": 2, "temperature": 1.0},
    ]
    for body in bodies:
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    assert httpx.get(server.url + "/health").json()["queue"] == 0  # every place taken was given back
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_answers_to_one_question_score_the_question_once(smollm2, served):
    """A harness's multiple-choice question: each answer is scored after the question, and every answer after
    the first reads the question's keys, values and entries from the prefix cache (`cached_tokens`), its own
    log-probabilities those of one forward still."""
    model, tokenizer = smollm2
    question = ids_of(tokenizer, "Question: Which planet is known as the red planet?\nAnswer:")
    salt = {"cache_salt": "quiz"}  # the other tests' texts stay out of this one's cache
    for number, answer in enumerate([" Mars", " Venus", " Jupiter"]):
        ids = question + ids_of(tokenizer, answer)
        reply = served[1].completions.create(
            model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=0, extra_body=salt
        )
        assert reply.usage.prompt_tokens_details.cached_tokens == (0 if number == 0 else len(question) - 1)
        expected = reference(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        values = torch.tensor(reply.choices[0].logprobs.token_logprobs[1:])
        torch.testing.assert_close(values, expected, rtol=0, atol=1e-4)


def test_a_long_echo_whose_client_leaves_stops_between_chunks(smollm2, served):
    """An attacker's pattern: a long prompt to score, and the client gone at once. The scoring stops at its next
    chunk (the batch's thread is not held for the rest), its place is given back, and the server answers on."""
    model, tokenizer = smollm2
    server, client = served
    long = ids_of(tokenizer, " ".join(f"item {i}" for i in range(600)))  # hundreds of chunks of 8
    body = {"model": MODEL, "prompt": long, "echo": True, "logprobs": 5, "max_tokens": 0}
    fed: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, a, k: fed.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        assert server.queue_after(60) == 0
    finally:
        hook.remove()
    assert 0 < sum(fed) < len(long) // 2  # stopped between chunks, long before the prompt's end
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
