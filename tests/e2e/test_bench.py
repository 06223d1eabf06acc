"""The benchmark harness itself: datasets, method specs, interleaving, the mismatch detector, outputs. No timings."""

import copy
import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from forerun.base.packed import packable, packed
from forerun.bench.datasets import load_dataset
from forerun.bench.latency import write_curves
from forerun.bench.methods import parse_methods
from forerun.bench.peers import DenseGeneratePeer
from forerun.bench.records import NOISE_FLOOR, Record, load_records, mismatch_lines, noise_floor_lines
from forerun.bench.report import PARTIAL
from forerun.bench.runner import Run, encode, run_interleaved
from forerun.cli import app
from forerun.latency import SIZES, measure_curve
from forerun.measured import device_name
from forerun.models import DTYPES, load_model, resolve

from tiny_models import embedded_tokenizer, real_vocab_llama

EXPECTED_COUNTS = {
    "gsm8k": 1319,
    "humaneval": 164,
    "mbpp": 500,
    "typehints": 164,
    "restate": 1319,
    "edit": 164,
    "multiturn": 4 * 1319,
}


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random llama with the real tokenizer's vocabulary: the runner applies the real chat template."""
    return real_vocab_llama(tokenizer)


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_dataset_loaders_return_documented_counts_and_fields(name):
    prompts = load_dataset(name)
    assert len(prompts) == EXPECTED_COUNTS[name]
    assert len({p.id for p in prompts}) == len(prompts)
    for prompt in prompts[:50]:
        assert prompt.dataset == name
        assert [m["role"] for m in prompt.messages] == ["user"] and len(prompt.messages[0]["content"]) > 20
    assert len(load_dataset(name, 3)) == 3


def test_copy_heavy_prompts_contain_their_source():
    assert "return" in load_dataset("typehints", 1)[0].messages[0]["content"]
    assert load_dataset("gsm8k", 1)[0].messages[0]["content"] in load_dataset("restate", 1)[0].messages[0]["content"]


def test_user_jsonl_prompt_and_messages_and_a_bad_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "hello there"}\n{"id": "b", "messages": [{"role": "user", "content": "hi"}]}\n',
    )
    prompts = load_dataset(str(path))
    assert [p.id for p in prompts] == ["0", "b"] and prompts[0].messages[0]["content"] == "hello there"
    path.write_text('{"question": "no"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_dataset(str(path))
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("nope")


def test_method_specs_parse_knobs_budget_and_warm():
    text = "plain,jacobi[window=7,ngram=5,max_candidates=7],trie[warm=3],prompt_lookup[max_tree_nodes=8]"
    specs = parse_methods(text)
    assert [s.label for s in specs] == [
        "plain",
        "jacobi[window=7,ngram=5,max_candidates=7]",
        "trie[warm=3]",
        "prompt_lookup[max_tree_nodes=8]",
    ]
    assert specs[1].knobs == {"window": 7, "ngram": 5, "max_candidates": 7}
    assert specs[2].warm == 3 and specs[2].knobs == {}
    assert specs[3].max_tree_nodes == 8
    (off,) = parse_methods("auto[prefix_cache=0]")
    assert off.prefix_cache == 0 and off.knobs == {} and specs[0].prefix_cache > 0
    for bad in ("auto[prefix_cache=-1]", "auto[prefix_cache=many]"):
        with pytest.raises(ValueError, match="prefix_cache takes a number of tokens >= 0"):
            parse_methods(bad)
    with pytest.raises(ValueError, match="unknown benchmark method"):
        parse_methods("plain,warp")


def test_runs_are_interleaved_per_prompt_and_checked(model, tokenizer):
    order = []
    prompts = load_dataset("gsm8k", 2)
    specs = parse_methods("plain,prompt_lookup,hf_prompt_lookup")
    records = run_interleaved(model, tokenizer, prompts, specs, 6, lambda pid, label: order.append((pid, label)))
    labels = ["generate", "plain", "prompt_lookup", "hf_prompt_lookup"]
    assert order == [(p.id, label) for p in prompts for label in labels]
    assert all(r.identical for r in records) and mismatch_lines(records) == []
    assert all(r.new_tokens == 6 and r.speedup > 0 for r in records)


def test_multiturn_turns_follow_the_answers_so_far(model, tokenizer):
    """Turn k's prompt is the conversation so far with plain generate's own answers; forerun's decoder keeps the
    conversation in its prefix cache as one growing entry, and stays identical to generate."""
    prompts = load_dataset("multiturn", 3)
    assert [p.id for p in prompts] == [f"{prompts[0].conversation}#{k}" for k in (1, 2, 3)]
    seen = []
    real_generate = model.generate

    def spying(ids, **kwargs):
        out = real_generate(ids, **kwargs)
        if kwargs.get("max_new_tokens") == 6 and "prompt_lookup_num_tokens" not in kwargs:
            seen.append((ids[0].tolist(), out[0].tolist()))
        return out

    model.generate = spying
    decoders = []
    try:
        records = run_interleaved(
            model, tokenizer, prompts, parse_methods("plain"), 6, prepare=lambda spec, d: decoders.append(d)
        )
    finally:
        del model.generate
    assert all(r.identical for r in records)
    last_turn = len(seen[-1][1]) - 1
    assert max(len(entry.tokens) for entry in decoders[0].prefixes.entries) >= last_turn - 1
    references = seen[-3:]  # the timed reference runs of turns 1-3 (after the warm-up)
    for (before, answer), (after, _) in zip(references, references[1:], strict=False):
        answer_text = tokenizer.decode(answer[len(before) :], skip_special_tokens=True)
        assert tokenizer.decode(after).startswith(tokenizer.decode(before) + answer_text)
        assert len(after) > len(before) + 6


def corrupter(tokenizer):
    """A `prepare` for `run_interleaved` that makes each decoder write its last token wrong (the next id)."""

    def corrupt(spec, decoder):
        honest = decoder.generate

        def generate(*args, **kwargs):
            result = honest(*args, **kwargs)
            wrong = result.sequences.clone()
            wrong[0, -1] = (wrong[0, -1] + 1) % len(tokenizer)
            return dataclasses.replace(result, sequences=wrong)

        decoder.generate = generate

    return corrupt


def test_mismatch_detector_catches_an_injected_mismatch(model, tokenizer):
    specs = parse_methods("plain,prompt_lookup")
    records = run_interleaved(model, tokenizer, load_dataset("gsm8k", 1), specs, 6, prepare=corrupter(tokenizer))
    lines = mismatch_lines(records)
    assert len(lines) == 2 and "plain on" in lines[0] and "prompt_lookup on" in lines[1]
    # generate against itself in a batch of two is the noise floor: noted, never a forerun mismatch
    flipped = Record("GSM8K/0", "gsm8k", NOISE_FLOOR, 6, 0.0, identical=False, tie_ulps=3.0)
    assert mismatch_lines([flipped]) == [] and noise_floor_lines([flipped]) == [
        f"{NOISE_FLOOR} on GSM8K/0 differs from model.generate alone at a margin of 3.0 ulp"
    ]
    assert noise_floor_lines([dataclasses.replace(flipped, tie_ulps=1.0)]) == []  # a tie is no news


def test_in_low_precision_a_wrong_token_is_a_mismatch_and_a_tie_read_otherwise_is_not(model, tokenizer):
    """bf16: a token no reading calls a tie stays a mismatch (generate's margin, one forward's, a verification
    forward's: `forerun.exactness.tie_reading`); a record whose margin only another reading calls a tie (a mixture
    of experts' router tie) is no mismatch, and its table cell says so."""
    from forerun.bench.report import identical_cell, summarize

    low = copy.deepcopy(model).to(torch.bfloat16)
    gsm8k, plain = load_dataset("gsm8k", 1), parse_methods("plain")
    records = run_interleaved(low, tokenizer, gsm8k, plain, 6, prepare=corrupter(tokenizer))
    (wrong,) = [r for r in records if r.method == "plain"]
    assert wrong.identical is False and wrong.tie_reading is None and len(mismatch_lines(records)) == 1
    far = Record("GSM8K/0", "gsm8k", "auto", 6, 1.0, identical=False, tie_ulps=11.0)
    read = dataclasses.replace(far, tie_reading="in company")
    beyond = "auto on GSM8K/0 differs from model.generate at a margin of 11.0 ulp (more than a tie)"
    assert mismatch_lines([far]) == [beyond]
    assert mismatch_lines([read]) == []
    same = dataclasses.replace(far, prompt_id="GSM8K/1", identical=True, tie_ulps=None)
    assert identical_cell(summarize([read, same])["gsm8k"]["auto"]) == "1/2, 1 a tie read otherwise"
    near = dataclasses.replace(far, prompt_id="GSM8K/2", tie_ulps=1.0)
    assert identical_cell(summarize([read, near])["gsm8k"]["auto"]) == "0/2, ties <= 1.0 ulp, 1 a tie read otherwise"


def test_sampled_runs_are_not_compared_token_for_token(model, tokenizer):
    specs = parse_methods("prompt_lookup,jacobi")
    sampling = {"temperature": 0.7, "top_p": 0.9}
    records = run_interleaved(model, tokenizer, load_dataset("gsm8k", 1), specs, 6, sampling=sampling, seed=3)
    assert [r.identical for r in records] == [None, None, None]
    assert mismatch_lines(records) == [] and all(r.speedup > 0 for r in records)


def test_cli_bench_writes_tables_json_and_plots(model, tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "results"
    args = ["bench", "--model", str(folder), "--dataset", "gsm8k,typehints", "--n", "1", "--max-new-tokens", "5"]
    args += ["--methods", "plain,prompt_lookup,hf_prompt_lookup,trie[warm=1]", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "speed vs plain model.generate" in result.output and "trie[warm=1]" in result.output
    data = json.loads((out / "results.json").read_text())
    assert len(data["records"]) == 2 * 5 and data["settings"]["threads"] == 1
    # what the figures ran on: the weights and the machine (a CPU's name alone does not say its vector units)
    settings = data["settings"]
    assert settings["quantize"] is None and isinstance(settings["packed"], bool) and settings["date"]
    assert settings["machine_label"].startswith(device_name(torch.device("cpu")))
    units = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability())
    assert units is None or units in settings["machine_label"]
    assert set(data["summary"]) == {"gsm8k", "typehints"}
    assert "| trie[warm=1] |" in (out / "results.md").read_text()
    for png in ("speedup.png", "accepted_hist.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert not (out / PARTIAL).exists()  # the whole run is in results.json
    sampled = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "sampled"), "--sample"])
    assert sampled.exit_code == 0, sampled.output
    assert "n/a (sampled)" in (tmp_path / "sampled" / "results.md").read_text()


def test_a_run_cut_short_keeps_every_prompt_it_finished(model, tokenizer, tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    one = Run.one

    def dies_on_the_second_prompt(self, ids, spec, decoder, prompt, *rest):
        if prompt.id == "GSM8K/1":
            raise RuntimeError("a peer died")  # as a native crash would end the run there
        return one(self, ids, spec, decoder, prompt, *rest)

    monkeypatch.setattr(Run, "one", dies_on_the_second_prompt)
    out = tmp_path / "results"
    args = ["bench", "--model", str(folder), "--dataset", "gsm8k", "--n", "2", "--max-new-tokens", "5"]
    result = CliRunner().invoke(app, [*args, "--methods", "plain,prompt_lookup", "--out", str(out)])
    assert result.exit_code != 0 and not (out / "results.json").exists()
    kept = load_records(out / PARTIAL)  # what --include reads
    assert [(r.prompt_id, r.method) for r in kept] == [
        ("GSM8K/0", "generate"), ("GSM8K/0", "plain"), ("GSM8K/0", "prompt_lookup")
    ]  # fmt: skip
    assert json.loads((out / PARTIAL).read_text())["settings"]["n"] == 2


def test_latency_curve_shape_and_outputs(model, tmp_path):
    from forerun.cli import CURVE_SIZES

    assert CURVE_SIZES == ",".join(map(str, SIZES))  # `forerun curve` measures what the cost model measures
    curve = measure_curve(model, sizes=(1, 2, 4), context=16, repeats=2)
    assert curve.sizes == (1, 2, 4) and curve.relative(1) == 1.0
    assert all(s > 0 for s in curve.seconds)
    paths = write_curves({"fp32": curve, "copy": curve}, {"model": "tiny", "device": "cpu"}, tmp_path)
    data = json.loads(paths[0].read_text())
    assert set(data["curves"]) == {"fp32", "copy"} and data["curves"]["fp32"]["relative"][0] == 1.0
    assert paths[1].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        measure_curve(model, sizes=(0, 2))


def test_batched_curves_are_measured_plotted_and_stored_by_the_curve_command(model, tokenizer, tmp_path, monkeypatch):
    from forerun.latency import measure_batched

    batched = measure_batched(model, rows=(4, 2), sizes=(2, 4), context=8, repeats=1)
    assert [rows for rows, _ in batched] == [2, 4] and all(c.sizes == (1, 2, 4) for _, c in batched)
    curve = measure_curve(model, sizes=(1, 2, 4), context=8, repeats=1).with_batches(batched)
    paths = write_curves({"fp32": curve}, {"model": "tiny", "device": "cpu"}, tmp_path / "plot")
    assert set(json.loads(paths[0].read_text())["curves"]["fp32"]["batched"]) == {"2", "4"}
    assert paths[1].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="rows must be >= 2"):
        measure_batched(model, rows=(1,))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where the cost model's curves are kept
    kept = tmp_path / "home" / ".cache" / "forerun" / "latency"
    args = ["curve", "--model", str(folder), "--sizes", "1,2", "--repeats", "1", "--context", "8", "--rows", "2,3"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert "rows x tokens per row" in result.output
    stored = json.loads((tmp_path / "cli" / "latency.json").read_text())["curves"]["fp32"]
    assert set(stored["batched"]) == {"2", "3"}
    # other sizes, context or rows than the cost model measures: not its file (a curve of few sizes stops drafting)
    assert "not kept for the cost model" in " ".join(result.output.split()) and not kept.exists()
    result = CliRunner().invoke(app, ["curve", "--model", str(folder), "--repeats", "1", "--rows", "", "--out",
                                      str(tmp_path / "cli")])  # fmt: skip
    assert result.exit_code == 0, result.output
    (path,) = kept.glob("*.json")
    assert json.loads(path.read_text())["sizes"] == list(SIZES)
    if packable("cpu", torch.float32):  # load_model timed the layers laid out, with their row table
        assert list((tmp_path / "home" / ".cache" / "forerun" / "packed-rows").glob("float32-*.json"))


def test_the_curve_command_measures_and_stores_a_heads_forwards_by_rows(model, tokenizer, tmp_path):
    from eagle3_heads import write_head

    folder, head = tmp_path / "tiny", tmp_path / "head"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_head(head, model, hidden=32, vocab=len(tokenizer))
    args = ["curve", "--model", str(folder), "--sizes", "1,2", "--repeats", "1", "--context", "8", "--rows", "",
            "--draft-head", str(head), "--out", str(tmp_path / "cli")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "the EAGLE-3 head's forwards" in result.output
    stored = json.loads((tmp_path / "cli" / "head-costs.json").read_text())
    assert stored["head"] == str(head) and set(stored["fp32"]) == {"level", "read"}
    assert stored["fp32"]["level"]["sizes"][:4] == [1, 2, 3, 4]


def test_included_records_load_and_bad_files_are_refused(tmp_path):
    row = {"prompt_id": "GSM8K/0", "dataset": "gsm8k", "method": "lade[window=7]", "new_tokens": 9, "seconds": 1.0}
    path = tmp_path / "lade.json"
    path.write_text(json.dumps({"records": [{**row, "identical": False, "speedup": 0.5}]}))
    (record,) = load_records(path)
    assert record.method == "lade[window=7]" and record.speedup == 0.5
    assert mismatch_lines([record]) == ["lade[window=7] on GSM8K/0 differs from model.generate"]
    path.write_text('{"records": [{"nope": 1}]}')
    with pytest.raises(ValueError, match="not a benchmark results file"):
        load_records(path)
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "missing.json")


def test_edit_prompts_carry_their_prediction_and_predict_passes_it(model, tokenizer):
    prompt = load_dataset("edit", 1)[0]
    assert prompt.prediction and prompt.prediction in prompt.messages[0]["content"]
    (spec,) = parse_methods("prompt_lookup[predict=true]")
    assert spec.predict and spec.knobs == {}
    records = run_interleaved(model, tokenizer, [prompt], [spec], 6)
    assert records[1].identical and mismatch_lines(records) == []
    with pytest.raises(ValueError, match="predict=true is for forerun methods"):
        parse_methods("hf_prompt_lookup[predict=true]")


def test_cli_bench_batch_sizes_table_checks_every_row(model, tokenizer, tmp_path):
    """`--batch-size`: plain batched generate vs forerun at each size, every row checked against generate's."""
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "batched"
    args = ["bench", "--model", str(folder), "--dataset", "gsm8k,typehints", "--n", "2", "--max-new-tokens", "6"]
    result = CliRunner().invoke(
        app, [*args, "--methods", "prompt_lookup,auto", "--batch-size", "1,3", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "batched.json").read_text())
    rows = {(r["batch_size"], r["method"]): r for r in data["rows"]}
    assert set(rows) == {(b, m) for b in (1, 3) for m in ("generate", "prompt_lookup", "auto")}
    assert all(r["identical_rows"] == r["rows"] == 4 and r["beyond"] == [] for r in rows.values())
    assert "| 3 | auto |" in (out / "batched.md").read_text() and data["settings"]["refill"] is True
    chunked = CliRunner().invoke(
        app, [*args, "--methods", "auto", "--batch-size", "3", "--no-refill", "--rounds", "2", "--out", str(out)]
    )  # forerun decodes generate's very batches (3 + 1 prompts), the faster of two rounds
    assert chunked.exit_code == 0, chunked.output
    data = json.loads((out / "batched.json").read_text())
    assert data["settings"]["refill"] is False and all(r["identical_rows"] == r["rows"] == 4 for r in data["rows"])
    assert [r["method"] for r in data["rows"]] == ["generate", "auto"]
    bad = CliRunner().invoke(app, [*args, "--methods", "auto", "--batch-size", "2", "--rounds", "0"])
    assert bad.exit_code == 2 and "--rounds" in bad.output
    bad = CliRunner().invoke(app, [*args, "--methods", "hf_prompt_lookup", "--batch-size", "2"])
    assert bad.exit_code == 2 and "without a draft model" in bad.output
    bad = CliRunner().invoke(app, [*args, "--methods", "auto", "--batch-size", "0,x"])
    assert bad.exit_code == 2 and "--batch-size" in bad.output


def test_llama_cpp_methods_refuse_what_they_cannot_do(model, tokenizer):
    prompts = load_dataset("humaneval", 1)
    specs = parse_methods("llama_cpp,llama_cpp_lookup")
    with pytest.raises(ValueError, match="GGUF file"):
        run_interleaved(model, tokenizer, prompts, specs, 4)
    with pytest.raises(ValueError, match="greedy"):
        run_interleaved(model, tokenizer, prompts, specs, 4, sampling={"temperature": 0.7}, gguf="x.gguf")
    with pytest.raises(ValueError, match="predict=true is for forerun methods"):
        parse_methods("llama_cpp[predict=true]")
    for label in ("llama_cpp[draft_len=3]", "generate_bf16[max_tree_nodes=8]", "hf_prompt_lookup[warm=2]"):
        with pytest.raises(ValueError, match="takes no knobs"):
            parse_methods(label)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_generate_of_transformers_own_layers_is_timed_beside_the_run(model, tokenizer, dtype):
    """The baseline a user runs without forerun (of a --quantize run, or of a run on weights forerun laid out) is
    transformers' generate of the same model loaded again with its own layers: its new tokens are that model's own
    greedy ones, timed, never judged against the run's reference."""
    prompts = load_dataset("humaneval", 1)
    specs = parse_methods(f"generate_{dtype}")
    with pytest.raises(ValueError, match="loads the model again with transformers' own layers"):
        run_interleaved(model, tokenizer, prompts, specs, 4)
    (record,) = [r for r in run_interleaved(model, tokenizer, prompts, specs, 8, source="smollm2-135m")
                 if r.method == f"generate_{dtype}"]  # fmt: skip
    assert record.new_tokens == 8 and record.identical is None and record.seconds > 0
    dense, _ = load_model("smollm2-135m", attn_implementation="sdpa", dtype=dtype, pack=False)
    assert dense.dtype == DTYPES[dtype] and not packed(dense)
    ids = encode(tokenizer, prompts[0], torch.device("cpu"))
    expected = dense.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    peer = DenseGeneratePeer("smollm2-135m", dtype)
    assert not packed(peer.model) and peer.generate(ids[0].tolist(), 8, {tokenizer.eos_token_id})[0] == expected
    assert mismatch_lines([dataclasses.replace(record, identical=False)]) == []  # speed only


def test_llama_cpp_runs_beside_forerun_on_the_same_gguf(model, tokenizer):
    """The peer reads the model's own GGUF file; it is timed on the same prompt ids, its prompt lookup checked
    against its own plain output, and its texts never count as forerun's mismatches."""
    pytest.importorskip("llama_cpp", reason="the peers extra (llama-cpp-python) is not installed")
    prompts = load_dataset("humaneval", 1)
    specs = parse_methods("llama_cpp,llama_cpp_lookup")
    location, gguf_file = resolve("smollm2-135m")
    records = run_interleaved(model, tokenizer, prompts, specs, 16, gguf=f"{location}/{gguf_file}")
    peer = {r.method: r for r in records}
    assert peer["llama_cpp"].new_tokens > 0 and peer["llama_cpp"].identical is None
    assert peer["llama_cpp_lookup"].identical is True  # its prompt lookup writes its own plain text
    forged = [dataclasses.replace(peer["llama_cpp_lookup"], identical=False)]
    assert mismatch_lines(forged) == []
