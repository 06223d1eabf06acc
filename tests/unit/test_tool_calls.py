"""Tools without a model: their checks, the calls read out of a text, the grammar a required call is held to, the
shipped chat template, and a stream that holds a call back until the answer ends."""

from __future__ import annotations

import json

import pytest
import torch
from streams import content_of, queued, sent_calls

from forerun import GenerationRequest, GenerationResult
from forerun.server.stream import TokenStream
from forerun.structured import Grammars
from forerun.tool_calls import ToolCall, before_calls, read_calls
from forerun.tool_grammar import calls_grammar
from forerun.tool_specs import (
    MAX_TOOLS,
    CallForm,
    call_form,
    check_tool_choice,
    check_tools,
    shipped_template,
    strictly_held,
    takes_tools,
)
from forerun.tool_stream import CallPart

from tiny_models import byte_tokenizer
from tool_templates import LLAMA3_JSON

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}  # fmt: skip


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Paris is sunny.", "Paris is sunny.", ()),
        (f"<tool_call>\n{call('add', a=1, b=2)}\n</tool_call>", None, (ToolCall("add", '{"a": 1, "b": 2}'),)),
        (  # SmolLM2's form: a list in one block; then a second block, Hermes' form
            f"Looking.\n<tool_call>[{call('add', a=1, b=2)}, {call('now')}]</tool_call>\n"
            f"<tool_call>{call('get_weather', city='Oslo')}</tool_call>",
            "Looking.",
            (ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}"), ToolCall("get_weather", '{"city": "Oslo"}')),
        ),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, (ToolCall("add", '{"a": 1}'),)),
        ('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>', None, (ToolCall("add", '{"a": 1}'),)),
        ("<tool_call>[]</tool_call> Nothing to call.", "Nothing to call.", ()),
        # not calls: the whole text is the answer, nothing lost
        ("Use <tool_call>like this</tool_call>.", "Use <tool_call>like this</tool_call>.", ()),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', ()),
        (
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
            (),
        ),
        # the answer's end cut the last block: the calls before it stand, the cut block stays in the content
        (f"<tool_call>{call('now')}</tool_call>\n<tool_call>" + '{"na', '<tool_call>{"na', (ToolCall("now", "{}"),)),
        ("<tool_call>{", "<tool_call>{", ()),
        *[(text, text, ()) for text in ["<tool_call>" + "[" * 5000 + "</tool_call>", "[" * 5000]],  # no recursion error
        *[(text, text, ()) for text in ['<tool_call>{"name": "a", "arguments": "' + "[" * 5000 + '"}</tool_call>']],
    ],
)
def test_calls_are_read_out_of_the_text_and_nothing_else_is_lost(text, content, calls):
    assert read_calls(text) == (content, calls)


def test_a_stream_holds_back_what_may_be_a_call():
    assert [before_calls(t) for t in ("", "<", "Hi <tool", "Hi <tool_call>", "Hi <tool_call>{", "a < b")] == [
        0, 0, 3, 3, 3, 5]  # fmt: skip
    assert ToolCall("add", "{}").as_openai("call_1") == {
        "id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}  # fmt: skip
    assert ToolCall("add", "{}").as_openai()["id"].startswith("call_")


@pytest.mark.parametrize(
    ("tools", "fragment"),
    [
        ({"type": "function"}, "must be a list"),
        ([{"type": "function"}] * (MAX_TOOLS + 1), f"at most {MAX_TOOLS}"),
        ([{"type": "retrieval"}], "tools[0] must be"),
        ([{"type": "function", "function": {"name": "a"}, "x": 1}], "tools[0] must be"),
        ([{"type": "function", "function": {"name": "a", "code": "rm -rf"}}], "tools[0].function must be an object"),
        ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "letters, digits"),
        ([WEATHER, WEATHER], "names two tools"),
        ([{"type": "function", "function": {"name": "required"}}], "one of tool_choice's words"),
        ([{"type": "function", "function": {"name": "a", "parameters": "{}"}}], "JSON schema object"),
        ([{"type": "function", "function": {"name": "a", "description": 3}}], "description must be a string"),
        ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], "strict must be true or false"),
        ([{"type": "function", "function": {"name": "a", "description": "a\ud800"}}], "lone surrogate"),
        ([{"type": "function", "function": {"name": "a", "parameters": {"default": float("nan")}}}], "plain JSON"),
    ],
)
def test_bad_tools_are_refused_naming_the_one_at_fault(tools, fragment):
    with pytest.raises(ValueError, match="tools") as caught:
        check_tools(tools)
    assert fragment in str(caught.value)


def test_tools_nested_past_the_limit_are_refused_before_any_parser_sees_them():
    schema: dict = {"type": "integer"}
    for _ in range(70):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters nests more than 64"):
        check_tools([{"type": "function", "function": {"name": "deep", "parameters": schema}}])


def test_tool_choice_forms():
    tools = check_tools([WEATHER, ADD])
    named = {"type": "function", "function": {"name": "add"}}
    assert [check_tool_choice(c, tools) for c in (None, "auto", "none", "required", named)] == [
        "auto", "auto", "none", "required", "add"]  # fmt: skip
    assert check_tool_choice(None, ()) == "none" and check_tool_choice("none", ()) == "none"
    for choice, fragment in [
        ("any", "must be one of"),
        ({"type": "function", "function": {"name": "sub"}}, "not one of the tools"),
        ({"type": "function", "function": {"name": "auto"}}, "not one of the tools"),
        ({"type": "function", "name": "add"}, "must name a function"),
        (3, "must name a function"),
    ]:
        with pytest.raises(ValueError, match="tool_choice") as caught:
            check_tool_choice(choice, tools)
        assert fragment in str(caught.value)
    with pytest.raises(ValueError, match="tools and response_format cannot be used together"):
        GenerationRequest([{"role": "user", "content": "Hi"}], 8, tools=[ADD], response_format={"type": "json_object"})
    request = GenerationRequest([{"role": "user", "content": "Hi"}], 8, tools=[ADD], tool_choice="none")
    assert request.shown_tools is None and request.held_format is None and not request.processed
    request = GenerationRequest([{"role": "user", "content": "Hi"}], 8, tools=[ADD], tool_choice=named)
    assert request.tool_choice == "add" and request.held_format["name"] == "add" and request.processed


@pytest.fixture(scope="module")
def grammars():
    tokenizer = byte_tokenizer()
    return Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id), tokenizer


@pytest.mark.parametrize("listed", [False, True], ids=["a block each", "one list"])
def test_a_required_call_is_held_to_the_format_and_the_functions_schema(grammars, listed):
    """Only the functions' own calls, their arguments matching the schema, in the template's form, pass; text
    before them, another function, a wrong argument, a second call where one is asked for do not."""
    grammars, tokenizer = grammars
    tools = check_tools([WEATHER, ADD])

    def accepts(text: str, name: str | None, parallel: bool) -> bool:
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_lark(calls_grammar(tools, name, parallel, CallForm(listed)))
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    def written(*calls: str) -> str:
        return f"<tool_call>[{', '.join(calls)}]</tool_call>" if listed else "\n".join(
            f"<tool_call>\n{c}\n</tool_call>" for c in calls)  # fmt: skip

    weather, add = call("get_weather", city="Oslo"), call("add", a=1, b=2)
    assert accepts(written(weather), None, False) and accepts(written(add), "add", False)
    assert accepts(written(weather, add), None, True) and not accepts(written(weather, add), None, False)
    assert not accepts(written(weather), "add", False)  # another function than the one named
    assert not accepts(written(call("add", a=1, b="2")), None, True)  # an argument against the schema
    assert not accepts(written(call("get_weather", city="Oslo", unit="C")), None, True)
    assert not accepts(written(call("sub", a=1, b=2)), None, True)
    assert not accepts("Sure. " + written(add), None, True)
    assert read_calls(written(weather, add))[1] == (
        ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("add", '{"a": 1, "b": 2}'))  # fmt: skip


def test_the_shipped_template_shows_tools_calls_and_answers():
    """chatml-tools lists the tools in the system message (after the caller's own system text), writes an
    assistant's calls in the form it teaches (the one `read_calls` reads), and a tool's answer; without tools it is
    plain ChatML."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = shipped_template("chatml-tools")
    assert takes_tools(tokenizer) and call_form(tokenizer, lambda token: False) == CallForm(listed=True)
    assert not takes_tools(PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer))
    made = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": made},
        {"role": "tool", "content": '{"sky": "clear"}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and json.dumps(WEATHER) in text
    assert text.count("Be brief.") == 1 and text.endswith("<|im_start|>assistant\n")
    written = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert read_calls(written) == (None, (ToolCall("get_weather", '{"city": "Oslo"}'),))
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in text
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    with pytest.raises(ValueError, match="there are: chatml-tools"):
        shipped_template("llama3-tools")


def streamed(text: str, stops: list[str], pieces: int = 1) -> list:
    """The items a tools stream queues for `text` put `pieces` tokens at a time."""
    tokenizer = byte_tokenizer()
    answer = tokenizer.encode(text, add_special_tokens=False)
    return queued(lambda loop: TokenStream(tokenizer, loop, stops, tools=frozenset({"add", "now"})), [1, 2], answer,
                  pieces)  # fmt: skip


def test_a_tools_stream_sends_content_as_it_comes_and_calls_as_they_are_written():
    """Words before a block stream; a call in it goes out as it is written (its name, then its arguments in
    pieces); text that is not calls comes out whole at the end; bare calls come whole once read."""
    items = streamed(f"Let me look.\n<tool_call>{call('add', a=1, b=2)}</tool_call>", [])
    assert content_of(items) == "Let me look.\n" and len(items) > 2  # streamed piece by piece, up to the block
    assert sent_calls(items) == (ToolCall("add", '{"a": 1, "b": 2}'),)
    parts = [extra for _, extra in items if isinstance(extra, CallPart)]
    assert parts[0].name == "add" and len(parts) > 3  # the arguments a token at a time, as they were written
    listed = streamed(f"<tool_call>[{call('add', a=1)}, {call('now')}]</tool_call>", [])
    assert sent_calls(listed) == (ToolCall("add", '{"a": 1}'), ToolCall("now", "{}")) and content_of(listed) == ""
    plain = streamed("No <tool_call> here, a < b.", [])  # not calls: the held text comes out at the end, whole
    assert content_of(plain) == "No <tool_call> here, a < b." and sent_calls(plain) == ()
    stopped = streamed(f"Done.\n\n<tool_call>{call('now')}</tool_call>", ["\n\n"])  # a stop before the block
    assert content_of(stopped) == "Done." and sent_calls(stopped) == ()
    cut = streamed(f"<tool_call>{call('add', a=1)}</tool_call>\n<tool_call>{call('add', a=2)[:-4]}", [])
    assert sent_calls(cut) == (ToolCall("add", '{"a": 1}'), ToolCall("add", '{"a":')) and content_of(cut) == ""
    inside = streamed(f"<tool_call>{call('add', a='x STOP y')}</tool_call>", ["STOP"])  # a stop in the arguments
    assert content_of(inside) == "" and sent_calls(inside) == (ToolCall("add", '{"a": "x '),)
    bare = streamed(f" {call('add', a=1)}", [])  # the tags dropped: a call of an offered tool all the same
    assert [extra for _, extra in bare] == [CallPart(0, "add", '{"a": 1}', True)]
    json_answer = streamed('{"name": "Ada", "arguments": {}}', [])  # JSON, but no offered tool's call: content
    assert "".join(delta for delta, _ in json_answer) == '{"name": "Ada", "arguments": {}}' and len(json_answer) == 1
    fenced = streamed(f"```json\n{call('now')}\n```", [])
    assert sent_calls(fenced) == (ToolCall("now", "{}"),) and content_of(fenced) == ""
    code = streamed("```python\nprint(1)\n```", [])  # another fence: content as it comes
    assert "".join(delta for delta, _ in code) == "```python\nprint(1)\n```" and len(code) > 2


def test_an_answer_that_is_only_calls_of_offered_tools_is_read_without_its_tags():
    names = {"add", "now"}
    assert read_calls(f"\n{call('add', a=1)}\n", names) == (None, (ToolCall("add", '{"a": 1}'),))
    assert read_calls(f"```json\n{call('add', a=1)}\n```", names) == (None, (ToolCall("add", '{"a": 1}'),))
    assert read_calls(f"[{call('add', a=1)}, {call('now')}]", names)[1] == (
        ToolCall("add", '{"a": 1}'), ToolCall("now", "{}"))  # fmt: skip
    for text in (call("sub", a=1), f"Use {call('add', a=1)}", f"[{call('add', a=1)}, {call('rm')}]", "{}", "[]",
                 f"```python\n{call('add', a=1)}\n```", f"```json\n{call('add', a=1)}\n``` and more"):  # fmt: skip
        assert read_calls(text, names) == (text, ()), text
    assert read_calls(call("add", a=1)) == (call("add", a=1), ())  # no tools offered: text


def llama(name: str, **arguments) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def test_llama_calls_are_read_bare_one_or_several():
    """Llama 3's calls: a bare object whose arguments are its parameters; several apart by "; " or a new line
    (Llama 3.2 writes them so). Anything else after them, or a function not offered, leaves the text as content."""
    names = {"add", "now"}
    assert read_calls(llama("add", a=1), names) == (None, (ToolCall("add", '{"a": 1}'),))
    both = (ToolCall("add", '{"a": 1}'), ToolCall("now", "{}"))
    for apart in ("; ", ";", "\n", " ;\n "):
        assert read_calls(llama("add", a=1) + apart + llama("now"), names) == (None, both), apart
    for text in (llama("add", a=1) + "; and more", llama("add", a=1) + ";;" + llama("now"), llama("rm") + "; ",
                 llama("add", a=1) + "; " + llama("rm"), llama("add", a=1) + ' {"a": 1}'):  # fmt: skip
        assert read_calls(text, names) == (text, ()), text
    deep = '{"name": "add", "parameters": ' + "[" * 5000  # cut, and past json's recursion: text, no failure
    assert read_calls(deep, names) == (deep, ())


def test_a_llama_template_is_read_and_its_required_call_held_to_one_bare_object(grammars):
    """A template writing Llama 3's calls takes tools and holds a required call to one bare object, its arguments
    under "parameters" (never two: the template shows one call a message); what it writes of an assistant's call
    reads back as that call."""
    from llguidance import LLMatcher

    grammars, _ = grammars
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = LLAMA3_JSON
    form = call_form(tokenizer, lambda token: False)
    assert takes_tools(tokenizer) and form.kind == "json" and form.arguments == "parameters"
    tools = check_tools([WEATHER, ADD])

    def accepts(text: str, name: str | None) -> bool:
        grammar = LLMatcher.grammar_from_lark(calls_grammar(tools, name, True, form))
        matcher = LLMatcher(grammars.tokens(), grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(llama("add", a=1, b=2), None) and accepts(llama("add", a=1, b=2), "add")
    assert accepts(llama("get_weather", city="Oslo"), None) and not accepts(llama("get_weather", city="Oslo"), "add")
    assert not accepts(call("add", a=1, b=2), None)  # "arguments": not this form
    assert not accepts(llama("add", a=1, b=2) + "; " + llama("add", a=3, b=4), None)
    assert not accepts(f"<tool_call>\n{llama('add', a=1, b=2)}\n</tool_call>", None)
    made = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    messages = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": None, "tool_calls": made}]
    text = tokenizer.apply_chat_template(messages, tools=[ADD], tokenize=False)
    written = text.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert accepts(written, "add") and read_calls(written, {"add"}) == (None, (ToolCall("add", '{"a": 1, "b": 2}'),))


def test_serve_reads_a_chat_template_by_file_or_shipped_name(tmp_path):
    """`forerun serve --chat-template`: a file, or a shipped template by name; an unreadable or empty file, an
    unknown name, a template that does not render are each one error naming the option."""
    from forerun.cli.common import read_chat_template, use_chat_template

    assert read_chat_template("chatml-tools") == shipped_template("chatml-tools")
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(path)).startswith("{% for")
    tokenizer = byte_tokenizer()
    use_chat_template(tokenizer, read_chat_template(str(path)))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == "Hi"
    path.write_text("  ")
    for bad, fragment in [(str(path), "empty"), (str(tmp_path / "none.jinja"), "cannot be read"),
                          ("/dev/zero", "longer"), ("llama9", "no chat template named 'llama9'")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            read_chat_template(bad)
    with pytest.raises(ValueError, match="--chat-template: the template does not render"):
        use_chat_template(tokenizer, "{% for m in messages %}{{ m.content }")


def test_a_run_record_offers_tools_and_its_row_carries_the_calls():
    """`forerun run`: a record's tools and tool_choice reach its request; its output row lists the calls (and none
    for a record without tools); a record whose history holds a call without content is taken."""
    from forerun.runner import output_row, parse_record
    from forerun.stats import GenerationStats

    turns = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"}]  # fmt: skip
    line = json.dumps({"id": 1, "messages": turns, "tools": [ADD], "tool_choice": "required"})
    record = parse_record(line, 1, {"max_new_tokens": 8})
    request = record.request()
    assert request.tools == (ADD,) and request.tool_choice == "required" and request.held_format["name"] is None
    with pytest.raises(ValueError, match="tool_choice"):
        parse_record(json.dumps({"id": 2, "prompt": "Hi", "tool_choice": "nope", "tools": [ADD]}), 2, {
            "max_new_tokens": 8}).request()  # fmt: skip
    stats = GenerationStats(forwards=1, new_tokens=1)
    made = GenerationResult(torch.tensor([[1, 2]]), 1, "x", stats, ["model"], tool_calls=(ToolCall("add", "{}"),))
    assert output_row(record, made)["tool_calls"] == [{"name": "add", "arguments": "{}"}]
    assert "tool_calls" not in output_row(record, GenerationResult(torch.tensor([[1, 2]]), 1, "x", stats, ["model"]))


def test_a_required_call_of_a_schema_no_grammar_holds_is_refused_naming_the_tools(grammars):
    grammars, _ = grammars
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}}  # fmt: skip
    request = GenerationRequest([{"role": "user", "content": "Hi"}], 8, tools=[broken], tool_choice="required")
    with pytest.raises(ValueError, match="a tool's parameters are not a schema forerun can hold a call to"):
        grammars.compile(request.held_format)


STRICT_ADD = {"type": "function", "function": {**ADD["function"], "strict": True}}
LAZY_FORMS = {
    "a block each": CallForm(),
    "one list": CallForm(listed=True),
    "marks of their own": CallForm(open="<tool_call>", close="</tool_call>"),
    "bare": CallForm(open="", close="", kind="json"),
}


def written_in(form: CallForm, *calls: str) -> str:
    """`calls` (each `call(...)`) as the form writes them."""
    if form.kind == "json":
        return calls[0].replace('"arguments"', '"parameters"')
    if form.listed:
        return f"<tool_call>[{', '.join(calls)}]</tool_call>"
    return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


@pytest.mark.parametrize("kind", LAZY_FORMS)
def test_a_lazy_grammar_leaves_text_free_and_holds_every_call_it_opens(kind):
    """Under tool_choice auto with a strict function: any text without a call passes; once the answer opens a call
    (the template's mark, or an answer beginning as JSON) the calls are held to their schemas to the end."""
    from llguidance import LLMatcher

    form, tokenizer = LAZY_FORMS[kind], byte_tokenizer()
    if form.open == "<tool_call>":  # the marks as tokens of their own, read by llguidance as special
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    lark = calls_grammar(check_tools([WEATHER, ADD]), None, form.kind != "json", form, lazy=True)

    def accepts(text: str) -> bool:
        matcher = LLMatcher(grammars.tokens(), LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    good, bad = call("add", a=1, b=2), call("add", a=1, b="2")
    lead = "" if form.kind == "json" else "Let me add them.\n"
    for text in ("", "Paris is sunny.", "Use tools like add(1, 2).", lead + written_in(form, good)):
        assert accepts(text), text
    for text in (lead + written_in(form, bad), lead + written_in(form, call("sub", a=1)),
                 lead + written_in(form, good) + " And that is all."):  # fmt: skip
        assert not accepts(text), text
    if form.kind != "json":
        assert accepts(lead + written_in(form, good, call("get_weather", city="Oslo")))
    # an answer beginning as JSON is only calls, bare or in a ```json fence, as read_calls reads it
    key = form.arguments
    bare, wrong = good.replace('"arguments"', f'"{key}"'), bad.replace('"arguments"', f'"{key}"')
    assert accepts(bare) and accepts(f"```json\n{bare}\n```") and accepts("```python\nprint(1)\n```")
    for text in (wrong, f"```json\n{wrong}\n```", '{"answer": 3}', f"{bare} And that is all.", " " + bare):
        assert not accepts(text), text
    assert accepts("Sure: " + bare)  # inside free text: not a call (read_calls reads it as content too)


@pytest.mark.parametrize("own_marks", [False, True], ids=["marks as text", "marks of their own"])
def test_free_text_under_strict_may_think_in_special_tokens_before_its_call(own_marks):
    """A lazy grammar's free text may begin with a thought (a Qwen3's `<think>` ... `</think>`, JSON inside it free),
    and a call opened after it, at the mark or as JSON, is held all the same; a thought comes first or not at all."""
    from llguidance import LLMatcher

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>", *(["<tool_call>", "</tool_call>"] if own_marks else [])])
    tokenizer.chat_template = "{{ '<tool_call>' }}"  # teaches the block form
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    form = grammars.call_form()
    assert form.specials and (form.open == "<tool_call>") == own_marks
    lark = calls_grammar(check_tools([WEATHER, ADD]), None, True, form, lazy=True)

    def accepts(text: str) -> bool:
        matcher = LLMatcher(grammars.tokens(), LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    good, bad = written_in(CallForm(), call("add", a=1, b=2)), written_in(CallForm(), call("add", a=1, b="2"))
    thought = '<think>\nAdd {"a": 1}? Yes.\n</think>\n\n'
    assert accepts(thought + "It is 3.") and accepts(thought + good) and accepts("<think></think>" + good)
    assert not accepts(thought + bad) and not accepts(thought + good + " Done.")
    bare, wrong = call("add", a=1, b=2), call("add", a=1, b="2")  # after a thought, an answer begun as JSON: calls
    assert accepts(thought + bare) and not accepts(thought + wrong) and not accepts("It is 3. " + thought)


def test_strict_functions_hold_calls_under_auto_and_the_others_take_any_object():
    """OpenAI's `strict` is per function: under tool_choice auto a strict one's calls are held to its schema, the
    others' to any object; without a strict function nothing is held (the answer is plain generate's)."""
    assert strictly_held(check_tools([WEATHER, ADD])) is None
    held = strictly_held(check_tools([WEATHER, STRICT_ADD]))
    assert held[1] == STRICT_ADD and held[0] == {"type": "function", "function": {"name": "get_weather"}}
    asked = [{"role": "user", "content": "Add 1 and 2."}]
    assert GenerationRequest(asked, 8, tools=[WEATHER, ADD]).held_format is None
    request = GenerationRequest(asked, 8, tools=[WEATHER, STRICT_ADD])
    assert request.held_format["lazy"] and request.processed
    assert GenerationRequest(asked, 8, tools=[STRICT_ADD], tool_choice="none").held_format is None
    assert "lazy" not in GenerationRequest(asked, 8, tools=[STRICT_ADD], tool_choice="required").held_format


def test_a_strict_constraint_masks_only_inside_a_call():
    """The processor itself (the control of the equality tests, whose tiny models never open a call): free text
    keeps every token; inside an opened call only the schema's next tokens stay."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = shipped_template("chatml-tools")
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    asked = [{"role": "user", "content": "Add 1 and 2."}]
    request = GenerationRequest(asked, 8, tools=[WEATHER, STRICT_ADD], parallel_tool_calls=False)
    constraint = grammars.constraint(request.held_format, 0, frozenset({tokenizer.eos_token_id}))

    def mask(text: str) -> torch.Tensor:
        return constraint.allowed_after(tokenizer.encode(text, add_special_tokens=False))

    def allowed(text: str) -> set[str]:
        return {tokenizer.decode([i]) for i in torch.nonzero(mask(text)).flatten().tolist()}

    text_tokens = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isascii()]  # UTF-8 text, and EOS
    assert len(text_tokens) > 128 and bool(mask("Sure, ")[text_tokens].all())  # free text: any of them
    assert allowed("Sure. <tool_call>") == {"["}  # SmolLM2's form: one list
    assert allowed('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": ') <= set("0123456789-")
    assert allowed('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>') == {"<eos>"}


@pytest.mark.parametrize("own_marks", [False, True], ids=["marks as text", "marks of their own"])
def test_a_required_call_may_follow_a_thought_where_the_tokenizer_has_think_tokens(own_marks):
    """A reasoning model's tokenizer (`<think>`, `</think>` tokens of their own): a required call may come after a
    thought, free text between them, as such a model writes one first; nothing else may come before the call.
    Without those tokens a thought is text, and the call comes first (the control)."""
    from llguidance import LLMatcher

    def accepts_with(tokenizer, text: str) -> bool:
        grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
        lark = calls_grammar(check_tools([WEATHER, ADD]), None, True, grammars.call_form())
        matcher = LLMatcher(grammars.tokens(), LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    thinking, plain = byte_tokenizer(), byte_tokenizer()
    thinking.add_tokens(["<think>", "</think>", *(["<tool_call>", "</tool_call>"] if own_marks else [])])
    for tokenizer in (thinking, plain):
        tokenizer.chat_template = "{{ '<tool_call>' }}"  # teaches the block form
    good = written_in(CallForm(), call("add", a=1, b=2))
    thought = '<think>\nThe user wants a sum: add {"a": 1, "b": 2}.\n</think>\n\n'
    assert accepts_with(thinking, good) and accepts_with(thinking, thought + good)
    assert accepts_with(thinking, "<think></think>" + good)
    spun = thought + "\n" * 6 + good  # no room to spin whitespace between the thought and the call
    wrong = thought + written_in(CallForm(), call("add", a="x"))
    for text in (thought + "Sure. " + good, "Sure. " + good, wrong, spun):
        assert not accepts_with(thinking, text), text
    assert not accepts_with(plain, thought + good) and accepts_with(plain, good)
