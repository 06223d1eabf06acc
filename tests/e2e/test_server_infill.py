"""Fill in the middle on a live server: a completion's `suffix` on a model whose tokenizer has the marks (a tiny
random model given Qwen2.5-Coder's three marks) is plain generate's answer to the prompt in those marks, streamed
or not, for every method; the same marks on the library's side (`forerun.fim`)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from test_server import LiveServer

import forerun
from forerun.fim import fim_marks, infill_prompt
from forerun.server import ServerConfig, create_app

from tiny_models import byte_tokenizer, tiny_model

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\nprint(add(3, 4))\n"


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"], special_tokens=True)
    model = tiny_model("qwen2", "sdpa", seed=0, vocab_size=len(tokenizer) + 16, max_position_embeddings=512)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    server = LiveServer(create_app(model, tokenizer, ServerConfig("tiny-coder", "auto", max_tokens_limit=24)))
    yield server, model, tokenizer
    server.stop()


def test_a_suffix_fills_the_middle_as_plain_generate_does(served):
    server, model, tokenizer = served
    marks = fim_marks(tokenizer)
    ids = tokenizer(infill_prompt(marks, PREFIX, SUFFIX), return_tensors="pt").input_ids
    assert marks.prefix == "<|fim_prefix|>" and ids[0, 0].item() == tokenizer.convert_tokens_to_ids(marks.prefix)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = forerun.text.complete(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for method in ("plain", "prompt_lookup", "auto"):
        body = {"model": "tiny-coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24,
                "extra_body": {"forerun": {"method": method}}}  # fmt: skip
        assert client.completions.create(**body).choices[0].text == expected, method
        chunks = client.completions.create(**body, stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected, method


def test_the_command_line_fills_in_the_middle_and_refuses_a_model_without_the_marks(served, tmp_path):
    """`forerun generate PREFIX --suffix SUFFIX`: the middle, plain generate's, on a model whose tokenizer has the
    marks (saved as a folder); on the embedded SmolLM2 (no such marks) a refusal naming the option."""
    from typer.testing import CliRunner

    from forerun.cli import app

    _, model, tokenizer = served
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = tokenizer(infill_prompt(fim_marks(tokenizer), PREFIX, SUFFIX), return_tensors="pt").input_ids
    expected = forerun.Decoder(model, tokenizer, "plain").generate(ids, 12)
    # a token a step, as expected's: a random tiny model's near-ties may go the other way in a drafted tree
    run = CliRunner().invoke(app, ["generate", PREFIX, "--suffix", SUFFIX, "--model", str(tmp_path), "-n", "12",
                                   "--threads", "1", "--method", "plain"])  # fmt: skip
    assert run.exit_code == 0, run.output
    # stdout alone: the output mixes in stderr, whose progress bars (a measurement at load) flush when they will
    assert run.stdout.endswith(expected.text + "\n") and expected.text.strip()
    refused = CliRunner().invoke(app, ["generate", "def f(", "--suffix", ")\n", "-n", "4", "--threads", "1"])
    assert refused.exit_code == 2 and "--suffix" in refused.output and "fill-in-the-middle" in refused.output
