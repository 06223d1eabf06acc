"""response_format on the embedded SmolLM2-135M-Instruct (fp32, CPU): JSON answers, generate's own text."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LogitsProcessorList
from typer.testing import CliRunner

import forerun
from forerun.cli import app

from helpers import chat_ids

pytestmark = pytest.mark.real_model

QUESTION = 'What is 7 times 6? Reply in JSON with the key "answer".'
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
FORMATS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "math", "schema": ANSWER | {"additionalProperties": False}}},
]


@pytest.mark.parametrize("response_format", FORMATS, ids=["json_object", "json_schema"])
def test_json_answers_are_generates_with_the_constraint_with_and_without_the_head(smollm2, response_format):
    """The model's free answer wraps its JSON in a Markdown fence and comments on it (the control); held to the
    format it answers one JSON object and ends, the text plain generate writes with the constraint, whichever way
    it is drafted (`auto` with the shipped EAGLE-3 head too), the drafts accepted."""
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, QUESTION)
    free = forerun.Decoder(model, tokenizer, "plain").generate(QUESTION, 64, chat=True)
    assert free.text.startswith("```")
    decoders = [
        forerun.Decoder(model, tokenizer, "auto"),
        forerun.Decoder(model, tokenizer, "auto", draft_head="smollm2-135m"),
    ]
    constraint = decoders[0].grammars.constraint(response_format, ids.shape[1], frozenset({tokenizer.eos_token_id}))
    expected = model.generate(
        ids, max_new_tokens=64, do_sample=False, logits_processor=LogitsProcessorList([constraint])
    )
    for decoder in decoders:
        result = decoder.generate(QUESTION, 64, chat=True, response_format=response_format)
        assert torch.equal(result.sequences, expected), decoder.method
        assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict), result.text
        assert result.stats.forwards < result.sequences.shape[1] - ids.shape[1]
    if "json_schema" in response_format:
        assert isinstance(json.loads(result.text)["answer"], int)


def test_cli_generate_answers_json_with_json_and_json_schema(smollm2, tmp_path):
    """`forerun generate --json` / `--json-schema FILE`: the Python API's JSON answer; a bad file or both options
    are refused by name before the model loads."""
    model, tokenizer = smollm2
    schema = tmp_path / "math.json"
    schema.write_text(json.dumps(ANSWER))
    expected = forerun.Decoder(model, tokenizer, "plain").generate(
        QUESTION, 48, chat=True, response_format=FORMATS[1] | {"json_schema": {"name": "math", "schema": ANSWER}}
    )
    args = ["generate", QUESTION, "--chat", "-n", "48", "--threads", "2", "--json-schema", str(schema)]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout) == json.loads(expected.text) and "answer" in json.loads(run.stdout)
    run = CliRunner().invoke(app, ["generate", QUESTION, "--chat", "-n", "48", "--threads", "2", "--json"])
    assert run.exit_code == 0 and isinstance(json.loads(run.stdout), dict), run.output
    schema.write_text("[1")
    for flags in (["--json-schema", str(schema)], ["--json", "--json-schema", str(schema)]):
        refused = CliRunner().invoke(app, ["generate", QUESTION, *flags])
        assert refused.exit_code != 0 and ("not a readable JSON file" in refused.output or "not both" in refused.output)
