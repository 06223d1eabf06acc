"""A reasoning model's thought told apart from its answer (`forerun.thoughts`): from the tokens, with marks the
text shows (Qwen3's `<think>`) or drops (Mistral's special `[THINK]`), opened by the answer or by the prompt; the
result's `reasoning` and `content`, and a chat stream's `Reasoning` and content deltas, which add up to them."""

from __future__ import annotations

import pytest
import torch
from streams import content_of, queued, sent_calls

from forerun import GenerationResult
from forerun.server.stream import Reasoning, TokenStream
from forerun.stats import GenerationStats
from forerun.thoughts import Thought, ThoughtMarks, ThoughtWatch, opened_by, split, thought_in, thought_marks
from forerun.tool_calls import ToolCall
from forerun.tool_stream import CallPart

from tiny_models import byte_tokenizer

ADD = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def qwen_tokenizer():
    """Marks of their own that the text shows, as Qwen3's tokenizer has them."""
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def mistral_tokenizer():
    """Special marks the decoded text drops, as Magistral's `[THINK]` and `[/THINK]`."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    return tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def read(tokenizer, answer: str, prompt: str = "Hi") -> tuple[str | None, str]:
    """(reasoning, content) of `answer` after `prompt`, read from its tokens."""
    marks = thought_marks(tokenizer)
    new = ids(tokenizer, answer)
    thought = thought_in(tokenizer, marks, new, opened_by(tokenizer, marks, ids(tokenizer, prompt)))
    return split(tokenizer.decode(new, skip_special_tokens=True), thought)


def test_the_marks_are_tokens_a_tokenizer_added_else_there_is_no_thought():
    qwen, mistral = qwen_tokenizer(), mistral_tokenizer()
    assert thought_marks(qwen) == ThoughtMarks(*qwen.convert_tokens_to_ids(["<think>", "</think>"]))
    assert thought_marks(mistral) == ThoughtMarks(*mistral.convert_tokens_to_ids(["[THINK]", "[/THINK]"]))
    assert thought_marks(byte_tokenizer()) is None  # "<think>" is only bytes there: a model writing it is answering
    half = byte_tokenizer()
    half.add_tokens(["<think>"])
    assert thought_marks(half) is None


@pytest.mark.parametrize("make", [qwen_tokenizer, mistral_tokenizer], ids=["shown", "special"])
def test_a_thought_is_read_from_the_tokens_whether_the_text_shows_its_marks_or_not(make):
    tokenizer = make()
    opening, closing = ("<think>", "</think>") if make is qwen_tokenizer else ("[THINK]", "[/THINK]")
    assert read(tokenizer, f"{opening}\nThe sum.\n{closing}\n\nIt is 3.") == ("The sum.", "It is 3.")
    assert read(tokenizer, f"\n {opening}Hmm{closing}3") == ("Hmm", "3")  # whitespace before the mark
    assert read(tokenizer, f"{opening}{closing}3") == (None, "3")  # an empty thought is none
    assert read(tokenizer, f"{opening}Still thinking") == ("Still thinking", "")  # it ended inside its thought

    def shown(text: str) -> str:
        return tokenizer.decode(ids(tokenizer, text), skip_special_tokens=True)

    assert read(tokenizer, f"It is 3. {opening}x{closing}") == (None, shown(f"It is 3. {opening}x{closing}"))
    assert read(tokenizer, f"{opening}a{closing}b{closing}c") == ("a", shown(f"b{closing}c"))  # the first closes
    prompted = f"<|im_start|>assistant\n{opening}\n"  # the prompt opened it (Qwen3.5, DeepSeek-R1)
    assert read(tokenizer, f"The sum.\n{closing}\n\nIt is 3.", prompted) == ("The sum.", "It is 3.")
    assert read(tokenizer, "The sum, still", prompted) == ("The sum, still", "")
    closed = f"{opening}\n\n{closing}\n\n"  # Qwen3 with enable_thinking false: the prompt closed it
    assert read(tokenizer, "It is 3.", closed) == (None, "It is 3.")


def test_the_thought_counts_its_tokens_marks_included():
    tokenizer = qwen_tokenizer()
    marks, new = thought_marks(tokenizer), ids(tokenizer, "<think>ab</think>cd")
    thought = thought_in(tokenizer, marks, new, opened=False)
    assert thought == Thought(7, 9, 17, 4) and split("<think>ab</think>cd", thought) == ("ab", "cd")
    assert thought_in(tokenizer, marks, new[:3], opened=False) == Thought(7, 9, 9, 3)


def test_a_watch_follows_the_answer_token_by_token_as_the_whole_reads_it():
    for make in (qwen_tokenizer, mistral_tokenizer):
        tokenizer = make()
        opening, closing = ("<think>", "</think>") if make is qwen_tokenizer else ("[THINK]", "[/THINK]")
        marks = thought_marks(tokenizer)
        for prompt, answer in (("Hi", f" \n{opening}\nab c\n{closing}\n\nde"), ("Hi", " Hello"),
                               (f"Hi{opening}\n", f"ab{closing}c"), ("Hi", f"{opening}never closed")):  # fmt: skip
            watch, new = ThoughtWatch(tokenizer, marks, ids(tokenizer, prompt)), ids(tokenizer, answer)
            for k, token in enumerate(new):
                watch.push([token])
                text = tokenizer.decode(new[: k + 1], skip_special_tokens=True)
                whole = thought_in(tokenizer, marks, new[: k + 1], opened_by(tokenizer, marks, ids(tokenizer, prompt)))
                blank = prompt == "Hi" and marks.opening not in new[: k + 1] and not text.strip()
                assert watch.undecided == blank, (answer, k)
                if not watch.undecided:
                    assert watch.thought(len(text)) == whole, (answer, k)


def streamed(tokenizer, answer: str, prompt: str = "Hi", stops=(), tools=None) -> tuple[str, str, list]:
    """(reasoning, content, calls) a chat stream sends for `answer`, put a token at a time."""
    marks = thought_marks(tokenizer)
    stream = lambda loop: TokenStream(tokenizer, loop, list(stops), tools=tools, thoughts=marks)  # noqa: E731
    items = queued(stream, ids(tokenizer, prompt), ids(tokenizer, answer))
    reasoning = "".join(extra.text for _, extra in items if isinstance(extra, Reasoning))
    content = content_of(items)
    assert sum(isinstance(extra, Reasoning) for _, extra in items) > 1 or len(reasoning) < 3  # piece by piece
    calls = list(sent_calls(items))
    assert sum(1 for _, extra in items if isinstance(extra, CallPart)) > len(calls) or not calls  # as written
    return reasoning, content, calls


def test_a_chat_stream_sends_the_thought_as_reasoning_and_the_rest_as_content():
    tokenizer = qwen_tokenizer()
    assert streamed(tokenizer, "<think>\nThe sum.\n</think>\n\nIt is 3.")[:2] == ("The sum.", "It is 3.")
    assert streamed(tokenizer, "\n It is 3.")[:2] == ("", "\n It is 3.")  # no thought: the text as it is
    assert streamed(tokenizer, "ab</think>c", prompt="Hi<think>\n")[:2] == ("ab", "c")
    assert streamed(tokenizer, "<think>ab\n\ncd</think>ef", stops=["\n\n"])[:2] == ("ab", "")  # a stop inside
    assert streamed(tokenizer, "<think>ab</think>cd\n\nef", stops=["\n\n"])[:2] == ("ab", "cd")
    call = ToolCall("add", '{"a": 1}')
    assert streamed(tokenizer, f"<think>Add.</think>\n{ADD}", tools=frozenset({"add"})) == ("Add.", "", [call])
    spaced = " " * 14 + f"<think>Add.</think>\n\n  {ADD}"  # whitespace before the thought, then before the call
    assert streamed(tokenizer, spaced, tools=frozenset({"add"})) == ("Add.", "", [call])
    inside = f"<think>{ADD}</think>No."  # a call inside the thought is thinking, not a call
    assert streamed(tokenizer, inside, tools=frozenset({"add"})) == (ADD, "No.", [])


def test_a_result_shows_its_thought_apart_and_reads_its_calls_after_it():
    tokenizer = qwen_tokenizer()
    text = f"<think>Add.</think>\n{ADD}"
    new = ids(tokenizer, text)
    thought = thought_in(tokenizer, thought_marks(tokenizer), new, opened=False)
    stats = GenerationStats(forwards=1, new_tokens=len(new))
    result = GenerationResult(torch.tensor([[0, *new]]), 1, text, stats, ["model"] * len(new),
                              tool_calls=(ToolCall("add", '{"a": 1}'),), thought=thought)  # fmt: skip
    assert (result.reasoning, result.content) == ("Add.", None)
    free = GenerationResult(torch.tensor([[0, *new]]), 1, text, stats, ["model"] * len(new), thought=thought)
    assert (free.reasoning, free.content) == ("Add.", ADD)
    cut = GenerationResult(torch.tensor([[0, *new]]), 1, text, stats, ["model"] * len(new), stop_at=9,
                           thought=thought)  # fmt: skip
    assert (cut.reasoning, cut.content) == ("Ad", "")


def test_a_json_answer_may_follow_a_thought_and_closes_one_its_prompt_opened():
    """`response_format` holds the answer after the thought (as vLLM does with a reasoning parser), not the thought:
    JSON at once or after a free thought; where the prompt opened the thought, it is closed before the JSON. A
    tokenizer without marks gets JSON from the first token, as before."""
    from forerun.structured import Grammars

    def accepts(tokenizer, text: str, prompt: str) -> bool:
        grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
        prompt_ids = ids(tokenizer, prompt)
        matcher = grammars.constraint({"type": "json_object"}, len(prompt_ids), ends, prompt_ids).fresh()
        return matcher.consume_tokens(ids(tokenizer, text)) and matcher.is_accepting()

    tokenizer, plain = qwen_tokenizer(), byte_tokenizer()
    ends = frozenset({tokenizer.eos_token_id})
    answer = '{"a": 1}'
    assert accepts(tokenizer, answer, "Hi") and accepts(
        tokenizer, f'<think>\nIt is {{"a": 1}}?\n</think>\n\n{answer}', "Hi"
    )
    assert not accepts(tokenizer, "<think>x</think>not JSON", "Hi") and not accepts(tokenizer, "<think>x", "Hi")
    assert accepts(tokenizer, f"x</think>\n{answer}", "Hi<think>\n") and not accepts(tokenizer, answer, "Hi<think>\n")
    assert accepts(plain, answer, "Hi") and not accepts(plain, f"<think>x</think>{answer}", "Hi")
