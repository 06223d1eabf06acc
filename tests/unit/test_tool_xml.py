"""Calls as Qwen3.5's template teaches them: XML in `<tool_call>` blocks (`forerun.tool_xml`): the template known by
sight, a call read back with its values typed by the function's schema, a required call held to that XML."""

from __future__ import annotations

import pytest

from forerun.structured import Grammars
from forerun.tool_calls import ToolCall, read_calls
from forerun.tool_grammar import calls_grammar
from forerun.tool_specs import calls_taught, check_tools, kind_of, parameters_of

from tiny_models import byte_tokenizer
from tool_templates import QWEN35_XML

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}, "exact": {"type": "boolean"},
    "unit": {"enum": ["kg", "lb"]}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = check_tools([ADD, NOW])


def xml(name: str, **arguments: str) -> str:
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = QWEN35_XML
    return tokenizer


def test_the_template_is_known_and_what_it_writes_of_a_call_reads_back_typed(tokenizer):
    assert kind_of([QWEN35_XML]) == "xml" and calls_taught(tokenizer).startswith("XML in <tool_call> blocks")
    made = [{"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 2.5, "note": "x < y\n42",
             "exact": True, "tags": ["p", "q"]}}}]  # fmt: skip
    messages = [{"role": "user", "content": "Add."}, {"role": "assistant", "content": "", "tool_calls": made}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False).split("<|im_start|>assistant\n")[1]
    answer = text.removesuffix("<|im_end|>\n")
    arguments = '{"a": 7, "b": 2.5, "note": "x < y\\n42", "exact": true, "tags": ["p", "q"]}'
    assert read_calls(answer, parameters_of(TOOLS)) == (None, (ToolCall("add", arguments),))
    # a string parameter keeps digits as text; untyped, JSON where it reads so
    assert read_calls(xml("add", a="1", b="2", note="42"), parameters_of(TOOLS))[1][0].arguments == (
        '{"a": 1, "b": 2, "note": "42"}')  # fmt: skip
    assert read_calls("Sure.\n" + xml("now"), {"now"}) == ("Sure.", (ToolCall("now", "{}"),))
    for broken in ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",
                   "<tool_call>\n<function=add>\nstray\n</function>\n</tool_call>"):  # fmt: skip
        assert read_calls(broken, parameters_of(TOOLS)) == (broken, ())


def test_a_required_call_is_held_to_the_xml_and_each_parameters_type(tokenizer):
    from llguidance import LLMatcher

    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    assert form.kind == "xml"

    def accepts(text: str, name: str | None = None, parallel: bool = True, lazy: bool = False) -> bool:
        grammar = LLMatcher.grammar_from_lark(calls_grammar(TOOLS, name, parallel, form, lazy))
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    good = xml("add", a="1", b="2.5", note="a </parameter b\nc", exact="true", unit="kg", tags='["x"]')
    assert accepts(good) and accepts(xml("add", a="-3", b="0")) and accepts(xml("now"), "now")
    assert accepts(good + "\n" + xml("now")) and not accepts(good + "\n" + xml("now"), parallel=False)
    for text in (xml("add", a="1.5", b="2"), xml("add", b="2"), xml("add", b="2", a="1"), xml("add", a="1", b="x"),
                 xml("add", a="1", b="2", unit="g"), xml("add", a="1", b="2", exact="yes"), xml("sub", a="1"),
                 '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Sure. " + xml("now")):  # fmt: skip
        assert not accepts(text), text
    assert accepts("It is 3.", lazy=True) and accepts("Let me add.\n" + good, lazy=True)
    assert not accepts("Let me add.\n" + xml("add", a="x", b="2"), lazy=True)


def test_under_strict_a_function_not_strict_takes_any_parameters_and_a_strict_one_its_own(tokenizer):
    from llguidance import LLMatcher

    from forerun.tool_specs import strictly_held

    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    strict = check_tools([{"type": "function", "function": {**ADD["function"], "strict": True}}, NOW])
    lark = calls_grammar(strictly_held(strict), None, True, grammars.call_form(), lazy=True)

    def accepts(text: str) -> bool:
        matcher = LLMatcher(grammars.tokens(), LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(xml("now", anything="goes\nhere", more="1")) and accepts(xml("add", a="1", b="2"))
    assert not accepts(xml("add", a="x", b="2")) and not accepts(xml("add", b="2"))


def test_where_the_prompt_opens_a_thought_the_answer_closes_it_before_its_calls():
    """Qwen3.5's generation prompt ends in `<think>`: a required call follows the rest of the thought and its
    `</think>` (a call inside the thought is none), and under strict the free answer may close its thought too (it
    was masked out of free text) or think to its end."""
    from llguidance import LLMatcher

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # tokens of their own, as Qwen's
    ending = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    assert ending in QWEN35_XML
    tokenizer.chat_template = QWEN35_XML.replace(ending, ending.replace("assistant\n", "assistant\n<think>\n"))
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    assert form.thinks and form.opened

    def accepts(text: str, lazy: bool = False) -> bool:
        grammar = LLMatcher.grammar_from_lark(calls_grammar(TOOLS, None, True, form, lazy))
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    call = xml("now")
    assert accepts("The clock.\n</think>\n\n" + call) and accepts("</think>" + call)
    assert not accepts(call) and not accepts("<think>Again.</think>" + call) and not accepts("The clock." + call)
    assert accepts("Easy.\n</think>\n\nIt is 3.", lazy=True) and accepts("Easy.</think>\n\n" + call, lazy=True)
    assert accepts("Still thinking, never done", lazy=True)
    assert not accepts("Easy.</think>\n\n" + xml("add", a="x", b="1"), lazy=True)
    plain = byte_tokenizer()
    plain.add_tokens(["<think>", "</think>"])
    plain.chat_template = QWEN35_XML
    assert not Grammars(plain, len(plain), plain.eos_token_id).call_form().opened


def test_a_prompt_whose_template_closed_the_thought_takes_its_call_at_once():
    """Qwen3.5's template opens the thought unless a request's `enable_thinking` is false (then the generation
    prompt closes it empty): a required call's grammar reads which from the request's own prompt, so with the
    thought off the call comes at once (a `</think>` demanded again would have forced a second close)."""
    from forerun.tool_specs import held_calls

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    ending = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    toggled = ("{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- if enable_thinking is defined and "
               "not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- else -%}{{- '<think>\n' -}}{%- endif -%}"
               "{%- endif -%}")  # fmt: skip
    tokenizer.chat_template = QWEN35_XML.replace(ending, toggled)
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    assert grammars.call_form().opened  # by default the prompt opens the thought
    held, ends = held_calls(TOOLS, "required", True), frozenset({tokenizer.eos_token_id})
    call = tokenizer.encode(xml("now"), add_special_tokens=False)
    for kwargs, at_once in (({}, False), ({"enable_thinking": False}, True)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Time?"}], add_generation_prompt=True,
                                               **kwargs)["input_ids"]  # fmt: skip
        matcher = grammars.constraint(held, len(prompt), ends, prompt).fresh()
        assert (matcher.consume_tokens(call) and matcher.is_accepting()) == at_once, kwargs


def test_a_stream_sends_an_xml_call_as_it_is_written(tokenizer):
    """A server stream (`TokenStream`, the tools' schemas given as a chat request gives them): the words before the
    call as content, then the call's name, its string value in pieces as its bytes come, its number once read;
    joined, the arguments `read_calls` reads from the whole answer."""
    from streams import content_of, queued, sent_calls

    from forerun.server.stream import TokenStream
    from forerun.tool_stream import CallPart

    schemas = parameters_of(TOOLS)
    answer = "Checking.\n" + xml("add", a="3", b="2.5", note='Saint-Étienne, "the green"\nand more', tags='["x"]')
    ids = tokenizer.encode(answer, add_special_tokens=False)
    items = queued(lambda loop: TokenStream(tokenizer, loop, [], tools=schemas), [1], ids)
    assert content_of(items) == "Checking.\n" and sent_calls(items) == read_calls(answer, schemas)[1]
    assert sum(isinstance(extra, CallPart) for _, extra in items) > 10
