"""Every response shape of the server, from a GenerationResult, without a model or uvicorn (`server.shaping`)."""

from __future__ import annotations

import json

import torch

from forerun.decoder import GenerationResult
from forerun.logprobs import TokenLogprob
from forerun.server import shaping
from forerun.stats import GenerationStats


class Pieces:
    """A tokenizer whose token i decodes to PIECES[i]."""

    PIECES = ["one", ".", " two", ".", " three"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids)


def result(stop_at=None, reason="stop", logprobs=True) -> GenerationResult:
    stats = GenerationStats(forwards=3, new_tokens=5, cached_prompt_tokens=2)
    entries = [TokenLogprob(i, -0.1 * i, ((i, -0.1 * i), (4, -3.0))) for i in range(5)] if logprobs else None
    sequences = torch.tensor([[7, 7, 7, 0, 1, 2, 3, 4]])
    return GenerationResult(sequences, 3, "one. two. three", stats, ["model"] * 5, entries, 0, reason, stop_at)


def test_a_chat_completion_shows_the_text_before_the_stop_string_and_only_its_logprobs():
    answer = shaping.Answer("chatcmpl-1", 5, "m", chat=True)
    body = shaping.completion(answer, [result(stop_at=4)], "auto", Pieces())
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["model"] == "m"
    assert choice["message"] == {"role": "assistant", "content": "one.", "refusal": None}
    assert choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["one", "."]
    alternative = {"token": " three", "logprob": -3.0, "bytes": list(b" three")}
    assert choice["logprobs"]["content"][1]["top_logprobs"][1] == alternative
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
            "reasoning_tokens": 0,
        },
    }
    assert body["forerun"]["method"] == "auto" and body["forerun"]["forwards"] == 3


def test_a_text_completion_carries_its_length_reason_and_text_offsets():
    answer = shaping.Answer("cmpl-1", 5, "m", chat=False)
    body = shaping.completion(answer, [result(reason="length")], "plain", Pieces())
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["text"] == "one. two. three"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == Pieces.PIECES
    assert choice["logprobs"]["text_offset"] == [0, 3, 4, 8, 9]
    assert choice["logprobs"]["top_logprobs"][0] == {"one": 0.0, " three": -3.0}
    assert shaping.completion(answer, [result(logprobs=False)], "plain", Pieces())["choices"][0]["logprobs"] is None


def test_several_choices_count_every_choices_tokens_and_each_generation_once():
    answer = shaping.Answer("chatcmpl-2", 5, "m", chat=True)
    first, second = result(reason="length"), result(stop_at=4)
    second.stats.forwards, second.stats.accepted, first.stats.candidates = 2, 1, 4
    body = shaping.completion(answer, [first, second], "auto", Pieces())
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["one. two. three", "one."]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 10
    assert body["forerun"]["forwards"] == 5 and body["forerun"]["tokens_per_forward"] == 2.0
    assert body["forerun"]["acceptance"] == 0.25
    greedy = shaping.completion(answer, [first, first, first], "auto", Pieces())  # one generation, three choices
    assert greedy["usage"]["completion_tokens"] == 15 and greedy["forerun"]["forwards"] == 3
    event = json.loads(shaping.chunk(answer, "x", index=2)[6:])
    assert event["choices"][0]["index"] == 2 and json.loads(shaping.opening(answer, 1)[6:])["choices"][0]["index"] == 1


def test_stream_chunks_are_openai_events_with_logprobs_per_chunk():
    chat, text = shaping.Answer("c", 5, "m", chat=True), shaping.Answer("t", 5, "m", chat=False)
    entries = result().logprobs[2:3]
    event = json.loads(shaping.chunk(chat, " two", logprobs=shaping.logprobs_payload(Pieces(), entries, True))[6:])
    assert event["object"] == "chat.completion.chunk" and event["choices"][0]["delta"] == {"content": " two"}
    assert event["choices"][0]["logprobs"]["content"][0]["token"] == " two"
    offsets = shaping.logprobs_payload(Pieces(), entries, False, offset=4)["text_offset"]
    assert offsets == [4]  # a streamed completion's offsets count from the answer's start
    last = json.loads(shaping.chunk(text, None, "length")[6:])
    assert last["choices"] == [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}]
    usage = json.loads(shaping.chunk(chat, None, None, {"usage": {"total_tokens": 8}}, choices=False)[6:])
    assert usage["choices"] == [] and usage["usage"] == {"total_tokens": 8}
    opening = json.loads(shaping.opening(chat)[6:])
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert shaping.chunk(chat, "x").endswith("\n\n") and shaping.DONE == "data: [DONE]\n\n"


def test_an_echoed_prompt_comes_before_the_answer_with_its_logprobs_the_first_null():
    answer = shaping.Answer("cmpl-3", 5, "m", chat=False)
    echo = shaping.Echo("one. two", (0, 1, 2), (None, TokenLogprob(1, -0.5, ((3, -0.2),)), TokenLogprob(2, -1.0)))
    body = shaping.completion(answer, [result(stop_at=4)], "auto", Pieces(), [echo], (3, 0))
    choice = body["choices"][0]
    assert choice["text"] == "one. twoone."  # the prompt, then the answer up to its stop string
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["one", ".", " two", "one", "."]
    assert logprobs["token_logprobs"] == [None, -0.5, -1.0, 0.0, -0.1]
    assert logprobs["top_logprobs"][:2] == [None, {".": -0.2}]
    assert logprobs["text_offset"] == [0, 3, 4, 8, 11]  # the answer's offsets follow the prompt's text
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_echoed_prompt_alone_has_no_generation_and_counts_only_its_prompts():
    answer = shaping.Answer("cmpl-4", 5, "m", chat=False)
    scored = shaping.Echo("one.", (0, 1), (None, TokenLogprob(1, -0.5)))
    plain = shaping.Echo(" two", (2,), None)
    body = shaping.completion(answer, [None, None], "auto", Pieces(), [scored, plain], (3, 0))
    assert [c["text"] for c in body["choices"]] == ["one.", " two"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5] and body["choices"][1]["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 0
    assert body["forerun"]["forwards"] == 0 and body["forerun"]["seconds"] == 0.0
