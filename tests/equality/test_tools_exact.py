"""Tools: every method writes what plain generate writes from the prompt the chat template makes with the tools,
free (`tool_choice` auto) or held to calls (required, named) with the request's constraint as its processor, alone
and batched; the calls read out are the text's (`forerun.tool_specs`, `forerun.tool_calls`)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

import forerun
from forerun.costmodel import LatencyCurve
from forerun.tool_calls import read_calls
from forerun.tool_specs import parameters_of, shipped_template

from tiny_models import byte_tokenizer, tiny_model
from tool_templates import LFM2_MARKS, LFM2_PYTHONIC, LLAMA3_JSON, MISTRAL_NAMED, MISTRAL_TOOLS, QWEN35_XML

CURVE = LatencyCurve((1, 8, 32), (1.0, 1.1, 1.5))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}  # fmt: skip
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
STRICT = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in TOOLS]
CHOICES = {"auto": (TOOLS, "auto"), "strict": (STRICT, "auto"), "required": (TOOLS, "required"),
           "named": (TOOLS, {"type": "function", "function": {"name": "add"}})}  # fmt: skip
"""(tools, tool_choice) per kind: free, free until a call opens (strict functions), held to calls, to one."""
MESSAGES = [[{"role": "user", "content": "Weather in Oslo?"}], [{"role": "user", "content": "Add 2 and 3."}]]
METHODS = ("plain", "prompt_lookup", "trie", "auto")
NEW = 96
"""New tokens: room for a call in byte-sized tokens (about 80)."""


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = shipped_template("chatml-tools")
    return tokenizer


def model_of(family: str, attention: str, tokenizer, context: int = 1024, seed: int = 0) -> torch.nn.Module:
    model = tiny_model(family, attention, seed, vocab_size=len(tokenizer), max_position_embeddings=context)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def expected(model, decoder, tokenizer, messages, tools, choice, held: bool = True) -> torch.Tensor:
    """Plain generate from the prompt with the tools, with the request's constraint where it holds one (and
    `held`)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]  # fmt: skip
    request = forerun.GenerationRequest(messages, NEW, tools=tools, tool_choice=choice, parallel_tool_calls=False)
    processors = []
    if request.held_format is not None and held:
        ends = frozenset({tokenizer.eos_token_id})
        processors.append(decoder.grammars.constraint(request.held_format, ids.shape[1], ends))
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList(processors))  # fmt: skip


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_method_writes_generates_text_with_the_tools_free_or_held_to_calls(family, attention, tokenizer):
    """Greedy, each tool_choice: every method, alone and as a batch of two, writes generate's text; a required or
    named call is a call of the tools (of the one named), and holding it changes the text (the control)."""
    every_method_writes_generates_text(model_of(family, attention, tokenizer), tokenizer, METHODS)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_json_calls_are_written_as_generate_writes_them_free_or_held(attention):
    """The same with a chat template teaching Llama 3's bare JSON calls: a required call is held to one object
    whose arguments are its parameters, and read back."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = LLAMA3_JSON
    every_method_writes_generates_text(model_of("llama", attention, tokenizer, 2048), tokenizer, ("plain", "auto"))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("form", ["list", "named"])
def test_calls_after_a_special_token_are_written_as_generate_writes_them_free_or_held(attention, form):
    """The same with a template teaching Mistral's calls (one list after its own `[TOOL_CALLS]` token, or each
    call's name and `[ARGS]` after its own): a required call is held to that form and read back from the text the
    marks are decoded out of."""
    tokenizer = byte_tokenizer()
    marks = ["[TOOL_CALLS]", "[ARGS]"] if form == "named" else ["[TOOL_CALLS]"]
    tokenizer.add_special_tokens({"additional_special_tokens": marks})
    tokenizer.chat_template = MISTRAL_NAMED if form == "named" else MISTRAL_TOOLS
    every_method_writes_generates_text(model_of("llama", attention, tokenizer, 2048), tokenizer, ("plain", "auto"))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_xml_calls_are_written_as_generate_writes_them_free_or_held(attention):
    """The same with a template teaching Qwen3.5's XML calls: a required call is held to `<function=...>` and a
    `<parameter=...>` per argument, each value to its type, and read back typed."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = QWEN35_XML
    model = model_of("llama", attention, tokenizer, 2048, seed=1)  # seed 0 meets a 5-ulp tie batched (fp32's ties)
    # an XML string's value is any text up to its closing tag (no length held): a random model's city would run on
    city = {"type": "string", "enum": ["Oslo", "Paris"]}
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": {
        **WEATHER["function"]["parameters"], "properties": {"city": city}}}}  # fmt: skip
    choices = {kind: ([weather, ADD] if tools[0] is WEATHER else tools, choice) for kind, (tools, choice) in
               CHOICES.items()}  # fmt: skip
    every_method_writes_generates_text(model, tokenizer, ("plain", "auto"), choices)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_pythonic_calls_are_written_as_generate_writes_them_free_or_held(attention):
    """The same with a template teaching LFM2's calls (a Python list of calls between its own special tokens): a
    required call is held to `[name(key=value)]`, each value to its type, and read back from the text the marks
    are decoded out of."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": LFM2_MARKS})
    tokenizer.chat_template = LFM2_PYTHONIC
    model = model_of("llama", attention, tokenizer, 2048)
    city = {"type": "string", "enum": ["Oslo", "Paris"]}  # a Python string's length is not held: a random model's
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": {  # would run on
        **WEATHER["function"]["parameters"], "properties": {"city": city}}}}  # fmt: skip
    choices = {kind: ([weather, ADD] if tools[0] is WEATHER else tools, choice) for kind, (tools, choice) in
               CHOICES.items()}  # fmt: skip
    every_method_writes_generates_text(model, tokenizer, ("plain", "auto"), choices)


def every_method_writes_generates_text(model, tokenizer, methods: tuple[str, ...], choices: dict = CHOICES) -> None:
    reference = forerun.Decoder(model, tokenizer, "plain", latency=CURVE)
    wanted = {kind: [expected(model, reference, tokenizer, m, *choice) for m in MESSAGES]
              for kind, choice in choices.items()}  # fmt: skip
    assert not torch.equal(wanted["auto"][0], wanted["required"][0])
    free = expected(model, reference, tokenizer, MESSAGES[0], *choices["strict"], held=False)
    assert not torch.equal(free, wanted["strict"][0])  # strict holds these texts: a random model's bytes are not UTF-8
    held_calls = 0
    for method in methods:
        decoder = forerun.Decoder(model, tokenizer, method, latency=CURVE)
        for kind, (tools, choice) in choices.items():
            options = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
            alone = decoder.generate(MESSAGES[0], NEW, **options)
            assert torch.equal(alone.sequences, wanted[kind][0]), (method, kind)
            batch = decoder.generate(MESSAGES, NEW, **options)
            for row, want in zip(batch, wanted[kind], strict=True):
                assert torch.equal(row.sequences, want), (method, kind, "batched")
            for result in (alone, *batch):
                assert result.tool_calls == read_calls(result.text, parameters_of(tools))[1]
                if kind in ("required", "named") and result.finish_reason != "length":  # held: one call, whole
                    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1, result.text
                    held_calls += 1
                    assert result.content is None
                    assert kind != "named" or result.tool_calls[0].name == "add"
    assert held_calls >= 4 * len(methods)  # the held answers' calls were read, not all cut off by the length


def test_tools_need_a_template_that_takes_them_and_a_chat_prompt(tokenizer):
    model = model_of("llama", "sdpa", tokenizer)
    plain = byte_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="chat template does not teach tool calls"):
        forerun.Decoder(model, plain, "plain", latency=CURVE).generate(MESSAGES[0], 4, tools=TOOLS)
    decoder = forerun.Decoder(model, tokenizer, "plain", latency=CURVE)
    with pytest.raises(ValueError, match="tools are shown by the chat template"):
        decoder.generate("Weather?", 4, tools=TOOLS)
    assert decoder.generate("Weather?", 4, tools=TOOLS, chat=True).tool_calls is not None
    assert decoder.generate(MESSAGES[0], 4).tool_calls is None


def test_a_jsonl_run_offers_each_records_tools_and_writes_generates_held_text(tokenizer, tmp_path):
    """`forerun run`: a record with tools and a required call writes plain generate's held text and its row lists
    the call; a record without tools beside it writes generate's text (the records had been encoded without their
    tools, and such a record stopped the run); a schema no grammar holds fails its own record, not the run."""
    import json

    from forerun.runner import parse_record, run_records

    model = model_of("llama", "sdpa", tokenizer)
    decoder = forerun.Decoder(model, tokenizer, "auto", latency=CURVE)
    messages = MESSAGES[1]
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}}  # fmt: skip
    unheld = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}
    lines = [{"id": "call", "messages": messages, "tools": TOOLS, "tool_choice": "required"},
             {"id": "free", "messages": messages},
             {"id": "broken", "messages": messages, "tools": [broken], "tool_choice": "required"},
             {"id": "unheld", "messages": messages, "response_format": unheld}]  # fmt: skip
    records = [parse_record(json.dumps(line), k + 1, {"max_new_tokens": NEW}, k) for k, line in enumerate(lines)]
    out = tmp_path / "out.jsonl"
    run_records(decoder, records, out, batch_size=2)
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert "error" not in rows["call"], rows["call"]
    for name, tools in (("call", TOOLS), ("free", None)):
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]  # fmt: skip
        request = forerun.GenerationRequest(messages, NEW, tools=tools, tool_choice="required" if tools else None)
        held = request.held_format and decoder.grammars.constraint(request.held_format, ids.shape[1],
                                                                   frozenset({tokenizer.eos_token_id}))  # fmt: skip
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([held] if held else []))  # fmt: skip
        assert rows[name]["tokens"] == out[0, ids.shape[1] :].tolist(), name
    calls = read_calls(rows["call"]["text"], parameters_of(TOOLS))[1]  # a list of calls, perhaps cut by the end
    assert rows["call"]["tool_calls"] == [{"name": c.name, "arguments": c.arguments} for c in calls]
    assert rows["call"]["text"].startswith("<tool_call>") and "tool_calls" not in rows["free"]
    assert "not a schema forerun can hold a call to" in rows["broken"]["error"]  # its own record only, not the run
    assert "not one forerun can hold an answer to" in rows["unheld"]["error"]
