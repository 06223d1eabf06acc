"""Continuous batching in `forerun serve`: concurrent clients share forwards, each answer stays its own."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from openai import OpenAI
from test_server import MODEL, LiveServer, plain_text

import forerun
from forerun.costmodel import LatencyCurve
from forerun.request import GenerationRequest
from forerun.server import ServerConfig, create_app
from forerun.server.pool import Abandoned, BatchWorker

from tiny_models import prompts, tiny_model

pytestmark = pytest.mark.real_model
QUESTIONS = [
    "Name three colours.",
    "What is 12 times 11?",
    "Write a Python function that adds two numbers.",
    "Say hello in French.",
    "List the first five prime numbers.",
    "What is the capital of Italy?",
    "Give me a synonym for happy.",
    "Describe a cat in one sentence.",
]
TOKENS = 24


@pytest.fixture(scope="module")
def batching(smollm2):
    model, tokenizer = smollm2
    app = create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_batch=8, max_tokens_limit=256))
    server = LiveServer(app)
    yield server, app
    server.stop()


def test_eight_concurrent_clients_get_their_own_exact_answers(smollm2, batching):
    """8 openai clients at once, half of them streaming: every greedy answer equals plain generate's for its own
    prompt alone, and the server really decoded them together (its batch held several rows at once)."""
    server, app = batching
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    widest = [0]
    watching = threading.Event()

    def watch_batch() -> None:  # /health's "running" is the number of rows in the batch
        while not watching.is_set():
            widest[0] = max(widest[0], httpx.get(server.url + "/health").json()["running"])
            time.sleep(0.05)

    def ask(index: int) -> str:
        messages = [{"role": "user", "content": QUESTIONS[index]}]
        if index % 2:
            chunks = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=TOKENS, stream=True, temperature=0
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0)
        return reply.choices[0].message.content

    watcher = threading.Thread(target=watch_batch)
    watcher.start()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    watching.set()
    watcher.join()
    for question, answer in zip(QUESTIONS, answers, strict=True):
        messages = [{"role": "user", "content": question}]
        assert answer == plain_text(smollm2, messages=messages, max_new_tokens=TOKENS), question
    assert widest[0] >= 2, "the requests never shared the batch"
    health = httpx.get(server.url + "/health").json()
    assert health["queue"] == 0 and health["running"] == 0


def test_a_seeded_sampled_answer_is_the_same_alone_or_among_concurrent_requests(batching):
    """Sampling noise depends on the seed and the position only (`forerun.noise`): 8 seeded requests decoded
    together, sharing forwards and drafts with each other, write exactly what each writes when sent alone."""
    server, _ = batching
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(index: int) -> str:
        messages = [{"role": "user", "content": QUESTIONS[index]}]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOKENS, temperature=1.0, seed=100 + index
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    alone = [ask(index) for index in range(8)]
    assert together == alone
    assert len(set(together)) == 8


def test_n_sampled_choices_are_what_each_seed_writes_alone_and_stream_alike(batching):
    """OpenAI's `n`: choice i of a seeded request is what that request writes with seed + i alone, as a row of
    the batch beside the others; streamed, the chunks of every index assemble the same texts; usage counts every
    choice's tokens and the prompt once."""
    server, _ = batching
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": QUESTIONS[6]}]
    asked = {"model": MODEL, "messages": messages, "max_tokens": TOKENS, "temperature": 1.0}
    reply = client.chat.completions.create(**asked, n=3, seed=300)
    texts = [choice.message.content for choice in sorted(reply.choices, key=lambda c: c.index)]
    alone = [client.chat.completions.create(**asked, seed=300 + i) for i in range(3)]
    assert texts == [one.choices[0].message.content for one in alone]
    assert len(set(texts)) == 3  # a fixed seed would make them alike: each has its own
    assert reply.usage.completion_tokens == sum(one.usage.completion_tokens for one in alone)
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed = ["", "", ""]
    finished = set()
    for event in client.chat.completions.create(**asked, n=3, seed=300, stream=True):
        for choice in event.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert streamed == texts and finished == {0, 1, 2}
    completions = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=0)
    assert completions.choices[0].text == completions.choices[1].text  # greedy: one text, shown twice
    long = {"messages": messages, "max_tokens": 256, "temperature": 1.0, "n": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=long, timeout=60) as response:
        next(response.iter_lines())  # the client reads one event and goes: every choice's row leaves
    assert server.queue_after(5) == 0  # 3 rows of 256 tokens take far longer here


def test_a_client_that_disconnects_leaves_the_batch(batching):
    server, app = batching
    body = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}], "max_tokens": 256}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)  # gives up after 1 s
    assert server.queue_after(20) == 0  # 256 tokens take far longer: it was cancelled
    reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200


def test_bad_requests_in_a_batch_fail_alone(smollm2, batching):
    """A request that fails while it is set up as a row (a prompt over the context) gets its 400; the batch goes
    on for the others."""
    server, app = batching
    assert isinstance(app.state.worker, BatchWorker)
    good = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8}
    bad = {"prompt": "word " * 9000, "max_tokens": 8}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, server.url + path, json=body, timeout=120)
                   for path, body in [("/v1/chat/completions", good), ("/v1/completions", bad),
                                      ("/v1/chat/completions", good)]]  # fmt: skip
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200, 400, 200]
    assert "context" in responses[1].json()["error"]["message"]


def test_a_next_turn_reuses_what_the_server_read_and_reports_it(smollm2, batching):
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: the system prompt is read once for every request, and
    a conversation's next turn reads only its new message; the answers stay plain generate's."""
    server, _ = batching
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    first = [{"role": "user", "content": "Name a fruit that is yellow."}]
    reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=TOKENS, temperature=0)
    answer, first_prompt = reply.choices[0].message.content, reply.usage.prompt_tokens
    assert answer == plain_text(smollm2, messages=first, max_new_tokens=TOKENS)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 20  # SmolLM2's default system prompt: 24 tokens
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And a red one?"}]
    reply = client.chat.completions.create(model=MODEL, messages=second, max_tokens=TOKENS, temperature=0)
    assert reply.choices[0].message.content == plain_text(smollm2, messages=second, max_new_tokens=TOKENS)
    # the first turn's prompt and (most of) its answer: re-rendered by the template, the answer's last tokens may
    # tokenize otherwise than they were generated
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert first_prompt + TOKENS // 2 < cached < reply.usage.prompt_tokens, (first_prompt, cached)


def test_a_cache_salt_keeps_a_tenants_text_to_itself(batching):
    """vLLM's `cache_salt`: a prompt read under one salt speeds up that salt's next prompt only; another tenant
    sending the same text is not seeded from it (and cannot time whether it was sent); a bad salt is a 400."""
    server, _ = batching
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Spell the word banana backwards, one letter per line."}]

    def ask(salt: str):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": salt}
        )
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    assert ask("alice")[0] == 0  # not even the unsalted system prompt other requests left
    assert ask("mallory")[0] == 0
    cached, prompt_tokens = ask("alice")
    assert cached == prompt_tokens - 1  # everything but the last token, always fed
    reply = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": messages, "cache_salt": 7, "max_tokens": 2}, timeout=60
    )
    assert reply.status_code == 400 and "cache_salt" in reply.text


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("chunk", [5, 0])
def test_a_long_prompt_joins_a_chunk_at_a_time_between_the_running_rows_steps(chunk, static):
    """The worker feeds a joining 24-token prompt 5 tokens at a time, a step of the running request after each
    chunk: the running request writes 4 times while the long prompt is read (with chunk 0 it waits for the whole
    prefill: not once). Both answers equal plain generate's, and a bad chunk size is refused. `static`: the rows
    take places of a static base (a GPU's), the joining prompt fed into its own place between the steps."""
    model = tiny_model("llama", "sdpa")
    curve = LatencyCurve((1, 8, 64), (1.0, 1.2, 3.0))
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=curve, static_cache=static)
    events: list[str] = []  # in the worker thread's order

    class Recorder:  # a transformers-style streamer: the prompt first, then each step's new tokens
        def __init__(self, name: str) -> None:
            self.name, self.puts = name, 0

        def put(self, ids) -> None:
            self.puts += 1
            if self.puts > 1:
                events.append(self.name)

        def end(self) -> None:
            pass

    short, long = prompts(2, length=24)
    short = short[:, :6]

    def prepare(prompt, name: str):
        def build():
            events.append("begin " + name)
            return decoder.prepare(
                GenerationRequest(prompt[0].tolist(), 16, eos_token_id=(), streamer=Recorder(name))
            ), decoder

        return build

    worker = BatchWorker(model, decoder.batch_budget(), max_batch=4, prefill_chunk=chunk, base=decoder.base)
    assert (worker.batch.shared.__class__.__name__ == "StaticRows") == static

    async def both():
        first = asyncio.ensure_future(worker.run(prepare(short, "a"), threading.Event()))
        while "a" not in events:  # the short request is running
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(worker.run(prepare(long, "b"), threading.Event()))
        return await first, await second

    try:
        results = asyncio.run(both())
    finally:
        worker.shutdown()
    between = events[events.index("begin b") : events.index("b")]
    assert between.count("a") == (4 if chunk else 0), events
    assert results[1].stats.prefill_chunks == (5 if chunk else 1)
    for prompt, result in zip([short, long], results, strict=True):
        reference = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(result.sequences, reference)
    with pytest.raises(ValueError, match="prefill_chunk"):
        BatchWorker(model, decoder.batch_budget(), max_batch=4, prefill_chunk=-1)


def test_a_joining_prompt_whose_client_went_away_is_dropped_between_chunks():
    """The long prompt's client goes away after its first chunk (its cancel event set while the running request
    steps): it gets no further chunk, its future ends in Abandoned, its slots are given back, and the running
    request finishes equal to plain generate."""
    model = tiny_model("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=LatencyCurve((1, 8, 64), (1.0, 1.2, 3.0)))
    gone, began, stepping = threading.Event(), threading.Event(), threading.Event()

    class Leaver:  # the running request's streamer: the first step after the long prompt began cancels it
        def put(self, ids) -> None:
            if stepping.is_set() and began.is_set():
                gone.set()
            stepping.set()  # (the first put is the prompt)

        def end(self) -> None:
            pass

    short, long = prompts(2, length=24)
    short = short[:, :6]
    worker = BatchWorker(model, decoder.batch_budget(), max_batch=4, prefill_chunk=5)
    fed, abandoned = [], []
    feed, abandon = worker.batch.feed, worker.batch.abandon

    def feeding(joining, *args, **kwargs):
        fed.append(id(joining.row.job))
        if joining.row.job.transcript.streamer is None:  # the long prompt's first chunk is fed in this call, so
            began.set()  # the running request's next step (on this thread, after it) is what cancels it
        return feed(joining, *args, **kwargs)

    worker.batch.feed = feeding
    worker.batch.abandon = lambda joining: abandoned.append(id(joining.row.job)) or abandon(joining)

    def prepare(prompt, streamer):
        def build():
            return decoder.prepare(
                GenerationRequest(prompt[0].tolist(), 16, eos_token_id=(), streamer=streamer)
            ), decoder

        return build

    async def both():
        first = asyncio.ensure_future(worker.run(prepare(short, Leaver()), threading.Event()))
        while not stepping.is_set():
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(worker.run(prepare(long, None), gone))
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        kept, dropped = asyncio.run(both())
    finally:
        worker.shutdown()
    assert isinstance(dropped, Abandoned), dropped
    reference = model.generate(short, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(kept.sequences, reference)
    long_job = abandoned[0]
    assert abandoned == [long_job] and fed.count(long_job) == 1  # one chunk of 24 tokens, then dropped
    assert not worker.joining and worker.batch.shared.slots == 0


@pytest.mark.parametrize("static", [False, True])
def test_a_failed_step_fails_its_rows_while_a_joining_request_goes_on(static):
    """A batch step raises (a device error, say) while a long prompt is being read a chunk at a time: the running
    request gets the error, and the joining one, whose prompt was fed before the failure, joins the batch started
    afresh and gets plain generate's answer (`static`: its prompt sits in its place of the static base, which the
    fresh batch keeps for it)."""
    model = tiny_model("llama", "sdpa")
    curve = LatencyCurve((1, 8, 64), (1.0, 1.2, 3.0))
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=curve, static_cache=static)
    worker = BatchWorker(model, decoder.batch_budget(), max_batch=4, prefill_chunk=5, base=decoder.base)
    forward, failed = worker.batch.shared.forward, threading.Event()

    def failing(*args):
        if not failed.is_set() and worker.joining and worker.joining[0][0].chunks >= 2:
            failed.set()
            raise RuntimeError("the device fell over")
        return forward(*args)

    worker.batch.shared.forward = failing
    started = threading.Event()

    class Started:
        def put(self, ids) -> None:
            started.set()

        def end(self) -> None:
            pass

    short, long = prompts(2, length=24)
    short = short[:, :6]

    def prepare(prompt, streamer=None):
        return lambda: (decoder.prepare(GenerationRequest(prompt[0].tolist(), 40, eos_token_id=(),
                                                          streamer=streamer)), decoder)  # fmt: skip

    async def both():
        first = asyncio.ensure_future(worker.run(prepare(short, Started()), threading.Event()))
        while not started.is_set():
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(worker.run(prepare(long), threading.Event()))
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        running, joining = asyncio.run(both())
    finally:
        worker.shutdown()
    assert failed.is_set() and isinstance(running, RuntimeError), running
    reference = model.generate(long, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(joining.sequences, reference)


def test_what_a_failed_batch_had_put_off_is_learnt_before_it_starts_afresh():
    """A batch step fails while the batch holds learning it put off (a paused step's, or a leaving row's drafters'
    finishing: here a stand-in, put off by the failing forward itself, after which no step could learn it): the
    worker learns it before it starts a fresh batch, so no drafter is left without what a request taught it (a
    shared trie holding a finished request's prompt weights)."""
    model = tiny_model("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=LatencyCurve((1, 8, 64), (1.0, 1.2, 3.0)))
    worker = BatchWorker(model, decoder.batch_budget(), max_batch=4)
    forward, learnt, calls = worker.batch.shared.forward, threading.Event(), [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] == 3:
            worker.batch.unlearned.append((worker.batch.rows[0], learnt.set))
            raise RuntimeError("the device fell over")
        return forward(*args)

    worker.batch.shared.forward = failing
    (prompt,) = prompts(1, length=12)

    async def one():
        request = GenerationRequest(prompt[0].tolist(), 16, eos_token_id=())
        return await worker.run(lambda: (decoder.prepare(request), decoder), threading.Event())

    try:
        with pytest.raises(RuntimeError, match="fell over"):
            asyncio.run(one())
    finally:
        worker.shutdown()
    assert learnt.is_set()


def test_concurrent_clients_of_a_server_with_the_shipped_head_get_exact_answers(smollm2):
    """`forerun serve --method eagle3 --draft-head smollm2-135m`: concurrent rows of the continuous batch, each
    with its own head reading its own row's hidden states, get plain generate's answers (whether they draft is the
    batch policy's call: in fp32 on a CPU, at four rows, it mostly finds drafting does not pay)."""
    model, tokenizer = smollm2
    config = ServerConfig(MODEL, "eagle3", max_batch=4, max_tokens_limit=64, draft_head="smollm2-135m")
    server = LiveServer(create_app(model, tokenizer, config))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(index: int) -> str:
            messages = [{"role": "user", "content": QUESTIONS[index]}]
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
            return reply.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    for question, answer in zip(QUESTIONS[:4], answers, strict=True):
        messages = [{"role": "user", "content": question}]
        assert answer == plain_text(smollm2, messages=messages, max_new_tokens=32), question
    counter = 'forerun_generated_tokens_total{method="eagle3"}'
    generated = [line for line in metrics.splitlines() if line.startswith(counter)]
    assert generated and float(generated[0].split()[-1]) >= 4 * 8  # the rows decoded with the head's method


def test_requests_arriving_together_join_a_static_base_side_by_side():
    """Four requests wait while the worker is busy preparing the first: their prompts (of 9 to 24 tokens, each
    rest within a chunk) are fed in the same forwards, one call for the four, and each answer is plain generate's.
    One of them fails as it joins (its streamer raises at its first token): it alone gets the error."""
    model = tiny_model("llama", "sdpa")
    curve = LatencyCurve((1, 8, 64), (1.0, 1.2, 3.0))
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=curve, static_cache=True)
    worker = BatchWorker(model, decoder.batch_budget(), max_batch=4, prefill_chunk=32, base=decoder.base)
    together, feed_apart = [], worker.batch.feed_apart
    worker.batch.feed_apart = lambda joinings, *a, **k: together.append(len(joinings)) or feed_apart(joinings, *a, **k)
    queued = threading.Event()

    class Breaks:  # the prompt goes in, the first token does not
        def __init__(self) -> None:
            self.puts = 0

        def put(self, ids) -> None:
            self.puts += 1
            if self.puts > 1:
                raise RuntimeError("this client's stream broke")

        def end(self) -> None:
            pass

    texts = [p[:, :length] for p, length in zip(prompts(4, length=24), (9, 24, 17, 12), strict=True)]

    def prepare(prompt, first: bool, streamer=None):
        def build():
            if first:
                queued.wait(10)  # the others are queued while the worker prepares this one
            return decoder.prepare(
                GenerationRequest(prompt[0].tolist(), 12, eos_token_id=(), streamer=streamer)
            ), decoder

        return build

    async def all_four():
        futures = [
            asyncio.ensure_future(worker.run(prepare(text, i == 0, Breaks() if i == 2 else None), threading.Event()))
            for i, text in enumerate(texts)
        ]
        while len(worker.waiting) + len(worker.joining) < 3:
            await asyncio.sleep(0.001)
        queued.set()
        return await asyncio.gather(*futures, return_exceptions=True)

    try:
        results = asyncio.run(all_four())
    finally:
        worker.shutdown()
    assert together == [4], together
    assert isinstance(results[2], RuntimeError) and "stream broke" in str(results[2])
    for index in (0, 1, 3):
        reference = model.generate(texts[index], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(results[index].sequences, reference), index
    assert not worker.joining and not worker.batch.rows


@pytest.mark.parametrize("static", [False, True])
def test_a_next_turn_in_the_worker_reads_only_its_new_message(static):
    """A conversation's second turn through a server's batch worker, after its first: the first turn's prompt and
    answer come from the prefix cache (on the static base copied into the row's place, the row begun outside
    inference mode as the worker begins it), the new message is read a chunk at a time, and both answers are plain
    generate's."""
    model = tiny_model("llama", "sdpa")
    curve = LatencyCurve((1, 8, 64), (1.0, 1.2, 3.0))
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=curve, static_cache=static)
    worker = BatchWorker(model, decoder.batch_budget(), max_batch=4, prefill_chunk=5, base=decoder.base)
    first = prompts(1, length=24)[0]

    def request(prompt):
        def build():
            return decoder.prepare(GenerationRequest(prompt[0].tolist(), 12, eos_token_id=())), decoder

        return build

    try:
        one = asyncio.run(worker.run(request(first), threading.Event()))
        follow_up = torch.cat([one.sequences, torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])], dim=1)
        two = asyncio.run(worker.run(request(follow_up), threading.Event()))
    finally:
        worker.shutdown()
    for prompt, result in ((first, one), (follow_up, two)):
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(result.sequences, reference)
    assert one.stats.cached_prompt_tokens == 0 and two.stats.cached_prompt_tokens >= first.shape[1] + 11
    assert two.stats.prefill_chunks == 2  # 8 new tokens and the answer's last, the root apart: a chunk of 5, the rest


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_a_hybrids_concurrent_clients_share_its_batch(smollm2, family):
    """A hybrid (Qwen3.5's layout, random weights) served to 4 concurrent clients: they share the batch (its states
    a row each, the rows' chains side by side, each row's states cut back to its own last kept token), and every
    answer is plain generate's for its prompt alone. A request alone in the batch verifies chains of guesses too."""
    _, tokenizer = smollm2
    model = tiny_model(family, vocab_size=len(tokenizer))
    app = create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_batch=4, max_tokens_limit=64))
    server = LiveServer(app)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    widest, watching = [0], threading.Event()

    def watch_batch() -> None:
        while not watching.is_set():
            widest[0] = max(widest[0], httpx.get(server.url + "/health").json()["running"])
            time.sleep(0.02)

    def ask(index: int) -> str:
        messages = [{"role": "user", "content": QUESTIONS[index]}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
        return reply.choices[0].message.content

    def drafted() -> float:  # requests whose guesses were verified (their acceptance observed)
        metrics = httpx.get(server.url + "/metrics").text
        counts = [line for line in metrics.splitlines() if line.startswith("forerun_acceptance_count")]
        return sum(float(line.split()[-1]) for line in counts)

    watcher = threading.Thread(target=watch_batch)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
        watching.set()
        before = drafted()
        for _ in range(4):  # alone: its chains are verified once they pay (the trie holds its answer)
            again = ask(0)
            assert again == answers[0]
            if drafted() > before:
                break
        # fp32 choices steer by this machine's curve and timings: where a 2-token chain costs 2x one token (its
        # states copied first), the calibration needs a second or third look at the answer before chains pay
        assert drafted() == before + 1
    finally:
        watching.set()
        watcher.join()
        server.stop()
    for question, answer in zip(QUESTIONS[:4], answers, strict=True):
        messages = [{"role": "user", "content": question}]
        assert answer == plain_text((model, tokenizer), messages=messages, max_new_tokens=48), question
    assert widest[0] >= 2, "the requests never shared the batch"


def test_a_hybrids_lone_stream_cut_off_and_requests_joining_it_keep_their_own_answers(smollm2):
    """A hybrid server's lone streamed request (its chains put back where accepted in part) is joined by a second
    request, then its client goes away mid-stream; the second answer, and a third asked alone after, are plain
    generate's, and the batch empties."""
    _, tokenizer = smollm2
    model = tiny_model("qwen3_5_text", vocab_size=len(tokenizer))
    app = create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_batch=4, max_tokens_limit=256))
    server = LiveServer(app)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(index: int) -> str:
        messages = [{"role": "user", "content": QUESTIONS[index]}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)

    try:
        ask(0)  # the trie learns an answer: the stream below drafts from the start
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=256, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(ask, 1)
            time.sleep(0.3)
            stream.close()  # the client goes away while the other request decodes beside it
            second = joined.result().choices[0].message.content
        third = ask(2).choices[0].message.content
        assert server.queue_after(20) == 0
    finally:
        server.stop()
    for index, answer in ((1, second), (2, third)):
        messages = [{"role": "user", "content": QUESTIONS[index]}]
        assert answer == plain_text((model, tokenizer), messages=messages, max_new_tokens=32), index


@pytest.mark.parametrize(("family", "chunk"), [("jamba", None), ("qwen3_5_text", 8)])
def test_a_served_hybrid_that_loses_its_states_reads_each_prompt_whole(smollm2, family, chunk):
    """Jamba's scan over several tokens starts from no state (`forerun.base.chain.reads_on`): served, its prompts
    join the batch whole, not in chunks (Qwen3.5's in chunks of 8), and an answer to a prompt of several chunks is
    plain generate's."""
    _, tokenizer = smollm2
    model = tiny_model(family, vocab_size=len(tokenizer))
    app = create_app(model, tokenizer, ServerConfig(MODEL, "auto", max_batch=4, max_tokens_limit=64, prefill_chunk=8))
    assert app.state.worker.prefill_chunk == chunk
    server = LiveServer(app)
    try:
        prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
        reply = httpx.post(
            server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=120
        )
    finally:
        server.stop()
    assert reply.json()["choices"][0]["text"] == plain_text((model, tokenizer), prompt=prompt, max_new_tokens=12)
