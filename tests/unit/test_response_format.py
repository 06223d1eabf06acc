"""response_format's checks and its processor (`forerun.structured`) on a byte-level tokenizer, without a model."""

from __future__ import annotations

import re

import pytest
import torch

from forerun import GenerationRequest
from forerun.structured import MAX_COMPILED, MAX_DEPTH, Constraint, Grammars, check_response_format, grammar_of
from forerun.tree import TokenTree

from tiny_models import byte_tokenizer

PERSON = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def deep(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("json", "response_format must be an object"),
        ({"type": "json"}, "response_format's type must be one of text, json_object, json_schema, got 'json'"),
        ({"type": "json_object", "schema": {}}, "response_format of type json_object takes no schema"),
        ({"type": "json_schema"}, "needs json_schema: "),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "needs a name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "schema must be a JSON object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 1}}, "strict must be true"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "format": 1}}, "takes no format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"maximum": float("nan")}}}, "plain JSON"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": deep(70)}}, f"at most {MAX_DEPTH}"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": "a\ud800"}}}, "lone surrogate"),
        (
            {"type": "json_schema", "json_schema": {"name": "\udfff", "schema": {}}},
            "lone surrogate (U+DFFF at character",
        ),
    ],
)
def test_hostile_formats_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerationRequest("Hi", 4, response_format=value)


def test_text_is_no_format_and_a_format_makes_the_request_processed():
    assert GenerationRequest("Hi", 4, response_format={"type": "text"}).response_format is None
    assert not GenerationRequest("Hi", 4, response_format={"type": "text"}).processed
    assert GenerationRequest("Hi", 4, response_format={"type": "json_object"}).processed
    assert check_response_format(PERSON) == PERSON and check_response_format(PERSON) is not PERSON  # a copy


def test_a_schema_that_does_not_compile_is_named_and_compiled_ones_are_kept(grammars):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}
    with pytest.raises(ValueError, match="response_format's schema is not one forerun can hold an answer to"):
        grammars.compile(bad)
    assert grammars.compile(PERSON) is grammars.compile(PERSON)  # compiled once
    for size in range(MAX_COMPILED):
        grammars.compile({"type": "json_schema", "json_schema": {"name": "s", "schema": {"maxProperties": size}}})
    assert len(grammars.compiled) == MAX_COMPILED and grammar_of(PERSON) not in grammars.compiled


def masks(constraint, tokenizer, answers: list[str], prompt: int = 3) -> torch.Tensor:
    """Which tokens the constraint leaves after each answer text [answers, vocab] (a row of one call each)."""
    rows = [[7] * prompt + tokenizer.encode(text) for text in answers]
    width = max(map(len, rows))
    assert all(len(row) == width for row in rows), "one call takes rows of one length"
    scores = torch.zeros(len(rows), len(tokenizer))
    return constraint(torch.tensor(rows), scores) == 0


def test_the_mask_follows_each_rows_own_answer(grammars, tokenizer):
    eos = tokenizer.eos_token_id
    constraint = grammars.constraint(PERSON, 3, frozenset({eos}))
    (start,) = masks(constraint, tokenizer, ['{"'])
    after_key, broken = masks(constraint, tokenizer, ['{"n', '{"x'])  # siblings: one call, a row each
    assert start.nonzero().flatten().tolist() == tokenizer.convert_tokens_to_ids(["n"])  # "name" comes first
    assert after_key.nonzero().flatten().tolist() == tokenizer.convert_tokens_to_ids(["a"])
    assert broken.all()  # a drafted row past a wrong guess: never kept, left as it is
    (number,) = masks(constraint, tokenizer, ['{"name":"Al","age":7'])
    digits = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)] + ["}"])
    assert number.nonzero().flatten().tolist() == sorted(digits)  # more digits, or the object's end
    (done,) = masks(constraint, tokenizer, ['{"name":"Al","age":7}'])
    assert done.nonzero().flatten().tolist() == [eos]  # complete: only the end
    (closed,) = masks(constraint, tokenizer, ['{"name":"Al","age":7}}'])
    assert closed.all()  # past the end: broken


def test_the_requests_own_eos_ids_stand_for_the_end(grammars, tokenizer):
    eos = tokenizer.eos_token_id
    constraint = grammars.constraint({"type": "json_object"}, 2, frozenset({5, 9}))
    (done,) = masks(constraint, tokenizer, ["{}"], prompt=2)
    assert done.nonzero().flatten().tolist() == [5, 9] and not done[eos]
    rows = torch.tensor([[7, 7, *tokenizer.encode("{}"), 9]])
    assert not constraint(rows, torch.zeros(1, len(tokenizer))).isinf().any()  # an ended answer is never extended
    with pytest.raises(ValueError, match="needs an end-of-text token"):
        grammars.constraint({"type": "json_object"}, 2, frozenset())


def test_a_step_past_llguidances_work_limits_ends_the_answer(grammars, tokenizer, caplog):
    """Following or masking past llguidance's work caps (here set tiny, over a string's pattern) leaves only the
    request's EOS ids: the answer ends there (and says why in the log), rather than running unheld or holding the
    step."""
    from llguidance import LLMatcher, LLParserLimits

    pattern = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^(a|b)*c$"}}}
    grammar = grammar_of({"type": "json_schema", "json_schema": {"name": "p", "schema": pattern}})
    limited = LLMatcher(grammars.tokens(), grammar, log_level=0, limits=LLParserLimits(step_lexer_fuel=10))
    for answer in ('{"name":"', '{"name":"ab'):  # the limit met masking, and following the answer
        constraint = Constraint(limited, 3, frozenset({5}), tokenizer.eos_token_id)
        (mask,) = masks(constraint, tokenizer, [answer])
        assert mask.nonzero().flatten().tolist() == [5], answer
    assert caplog.text.count("met llguidance's work limits") == 2  # once per request


def test_guesses_the_format_refuses_are_pruned_with_what_hangs_under_them(grammars, tokenizer):
    """A drafted guess the grammar refuses could never be kept (the target's choice is masked): it and its subtree
    leave the tree before the budget chooses what to feed; valid guesses and probes stay."""
    constraint = grammars.constraint(PERSON, 3, frozenset({tokenizer.eos_token_id}))
    answer = tokenizer.encode('{"')
    token = dict(zip("namexy", tokenizer.convert_tokens_to_ids(list("namexy")), strict=True))
    tree = TokenTree.rooted_at(answer[-1])
    tree.add_chain(0, [token["n"], token["a"], token["x"], token["y"]])  # "nax": refused at x
    bad = tree.add(0, token["x"])
    tree.add(bad, token["y"])
    tree.add(0, token["y"], role="probe")
    kept = constraint.pruned(tree, answer)
    assert [kept.tokens[n] for n in range(1, len(kept)) if kept.roles[n] == "candidate"] == [token["n"], token["a"]]
    assert "probe" in kept.roles and constraint.pruned(kept, answer) is kept  # nothing more to prune: itself
