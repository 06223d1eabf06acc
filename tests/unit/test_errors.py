"""Bad input gives a ValueError naming the value; the CLI prints one line and exits with status 2."""

import copy

import pytest
import torch
from typer.testing import CliRunner

import forerun
from forerun.cli import app

from tiny_models import VOCAB, tiny_model


class TinyTokenizer:
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        forerun.generate(model, [], "prompt_lookup", 5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_max_new_tokens_must_be_positive(model, bad):
    with pytest.raises(ValueError, match=f"max_new_tokens must be a positive integer, got {bad!r}"):
        forerun.generate(model, [5, 6], "plain", bad)


def test_prompt_longer_than_context(model):
    with pytest.raises(ValueError, match=r"exceeds the model context \(512 tokens\)"):
        forerun.generate(model, [5] * 510, "plain", 10)
    with pytest.raises(ValueError, match=r"prompt \(510 tokens\) \+ max_new_tokens \(3\) exceeds"):
        forerun.generate(model, [5] * 510, "plain", 3)  # one token past the context
    assert len(forerun.generate(model, [5] * 510, "plain", 2).new_tokens) == 2  # the context exactly


def test_unknown_method_and_knobs(model):
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        forerun.generate(model, [5, 6], "medusa", 5)
    with pytest.raises(ValueError, match=r"unknown knob\(s\) \['window'\] for method 'prompt_lookup'"):
        forerun.generate(model, [5, 6], "prompt_lookup", 5, knobs={"window": 3})
    with pytest.raises(ValueError, match="draft_len must be an integer >= 1 and <= 256, got 0"):
        forerun.generate(model, [5, 6], "prompt_lookup", 5, knobs={"draft_len": 0})
    with pytest.raises(ValueError, match=r"unknown generation argument\(s\) \['window'\]; method knobs"):
        forerun.generate(model, [5, 6], "prompt_lookup", 5, window=3)
    with pytest.raises(ValueError, match="max_tree_nodes must be an integer >= 1 and <= 4096, got 0"):
        forerun.generate(model, [5, 6], "prompt_lookup", 5, max_tree_nodes=0)


def test_an_encoder_decoder_model_is_named():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=96, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, decoder_start_token_id=0)
    )
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model; forerun decodes"):
        forerun.Decoder(t5, None, "plain")
    with pytest.raises(ValueError, match="is an encoder-decoder model"):
        t5.generate(torch.tensor([[5, 6]]), max_new_tokens=3, custom_generate=forerun.hf_generate)


def test_token_ids_outside_vocabulary(model):
    with pytest.raises(ValueError, match=f"outside the model's vocabulary \\[0, {VOCAB}\\)"):
        forerun.generate(model, [5, VOCAB + 3], "plain", 5)


def test_tokenizer_model_mismatch(model):
    with pytest.raises(ValueError, match=f"has 49152 tokens but model LlamaForCausalLM embeds only {VOCAB}"):
        forerun.Decoder(model, TinyTokenizer(49152), "plain")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--method", "nope"], "unknown method 'nope'"),
        (["generate", "hi", "--knob", "draft_len=0"], "draft_len must be an integer >= 1"),
        (["generate", "hi", "--knob", "oops"], "is not NAME=VALUE"),
        (["generate", "hi", "--model", "/no/such/model.gguf"], "GGUF file not found"),
        (["bench", "--dataset", "nosuch", "--n", "1"], "unknown dataset 'nosuch'"),
        (["bench", "--methods", "plain,warp"], "unknown benchmark method 'warp'"),
        # before any model loads or minutes of measuring, not at the end of them
        (["curve", "--out", "/proc/forerun"], "--out /proc/forerun cannot be created"),
        (["bench", "--out", "pyproject.toml"], "--out pyproject.toml is a file; give a folder"),
        (["run", "/dev/null", "-o", "out.jsonl"], "prompts file /dev/null is not a regular file"),
        (["generate", "hi", "--compile-buckets"], "compile_buckets is for a CUDA device's captured graphs"),
        (["bench", "--compile-buckets", "--n", "1"], "compile_buckets is for a CUDA device's captured graphs"),
        (["serve", "--compile-buckets"], "compile_buckets is for a CUDA device's captured graphs"),
        (
            ["run", "README.md", "-o", "/tmp/forerun-refused.jsonl", "--compile-buckets"],
            "compile_buckets is for a CUDA device's captured graphs",
        ),  # fmt: skip
        (["train-head", "--out", "head", "--unroll", "0"], "--unroll in 1..8"),
        (["train-head", "--out", "head", "--unroll", "1000000000000"], "--unroll in 1..8"),
        (["train-head", "--out", "head", "--dtype", "fp16"], "--dtype bf16 or fp32"),
    ],
)
def test_cli_errors_exit_2_without_traceback(args, message):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_a_truncated_gguf_file_is_named_as_such(tmp_path):
    from forerun.models import EMBEDDED

    source = EMBEDDED["smollm2-135m"].locate()
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as handle:
        cut.write_bytes(handle.read(source.stat().st_size // 2))
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*cut\.gguf .* truncated or corrupt"):
        forerun.load_model(str(cut))
    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(cut)])
    assert result.exit_code == 2 and "truncated or corrupt" in result.output and "Traceback" not in result.output


def test_load_model_takes_dtype_names_and_refuses_others_before_reading_the_file():
    model, _ = forerun.load_model("smollm2-135m", dtype="bf16")
    assert model.dtype == torch.bfloat16
    # before this check, "fp64" reached the GGUF reader and was reported as a corrupt file
    with pytest.raises(ValueError, match="dtype must be one of fp32, bf16, fp16, got 'fp64'"):
        forerun.load_model("smollm2-135m", dtype="fp64")


@pytest.mark.real_model
def test_messages_the_chat_template_cannot_render_are_a_value_error(smollm2):
    model, tokenizer = smollm2
    decoder = forerun.Decoder(model, tokenizer, "plain")
    with pytest.raises(ValueError, match=r"messages\[1\]\.role must be a string, got 5"):
        decoder.generate([{"role": "user", "content": "hi"}, {"role": 5, "content": "x"}], 2)
    strict = copy.deepcopy(tokenizer)  # a template that refuses, as some models' do for roles out of turn
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(ValueError, match="the chat template refused these messages: Conversation roles must"):
        forerun.Decoder(model, strict, "plain").generate([{"role": "user", "content": "hi"}], 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": b"\x05\x06"}, "prompt is bytes"),
        ({"prompt": None}, "prompt must be text, a list of chat messages or token ids .* got NoneType"),
        ({"prompt": 5}, "prompt must be text.* got int"),
        ({"prompt": {"role": "user"}}, "prompt must be text.* got dict"),
        ({"prediction": 5}, "prediction must be text or a list of token ids"),
        ({"cancel": "yes"}, "cancel must be a threading.Event"),
        ({"streamer": 5}, "streamer must have put\\(\\) and end\\(\\)"),
        ({"eos_token_id": -5}, "eos_token_id must hold token ids in \\[0, 96\\)"),
        ({"eos_token_id": 10**12}, "eos_token_id must hold token ids in \\[0, 96\\)"),
        ({"eos_token_id": "x"}, "eos_token_id must be a token id or a list of token ids"),
        ({"eos_token_id": [3, 1.5]}, "eos_token_id must hold token ids"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(model, kwargs, message):
    decoder = forerun.Decoder(model, None, "prompt_lookup")
    arguments = {"prompt": [5, 6, 7], **kwargs}
    with pytest.raises(ValueError, match=message):
        decoder.generate(arguments.pop("prompt"), 4, **arguments)


def test_a_latency_that_is_not_a_curve_is_refused(model):
    with pytest.raises(ValueError, match="latency must be a forerun.LatencyCurve"):
        forerun.Decoder(model, None, "auto", latency="x")


def test_good_hooks_still_pass(model):
    import threading

    decoder = forerun.Decoder(model, None, "prompt_lookup")
    result = decoder.generate([5, 6, 7], 4, cancel=threading.Event(), prediction=[5, 6], eos_token_id=[3])
    assert len(result.new_tokens) <= 4
