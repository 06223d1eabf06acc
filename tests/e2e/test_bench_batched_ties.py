"""`forerun bench --batch-size`: every row judged against plain batched generate's, ties read as the contract says."""

import copy
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from forerun.bench import batched
from forerun.bench.batched import BatchRow, left_padded, markdown_table, row_verdict, time_decoders
from forerun.bench.datasets import load_dataset
from forerun.cli import app

from tiny_models import embedded_tokenizer, real_vocab_llama


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random llama with the real tokenizer's vocabulary and an output matrix of its own (not tied)."""
    return real_vocab_llama(tokenizer, tie_word_embeddings=False)


def greedy(model, tokenizer, prompt, tokens: int = 6) -> list[int]:
    ids = left_padded(tokenizer, [prompt], model.device)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def twin_token(model, token: int) -> int:
    """A token whose output row becomes `token`'s, so that the two score exactly alike everywhere: a tie."""
    twin = (token + 1) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[token]
    return twin


def test_a_row_is_identical_a_tie_or_other_as_the_models_logits_say(model, tokenizer):
    low = copy.deepcopy(model).to(torch.bfloat16)
    prompt = load_dataset("gsm8k", 1)[0]
    expected = greedy(low, tokenizer, prompt)
    assert row_verdict(low, tokenizer, prompt, expected, list(expected)) == "identical"
    # the second-best token and below: no reading calls that a tie
    far = int(torch.argsort(low(left_padded(tokenizer, [prompt], "cpu")["input_ids"]).logits[0, -1])[0])
    assert row_verdict(low, tokenizer, prompt, expected, [far, *expected[1:]]) == "other"
    assert row_verdict(low, tokenizer, prompt, expected, expected[:-1]) == "other"  # only shorter: a stop misplaced
    twin = twin_token(low, expected[2])
    assert greedy(low, tokenizer, prompt) == expected  # the first of two equal scores stays generate's choice
    assert row_verdict(low, tokenizer, prompt, expected, [*expected[:2], twin]) == "tie"
    # fp32 holds rows to identity: the same exact tie is a difference
    exact = copy.deepcopy(model)
    twin_token(exact, expected[2])
    assert row_verdict(exact, tokenizer, prompt, expected, [*expected[:2], twin]) == "other"


class Wrong:
    """A decoder that writes generate's rows with their first token replaced (never a tie: an unrelated token)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def generate(self, messages, max_new_tokens, batch_size):
        made = [[(row[0] + 7) % 1000, *row[1:]] for row in self.rows[: len(messages)]]
        return [SimpleNamespace(new_tokens=row, stats=SimpleNamespace(forwards=len(row))) for row in made]


def test_rows_beyond_a_tie_are_named_in_the_cell_the_table_and_the_commands_exit(model, tokenizer, tmp_path):
    low = copy.deepcopy(model).to(torch.bfloat16)
    prompts = load_dataset("gsm8k", 2)
    expected = [greedy(low, tokenizer, p) for p in prompts]
    cell = BatchRow(2, "wrong")

    def judge(prompt, reference, got):
        return row_verdict(low, tokenizer, prompt, reference, got)

    time_decoders({"wrong": Wrong(expected)}, {"wrong": cell}, prompts, expected, 2, 6, None, judge)
    assert (cell.rows, cell.identical_rows, cell.tied_rows, cell.beyond) == (2, 0, 0, [p.id for p in prompts])
    assert markdown_table([BatchRow(2, "generate", 12, 1.0, rows=2, identical_rows=2), cell]).endswith("0 / 0 / 2 |")
    folder = tmp_path / "tiny"
    low.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = ["bench", "--model", str(folder), "--dataset", "gsm8k", "--n", "2", "--max-new-tokens", "4"]
    args += ["--methods", "plain", "--batch-size", "2", "--dtype", "bf16", "--out", str(tmp_path / "out")]
    assert CliRunner().invoke(app, args).exit_code == 0  # bf16 rows, judged: none beyond a tie
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batched, "row_verdict", lambda *_: "other")
        failed = CliRunner().invoke(app, args)
    assert failed.exit_code == 1 and "beyond a tie on GSM8K/0, GSM8K/1" in failed.output
