"""Calls taught after a special token of the tokenizer's own (Mistral's `[TOOL_CALLS] [...]`, a
`<TOOLCALL>[...]</TOOLCALL>`, Mistral's newer `[TOOL_CALLS]name[ARGS]{...}`): read off what the template renders of
a probe call (`forerun.tool_probe`), a required or strict call held to that form, the answer read back once the
marks are decoded away; templates whose calls are neither refused."""

from __future__ import annotations

import json

import pytest
from streams import content_of, queued, sent_calls

from forerun.structured import Grammars
from forerun.tool_calls import ToolCall, read_calls
from forerun.tool_grammar import calls_grammar
from forerun.tool_probe import probed
from forerun.tool_specs import calls_taught, check_tools, short_call_ids, takes_tools

from tiny_models import byte_tokenizer
from tool_templates import GRANITE_TOOLS, LLAMA3_JSON, MISTRAL_NAMED, MISTRAL_TOOLS, TOOLCALL_MARKS

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now"}}


def tokenizer_of(template: str, *marks: str):
    """A byte tokenizer with `template`, `marks` special tokens of its own."""
    tokenizer = byte_tokenizer()
    if marks:
        tokenizer.add_special_tokens({"additional_special_tokens": list(marks)})
    tokenizer.chat_template = template
    return tokenizer


def test_a_mistral_template_is_read_off_its_probe_call():
    """Mistral's: `[TOOL_CALLS]`, a space, one list, no closing mark, only 9-character ids; a `<TOOLCALL>` pair of
    tokens of their own: one list between them, any id; Granite's `<|tool_call|>` and a list written back indented;
    Mistral's newer name between `[TOOL_CALLS]` and `[ARGS]`."""
    written = probed(tokenizer_of(MISTRAL_TOOLS, "[TOOL_CALLS]"))
    assert (written.open, written.lead, written.close, written.listed, written.short_ids) == (
        "[TOOL_CALLS]", " ", "", True, True)  # fmt: skip
    written = probed(tokenizer_of(TOOLCALL_MARKS, "<TOOLCALL>", "</TOOLCALL>"))
    assert (written.open, written.lead, written.close, written.trail, written.listed, written.short_ids) == (
        "<TOOLCALL>", "", "</TOOLCALL>", "", True, False)  # fmt: skip
    for tokenizer in (tokenizer_of(MISTRAL_TOOLS, "[TOOL_CALLS]"), tokenizer_of(TOOLCALL_MARKS, "<TOOLCALL>",
                                                                                "</TOOLCALL>")):  # fmt: skip
        assert takes_tools(tokenizer)
    written = probed(tokenizer_of(GRANITE_TOOLS, "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"))
    assert (written.open, written.lead, written.close, written.listed) == ("<|tool_call|>", "", "", True)  # indented
    written = probed(tokenizer_of(MISTRAL_NAMED, "[TOOL_CALLS]", "[ARGS]"))
    assert (written.open, written.between, written.close, written.listed, written.short_ids) == (
        "[TOOL_CALLS]", "[ARGS]", "", False, False)  # fmt: skip
    assert calls_taught(tokenizer_of(MISTRAL_NAMED, "[TOOL_CALLS]", "[ARGS]")).startswith("[TOOL_CALLS]name[ARGS]")
    assert calls_taught(tokenizer_of(TOOLCALL_MARKS, "<TOOLCALL>", "</TOOLCALL>")).startswith(
        "a JSON list after <TOOLCALL> ... </TOOLCALL>")  # fmt: skip
    assert calls_taught(tokenizer_of(MISTRAL_TOOLS)) == "none forerun reads (tools are refused)"
    assert short_call_ids(tokenizer_of(MISTRAL_TOOLS, "[TOOL_CALLS]"))
    assert not short_call_ids(tokenizer_of(LLAMA3_JSON)) and not short_call_ids(tokenizer_of(TOOLCALL_MARKS))


PYTHONIC = (
    "{%- for m in messages -%}{%- if m.tool_calls -%}{{ '<|tool_call_start|>[' }}"
    "{%- for c in m.tool_calls %}{{ c.function.name }}(probe_value={{ c.function.arguments.probe_value }}){% endfor -%}"
    "{{ ']<|tool_call_end|>' }}{%- else -%}{{ m.role + ': ' + (m.content or '') + '\n' }}{%- endif -%}{%- endfor -%}"
)
NESTED = (
    "{%- for m in messages -%}{%- if m.tool_calls -%}{{ '[TOOL_CALLS]' + (m.tool_calls | tojson) + '</s>' }}"
    "{%- else -%}{{ (m.content or '') + '</s>' }}{%- endif -%}{%- endfor -%}"
)
REFUSING = "{{ raise_exception('no tools here') }}"
SILENT = "{%- for m in messages -%}{{ (m.content or '') + '</s>' }}{%- endfor -%}"
IN_TOOLS_ONLY = "{{ tools | tojson }}{%- for m in messages -%}{{ (m.content or '') + '</s>' }}{%- endfor -%}"


@pytest.mark.parametrize(
    "template, marks",
    [
        (MISTRAL_TOOLS, ()),  # its mark is text here: the decoded answer would keep it
        (MISTRAL_NAMED, ("[TOOL_CALLS]",)),  # [ARGS] is text here
        (PYTHONIC, ("<|tool_call_start|>", "<|tool_call_end|>")),  # not JSON
        (NESTED, ("[TOOL_CALLS]",)),  # OpenAI's nested objects written back
        (REFUSING, ("[TOOL_CALLS]",)),
        (SILENT, ("[TOOL_CALLS]",)),  # writes no calls at all
        (IN_TOOLS_ONLY, ("[TOOL_CALLS]",)),  # the tools' JSON is not a call
        ("", ()),
    ],
    ids=["text mark", "text mark between", "pythonic", "nested", "refusing", "silent", "tools only", "none"],
)
def test_templates_whose_calls_are_not_json_after_a_special_token_are_not_taken(template, marks):
    assert probed(tokenizer_of(template, *marks)) is None and not takes_tools(tokenizer_of(template, *marks))


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


@pytest.mark.parametrize("kind", ["mistral", "toolcall"])
def test_a_required_call_is_held_to_the_probed_form_and_read_back_without_its_marks(kind):
    """Required: the mark (its own token), the list, the close; several where parallel; text first, another form
    or a call against the schema do not pass. The answer decoded (the marks dropped) reads as the calls."""
    from llguidance import LLMatcher

    mistral = kind == "mistral"
    tokenizer = (tokenizer_of(MISTRAL_TOOLS, "[TOOL_CALLS]") if mistral else
                 tokenizer_of(TOOLCALL_MARKS, "<TOOLCALL>", "</TOOLCALL>"))  # fmt: skip
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    tools = check_tools([ADD, NOW])

    def written(*calls: str) -> str:
        listed = f"[{', '.join(calls)}]"
        return f"[TOOL_CALLS] {listed}" if mistral else f"<TOOLCALL>{listed}</TOOLCALL>"

    def accepts(text: str, parallel: bool = True, lazy: bool = False) -> bool:
        grammar = LLMatcher.grammar_from_lark(calls_grammar(tools, None, parallel, form, lazy))
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    add, now = call("add", a=1, b=2), call("now")
    assert accepts(written(add)) and accepts(written(add, now)) and not accepts(written(add, now), parallel=False)
    for text in (written(call("add", a=1, b="2")), "Sure. " + written(add), f"<tool_call>\n{add}\n</tool_call>",
                 f"[{add}]", written(add).replace("[{", " [{", 1)):  # fmt: skip
        assert not accepts(text), text
    ids = tokenizer.encode(written(add, now), add_special_tokens=False)
    assert ids[0] == len(tokenizer) - (1 if mistral else 2)  # the mark is its own token, not its letters
    assert read_calls(tokenizer.decode(ids, skip_special_tokens=True), {"add", "now"}) == (
        None, (ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}")))  # fmt: skip
    # strict under auto: free text, then held from the mark on
    assert accepts("It is 3.", lazy=True) and accepts(written(add), lazy=True)
    assert not accepts(written(call("add", a=1, b="2")), lazy=True)


def test_named_calls_are_held_to_their_marks_and_each_functions_arguments_and_read_back():
    """Mistral's newer form: each call its own `[TOOL_CALLS]`, the name, `[ARGS]`, the arguments held to that
    function's parameters; the decoded answer (names each before their arguments) reads as the calls, and a stream
    holds back an answer that may still become one."""
    from llguidance import LLMatcher

    from forerun.tool_calls import before_calls

    tokenizer = tokenizer_of(MISTRAL_NAMED, "[TOOL_CALLS]", "[ARGS]")
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    assert form.kind == "named"
    tools = check_tools([ADD, NOW])

    def accepts(text: str, name: str | None = None, parallel: bool = True, lazy: bool = False) -> bool:
        grammar = LLMatcher.grammar_from_lark(calls_grammar(tools, name, parallel, form, lazy))
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    add, now = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "[TOOL_CALLS]now[ARGS]{}"
    assert accepts(add) and accepts(now) and accepts(add + now) and accepts(add, "add")
    assert not accepts(add + now, parallel=False) and not accepts(now, "add")
    for text in ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": "2"}', '[TOOL_CALLS]add[ARGS]{"a": 1}', "Sure. " + add,
                 '[TOOL_CALLS]sub[ARGS]{"a": 1, "b": 2}', 'add[ARGS]{"a": 1, "b": 2}',
                 '[TOOL_CALLS] add[ARGS]{"a": 1, "b": 2}', call("add", a=1, b=2)):  # fmt: skip
        assert not accepts(text), text
    ids = tokenizer.encode(add + now, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == 'add{"a": 1, "b": 2}now{}'
    assert read_calls(decoded, {"add", "now"}) == (None, (ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}")))
    assert read_calls(decoded, {"add"}) == (decoded, ())  # a name not offered: the text, no call
    assert read_calls('add{"a": 1} and more', {"add"})[1] == ()
    assert before_calls("ad", True, {"add"}) == 0 and before_calls('add{"a"', True, {"add"}) == 0
    assert before_calls("adding", True, {"add"}) == 6
    # strict under auto: free text, then held from the mark on
    assert accepts("It is 3.", lazy=True) and accepts(add + now, lazy=True)
    assert not accepts('[TOOL_CALLS]add[ARGS]{"a": "1", "b": 2}', lazy=True)


def test_a_thought_or_words_before_mistrals_mark_are_content_and_the_calls_after_it_are_read():
    """The decoded answer drops `[TOOL_CALLS]` (and a Magistral's `[THINK]` ... `[/THINK]`): where the answer holds
    the mark after words, the text before it is content and what follows it is read as calls, by the result and by
    a stream (which never sends the calls' text as content); a required call may follow a thought in those marks."""

    import torch
    from llguidance import LLMatcher

    from forerun import GenerationResult
    from forerun.server.stream import TokenStream
    from forerun.stats import GenerationStats
    from forerun.tool_calls import marked_at
    from forerun.tool_specs import call_mark
    from forerun.tool_stream import CallPart

    tokenizer = tokenizer_of(MISTRAL_NAMED, "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")
    mark, names = call_mark(tokenizer), {"add", "now"}
    assert mark == tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") and call_mark(tokenizer_of(LLAMA3_JSON)) is None
    answer = '[THINK]Add them.[/THINK]Let me add.[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
    ids = tokenizer.encode(answer, add_special_tokens=False)
    text, at = tokenizer.decode(ids, skip_special_tokens=True), marked_at(tokenizer, ids, mark)
    assert text == 'Add them.Let me add.add{"a": 1, "b": 2}' and text[:at] == "Add them.Let me add."
    calls = (ToolCall("add", '{"a": 1, "b": 2}'),)
    assert read_calls(text, names, at) == ("Add them.Let me add.", calls)
    assert read_calls(text, names) == (text, ())  # without the mark's place: words, then what reads as words
    assert read_calls(text[:at] + "not a call", names, at)[1] == ()
    stats = GenerationStats(forwards=1, new_tokens=len(ids))
    result = GenerationResult(torch.tensor([[0, *ids]]), 1, text, stats, ["model"] * len(ids), tool_calls=calls,
                              calls_at=at)  # fmt: skip
    assert result.content == "Add them.Let me add."

    items = queued(lambda loop: TokenStream(tokenizer, loop, [], tools=frozenset(names), mark=mark), [1, 2], ids)
    assert content_of(items) == "Add them.Let me add."
    assert sent_calls(items) == calls and len(items) > 2  # the words streamed as they came
    assert sum(isinstance(extra, CallPart) for _, extra in items) > 3  # the call as it was written, a token a time

    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    assert form.thinks
    grammar = LLMatcher.grammar_from_lark(calls_grammar(check_tools([ADD, NOW]), None, True, form))
    for text, held in (('[THINK]Add them.[/THINK][TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', True),
                       ('Add them.[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', False)):  # fmt: skip
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
        assert ok == held, text
