"""LFM2's calls (`forerun.tool_pythonic`): a Python list of calls between special tokens, read with Python's parser
(literals only), written back into an assistant's content for the conversation, and a required call's grammar."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from forerun.prompts import ids_of_text
from forerun.structured import Grammars
from forerun.tool_calls import ToolCall, read_calls
from forerun.tool_grammar import calls_grammar
from forerun.tool_pythonic import into_content, list_end, pythonic_calls, written
from forerun.tool_specs import call_mark, calls_taught, check_tools, kind_of, takes_tools, templates

from tiny_models import byte_tokenizer
from tool_templates import LFM2_MARKS, LFM2_PYTHONIC

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "number"}, "unit": {"enum": ["m", "s"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}, "exact": {"type": "boolean"}},
    "required": ["a"]}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = check_tools([ADD, NOW])
NAMES = {"add", "now"}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": LFM2_MARKS})
    tokenizer.chat_template = LFM2_PYTHONIC
    return tokenizer


def test_calls_are_read_with_pythons_parser_and_only_literals_are_evaluated():
    assert pythonic_calls('[add(a=1, b=2.5, tags=["x", "y"], exact=True), now()]') == [
        ("add", {"a": 1, "b": 2.5, "tags": ["x", "y"], "exact": True}), ("now", {})]  # fmt: skip
    assert pythonic_calls("[add(a=(1, 2), b={'k': None})]") == [("add", {"a": [1, 2], "b": {"k": None}})]
    for text in ("[add(1)]", "[add(a=b)]", "[add(a=now())]", "[add(**{'a': 1})]", "[os.system(a=1)]", "add(a=1)",
                 "[]", "[add(a={1, 2})]", "[add(a=b'x')]", "[add(a=1j)]", "[add(a=1e999)]", "[add(a={1: 2})]",
                 "[add(a=1, a=2)]", "[add(a=__import__('os'))]", "[" * 5000 + "]" * 5000,
                 "[add(a=" + "1" * 200_000 + ")]", "[add(a='unclosed)]"):  # fmt: skip
        assert pythonic_calls(text) is None, text[:40]


def test_the_list_ends_at_its_own_bracket_strings_skipped():
    assert list_end('[add(a="])")] Done.') == 13
    assert list_end("[add(a='it\\'s ]')]x") == 18
    assert list_end("[add(a=[1, [2]])]") == 17
    assert list_end("[add(a=1)") is None and list_end("add(a=1)]") is None


def test_calls_are_written_back_as_the_model_writes_them():
    calls = [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "tags": ["x"], "exact": false}'}},
             {"function": {"name": "now", "arguments": {}}}]  # fmt: skip
    text = written(calls)
    assert text == '[add(a=1, tags=["x"], exact=False), now()]'
    assert pythonic_calls(text) == [("add", {"a": 1, "tags": ["x"], "exact": False}), ("now", {})]
    assert written([{"function": {"name": "f", "arguments": {"s": 'é "q"', "n": None, "o": {"k": 1.5}}}}]) == (
        '[f(s="é \\"q\\"", n=None, o={"k": 1.5})]')  # fmt: skip
    messages = [{"role": "user", "content": "Add."}, {"role": "assistant", "content": "Sure.", "tool_calls": calls},
                {"role": "tool", "content": "3"}]  # fmt: skip
    shown = into_content(messages)
    assert shown[1] == {"role": "assistant", "content": f"<|tool_call_start|>{text}<|tool_call_end|>Sure."}
    assert shown[0] == messages[0] and shown[2] == messages[2] and "tool_calls" in messages[1]  # not changed


def test_an_answer_reads_as_its_calls_and_the_words_around_them():
    call = (ToolCall("add", '{"a": 1}'),)
    assert read_calls("[add(a=1)]Adding them.", NAMES, 0) == ("Adding them.", call)
    assert read_calls("Sure. [add(a=1)] Done.", NAMES, 6) == ("Sure. Done.", call)
    assert read_calls("[add(a=1)]", NAMES) == (None, call)  # the marks dropped or never written: whole answer
    assert read_calls("[add(a=1)] and words", NAMES) == ("[add(a=1)] and words", ())  # unmarked words: an answer
    assert read_calls("[sub(a=1)]", NAMES, 0) == ("[sub(a=1)]", ())  # not an offered tool
    assert read_calls("[add(a=x)]", NAMES, 0) == ("[add(a=x)]", ())


def test_the_template_is_known_its_calls_marked_and_a_conversation_shows_them(tokenizer):
    assert kind_of(templates(tokenizer)) == "pythonic" and takes_tools(tokenizer)
    assert call_mark(tokenizer) == tokenizer.convert_tokens_to_ids("<|tool_call_start|>")
    assert "Python list of calls" in calls_taught(tokenizer)
    made = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    messages = [{"role": "user", "content": "Add 1."}, {"role": "assistant", "content": None, "tool_calls": made},
                {"role": "tool", "content": "1"}]  # fmt: skip

    class Model:
        class config:
            max_position_embeddings = 4096

    text = tokenizer.decode(ids_of_text(Model, tokenizer, messages, True, TOOLS)[0])
    assert "<|im_start|>assistant\n<|tool_call_start|>[add(a=1)]<|tool_call_end|><|im_end|>" in text
    assert "List of tools: <|tool_list_start|>[" in text and json.dumps(NOW) in text
    assert "<|tool_response_start|>1<|tool_response_end|>" in text


@pytest.mark.parametrize(
    ("text", "held"),
    [
        ("[add(a=1, b=2.5)]", True),
        ('[add(a=7, unit="s", tags=["ab"], exact=True), now()]', True),
        ('[now(anything="goes", n=[1, {"k": None}])]', True),
        ("[add(a=100)]", False),  # beyond its maximum
        ('[add(a="1")]', False),  # a string for an integer
        ('[add(a=1, unit="h")]', False),  # not in its enum
        ('[add(a=1, tags=["abcd"])]', False),  # an item longer than its maxLength
        ("[add(b=1)]", False),  # its required a left out
        ("[add(b=1, a=1)]", False),  # out of the schema's order
        ("[add(a=1, a=2)]", False),  # twice
        ("[add(a=1, c=2)]", False),  # no such parameter
        ("[sub(a=1)]", False),
        ("[add(a=1, exact=true)]", False),  # JSON's true is not Python's
    ],
)
def test_a_required_call_is_held_to_the_functions_and_their_parameters(tokenizer, text, held):
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    grammar = LLMatcher.grammar_from_lark(calls_grammar(TOOLS, None, True, form))
    matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    marked = f"<|tool_call_start|>{text}<|tool_call_end|>"
    ok = matcher.consume_tokens(tokenizer.encode(marked, add_special_tokens=False)) and matcher.is_accepting()
    assert ok == held, text
    if held:
        assert pythonic_calls(text) is not None  # what the grammar holds reads as calls


def test_a_stream_sends_the_words_around_the_calls_and_the_calls_whole(tokenizer):
    """The calls come whole at the end (their marks decoded out); words before them stream as they come, and the
    words after them (LFM2 says what it is doing) come as content before the calls, as the whole answer's content
    reads."""
    from streams import content_of, queued, sent_calls

    from forerun.server.stream import TokenStream

    mark = call_mark(tokenizer)
    for answer, words in (("<|tool_call_start|>[add(a=1)]<|tool_call_end|>Adding them.", "Adding them."),
                          ("Sure. <|tool_call_start|>[add(a=1)]<|tool_call_end|> Done.", "Sure. Done.")):  # fmt: skip
        ids = tokenizer.encode(answer, add_special_tokens=False)
        items = queued(lambda loop: TokenStream(tokenizer, loop, [], tools=frozenset(NAMES), mark=mark), [1], ids)
        assert content_of(items) == words and sent_calls(items) == (ToolCall("add", '{"a": 1}'),)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert read_calls(text, NAMES, text.index("["))[0] == words
