"""`forerun run`: every record once, equal to single generation, resumable after a crash, sharded under torchrun."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import forerun
from forerun.cli import app
from forerun.runner import (
    Record,
    finished_rows,
    merge_results,
    output_row,
    parse_record,
    pending_records,
    read_records,
    run_records,
)
from forerun.stopping import first_stop

PROMPTS = [
    {"id": "pal", "prompt": "Write a Python function that checks whether a string is a palindrome."},
    {"id": 2, "messages": [{"role": "user", "content": "List the planets of the solar system."}]},
    {"id": "hash", "prompt": "Explain what a hash table is.", "max_new_tokens": 6},
    {"id": "add", "prompt": "Add type hints to: def add(a, b): return a + b"},
    {"id": "sea", "prompt": "Write a haiku about the sea."},
]
NEW_TOKENS = 12


def write_prompts(path: Path, rows: list[dict], bad_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(row) for row in rows]
    for i, bad in enumerate(bad_lines):
        lines.insert(1 + 2 * i, bad)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def expected_tokens(smollm2) -> dict[str, list[int]]:
    """Each record decoded alone with plain greedy generate (chat template on, as the run uses --chat)."""
    model, tokenizer = smollm2
    out = {}
    for row in PROMPTS:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        new = row.get("max_new_tokens", NEW_TOKENS)
        sequence = model.generate(ids["input_ids"], max_new_tokens=new, do_sample=False)
        out[str(row["id"])] = sequence[0, ids["input_ids"].shape[1] :].tolist()
    return out


def test_records_parse_with_line_numbers_and_each_has_its_own_request(tmp_path):
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS, ("{not json", '{"id": "pal", "prompt": "again"}'))
    records, problems = read_records(path, {"max_new_tokens": NEW_TOKENS, "chat": True})
    assert [r.ident for r in records] == ["pal", "2", "hash", "add", "sea"]
    assert problems == ["line 2: invalid JSON (Expecting property name enclosed in double quotes)",
                        "line 4: id 'pal' appears again (ignored)"]  # fmt: skip
    requests = [record.request() for record in records]  # each record its own request: one rolling batch for all
    assert [r.max_new_tokens for r in requests] == [NEW_TOKENS, NEW_TOKENS, 6, NEW_TOKENS, NEW_TOKENS]
    assert all(r.chat for r in requests)
    for bad, message in [
        ('{"prompt": "x"}', "'id'"),
        ('{"id": 1, "prompt": "x", "messages": []}', "exactly one"),
        ('{"id": 1, "prompt": "  "}', "non-empty"),
        ('{"id": 1, "messages": [{"role": "user"}]}', "messages"),
        ("[1, 2]", "JSON object"),
        # a type error names its line before anything else; JSON's 1e309 is Python's inf
        (
            '{"id": 1, "prompt": "x", "temperature": "hot"}',
            "line 9: 'temperature' must be a finite number, got \"hot\"",
        ),
        ('{"id": 1, "prompt": "x", "top_p": NaN}', "'top_p' must be a finite number, got NaN"),
        ('{"id": 1, "prompt": "x", "max_new_tokens": 1e309}', "'max_new_tokens' must be an integer, got Infinity"),
        ('{"id": 1, "prompt": "x", "top_k": 2.5}', "'top_k' must be an integer"),
        ('{"id": 1, "prompt": "x", "seed": true}', "'seed' must be an integer"),
        ('{"id": 1, "prompt": "x", "stop": 5}', "'stop' must be a string or a list of strings"),
        # greedy decoding would ignore them: refused, as `--temperature` without `--sample` is
        ('{"id": 1, "prompt": "x", "temperature": 0.7}', "line 9: 'temperature' given without \"do_sample\": true"),
        ('{"id": 1, "prompt": "x", "do_sample": false, "top_k": 5, "seed": 3}', "'top_k', 'seed' given without"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_record(bad, 9, {})
    sampled = '{"id": 1, "prompt": "x", "do_sample": true, "temperature": null, "top_k": 5}'
    assert parse_record(sampled, 9, {}).settings["top_k"] == 5
    # the command's --sample is the record's default; a record may still turn it off (the command's settings idle)
    assert parse_record('{"id": 1, "prompt": "x", "top_p": 0.9}', 9, {"do_sample": True}).settings["top_p"] == 0.9
    command = {"do_sample": True, "temperature": 0.7, "max_new_tokens": 4}
    greedy = parse_record('{"id": 1, "prompt": "x", "do_sample": false}', 9, command)
    assert greedy.request().generation == {} and not greedy.request().do_sample
    # the penalties act on a greedy record too (its repetition penalty was once dropped with the sampling settings)
    penalised = '{"id": 1, "prompt": "x", "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -1}'
    request = parse_record(penalised, 9, {"max_new_tokens": 4}).request()
    assert request.generation == {"repetition_penalty": 1.2} and not request.do_sample
    assert (request.frequency_penalty, request.presence_penalty) == (0.5, -1) and request.processed
    with pytest.raises(ValueError, match="'presence_penalty' must be a finite number"):
        parse_record('{"id": 1, "prompt": "x", "presence_penalty": "lots"}', 9, {})
    with pytest.raises(ValueError, match="frequency_penalty must be between -2 and 2, got 3"):
        parse_record('{"id": 1, "prompt": "x", "frequency_penalty": 3}', 9, {"max_new_tokens": 4}).request()
    formatted = '{"id": 1, "prompt": "x", "response_format": {"type": "json_object"}}'
    assert parse_record(formatted, 9, {"max_new_tokens": 4}).request().response_format == {"type": "json_object"}
    with pytest.raises(ValueError, match="response_format's type must be one of"):
        parse_record('{"id": 1, "prompt": "x", "response_format": {"type": "x"}}', 9, {"max_new_tokens": 4}).request()


def test_hostile_lines_are_reported_by_number_and_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [
        '\ufeff{"id": "bom", "prompt": "x"}',  # Notepad's UTF-8
        "[" * 100_000 + "]" * 100_000,  # json recurses per level: this raised RecursionError and ended the run
        '{"id": ' + "9" * 5000 + ', "prompt": "x"}',  # Python refuses integers of more than 4300 digits
        '{"id": "chat", "prompt": "x", "chat": "yes"}',
        '{"id": "sample", "prompt": "x", "do_sample": 1}',
        '{"id": "ok", "prompt": "x"}',
    ]
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    records, problems = read_records(path, {"max_new_tokens": 4})
    assert [r.ident for r in records] == ["bom", "ok"]
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3", "line 4", "line 5"]
    assert "nested too deeply" in problems[0] and "4300 digits" in problems[1]
    assert "'chat' must be true or false" in problems[2] and "'do_sample'" in problems[3]


def test_text_ends_before_the_stop_string_and_tokens_keep_all(tmp_path):
    def result(stops):
        text = "one. two. three"
        sequences = torch.tensor([[9, 9, 9, 9, 1, 2, 3]])
        return forerun.GenerationResult(
            sequences, 4, text, forerun.GenerationStats(), [], stop_at=first_stop(text, stops)
        )

    record = Record("a", 0, "x", {})
    assert output_row(record, result([". t", "three"]))["text"] == "one"
    assert output_row(record, result(["zz"]))["text"] == "one. two. three"
    assert output_row(record, result([]))["tokens"] == [1, 2, 3]


def test_a_torn_last_line_is_dropped_and_merge_keeps_input_order(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "b", "text": "B"}\n{"id": "a", "te', encoding="utf-8")
    assert list(finished_rows(out)) == ["b"] and out.read_text().endswith('"te')  # reading alone changes nothing
    assert list(finished_rows(out, repair=True)) == ["b"]
    assert out.read_text() == '{"id": "b", "text": "B"}\n'  # appends now start on a fresh line
    out.write_text('{"id": "b", "text": "B"}\n' + "[" * 100_000 + "\n" + "1" * 5000 + "\n")  # hostile lines: done again
    assert list(finished_rows(out)) == ["b"]
    out.write_text('{"id": "b", "text": "B"}\n')
    (tmp_path / "out.jsonl.part1-of-2").write_text('{"id": "a", "text": "A"}\n', encoding="utf-8")
    records = [Record("a", 0, "x", {}), Record("b", 1, "y", {})]
    assert merge_results(out, records) == 2
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert not list(tmp_path.glob("*.part*"))


@pytest.mark.real_model
def test_a_crash_midway_then_a_rerun_completes_without_duplicates(smollm2, tmp_path):
    model, tokenizer = smollm2
    decoder = forerun.Decoder(model, tokenizer, "auto")
    records, _ = read_records(
        write_prompts(tmp_path / "in.jsonl", PROMPTS), {"max_new_tokens": NEW_TOKENS, "chat": True}
    )
    out = tmp_path / "out.jsonl"

    class Crash(Exception):
        pass

    written = []

    def crash(row):
        written.append(row["id"])
        if len(written) == 2:
            raise Crash

    with pytest.raises(Crash):
        run_records(decoder, records, out, 2, on_row=crash)  # dies after its second row was written
    assert sorted(finished_rows(out)) == sorted(written)  # every row is on disk the moment it is done
    assert run_records(decoder, pending_records(records, out), out, 2) == 3  # the rest, nothing twice
    merge_results(out, records)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["pal", "2", "hash", "add", "sea"]
    expected = expected_tokens(smollm2)
    for row in rows:
        assert row["tokens"] == expected[row["id"]], row["id"]
        assert row["text"] == tokenizer.decode(row["tokens"], skip_special_tokens=True)
        assert row["stats"]["forwards"] >= 1


@pytest.mark.real_model
def test_bad_lines_are_reported_the_rest_runs_and_an_unwritable_output_stops_at_once(smollm2, tmp_path):
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2], ("oops",))
    out = tmp_path / "out.jsonl"
    frozen = gc.get_freeze_count()
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(out), "--chat", "-n", "4", "--threads", "2"])
    assert result.exit_code == 2
    assert gc.get_freeze_count() > frozen  # the run froze what its start-up made (conftest thaws it after the test)
    assert "line 2: invalid JSON" in result.output and "1 bad line(s)" in result.output
    assert sorted(finished_rows(out)) == ["2", "pal"]
    missing = CliRunner().invoke(app, ["run", str(path), "-o", str(tmp_path / "no" / "out.jsonl")])
    assert missing.exit_code == 2 and "does not exist" in missing.output and "Traceback" not in missing.output
    greedy = CliRunner().invoke(app, ["run", str(path), "-o", str(tmp_path / "greedy.jsonl"), "--top-p", "0.5"])
    assert greedy.exit_code == 2 and "--top-p given without --sample" in greedy.output  # not ignored silently
    assert not (tmp_path / "greedy.jsonl").exists()


@pytest.mark.real_model
def test_two_ranks_under_torchrun_write_every_record_once(smollm2, tmp_path):
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS)
    out = tmp_path / "out.jsonl"
    bin_dir = Path(sys.executable).parent
    command = [
        str(bin_dir / "torchrun"),
        "--nproc-per-node",
        "2",
        "--no-python",
        str(bin_dir / "forerun"),
        "run",
        str(path),
        "-o",
        str(out),
        "--chat",
        "--method",
        "auto",
        "-n",
        str(NEW_TOKENS),
        "--threads",
        "1",
        "--batch-size",
        "2",
    ]
    env = {**os.environ, "MASTER_PORT": "29531"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["pal", "2", "hash", "add", "sea"]
    expected = expected_tokens(smollm2)
    assert all(row["tokens"] == expected[row["id"]] for row in rows)
    assert not list(tmp_path.glob("*.part*"))


@pytest.mark.real_model
def test_a_refused_prompt_costs_only_its_own_record_and_bad_bytes_only_their_line(smollm2, tmp_path):
    model, tokenizer = smollm2
    long = {"id": "long", "prompt": "word " * 9000}  # more tokens than the model's 8192 positions
    path = tmp_path / "in.jsonl"
    lines = [json.dumps(PROMPTS[0]).encode(), b'{"id": "bytes", "prompt": "caf\xe9"}', json.dumps(long).encode()]
    path.write_bytes(b"\n".join([*lines, json.dumps(PROMPTS[1]).encode()]) + b"\n")
    records, problems = read_records(path, {"max_new_tokens": NEW_TOKENS, "chat": True})
    assert problems == ["line 2: not UTF-8 (byte 30 of the line)"]
    assert [record.ident for record in records] == ["pal", "long", "2"]
    out = tmp_path / "out.jsonl"
    assert run_records(forerun.Decoder(model, tokenizer, "auto"), records, out, 8) == 3  # refused one, and two
    rows = finished_rows(out)
    assert "context" in rows["long"]["error"] and "tokens" not in rows["long"]
    expected = expected_tokens(smollm2)
    assert rows["pal"]["tokens"] == expected["pal"] and rows["2"]["tokens"] == expected["2"]
    assert [record.ident for record in pending_records(records, out)] == ["long"]  # a rerun tries it again
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(out), "--chat", "-n", str(NEW_TOKENS)])
    assert result.exit_code == 2, result.output
    assert "refused: record long" in result.output and "1 record(s) refused" in result.output
    assert "line 2: not UTF-8" in result.output and "Traceback" not in result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["pal", "long", "2"]  # merged once


@pytest.mark.real_model
def test_sampled_records_draw_from_their_own_seeds_and_a_bad_seed_refuses_only_its_record(smollm2, tmp_path):
    """A sampled record's seed is the run's seed + its position in the file (not its place among the records
    left to do); a record whose seed the decoder refuses (negative) gets an error row, the others are decoded."""
    model, tokenizer = smollm2
    defaults = {"max_new_tokens": NEW_TOKENS, "chat": True, "do_sample": True, "temperature": 1.0, "seed": 11}
    rows = [row for row in PROMPTS if "max_new_tokens" not in row]
    records, _ = read_records(write_prompts(tmp_path / "in.jsonl", rows), defaults)
    seeds = []

    class Spy(forerun.Decoder):
        def generate_each(self, prompts, max_new_tokens=256, **options):
            seeds.append([request.seed for request in prompts])
            return super().generate_each(prompts, max_new_tokens, **options)

    out = tmp_path / "out.jsonl"
    run_records(Spy(model, tokenizer, "prompt_lookup"), records[2:], out, 4)  # as a rerun after two were done
    assert seeds == [[13, 14]]
    assert len({tuple(row["tokens"]) for row in finished_rows(out).values()}) == 2  # sampled, each its own
    bad, _ = read_records(write_prompts(tmp_path / "bad.jsonl", [{**rows[0], "seed": -1}, rows[1]]), defaults)
    out = tmp_path / "bad-out.jsonl"
    assert run_records(forerun.Decoder(model, tokenizer, "prompt_lookup"), bad, out, 4) == 2
    assert "seed" in finished_rows(out)[str(rows[0]["id"])]["error"]
    assert "tokens" in finished_rows(out)[str(rows[1]["id"])]


def test_lone_surrogates_in_a_record_are_its_own_problem(tmp_path):
    """JSON can spell a lone surrogate; no UTF-8 output file can hold one, and a rerun died at the same record."""
    path = tmp_path / "in.jsonl"
    lines = ['{"id": "\\ud800", "prompt": "x"}', '{"id": "a", "prompt": "caf\\udce9"}', '{"id": "ok", "prompt": "x"}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    records, problems = read_records(path, {"max_new_tokens": 4})
    assert [r.ident for r in records] == ["ok"]
    assert [p.split(":")[0] for p in problems] == ["line 1", "line 2"]
    assert all("lone surrogate" in p for p in problems)


def test_an_output_file_with_a_bad_byte_is_named_with_its_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "b", "text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"out.jsonl: line 2 is not UTF-8 \(byte 24 of the line\)"):
        finished_rows(out)


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(tmp_path):
    from tiny_models import tiny_model

    class Tokenizer:  # counts what it is asked to tokenize: nothing, here
        calls = 0

        def __len__(self):
            return 96

        def __call__(self, *args, **kwargs):
            Tokenizer.calls += 1
            raise AssertionError("tokenized")

    decoder = forerun.Decoder(tiny_model("llama"), Tokenizer(), "plain")  # context: 512 positions
    with pytest.raises(ValueError, match="prompt is 40,000 characters, more than the model's context \\(512 tokens\\)"):
        decoder.check_prompt("x" * 40_000, 4)
    with pytest.raises(ValueError, match="the messages' content is 40,000 characters"):
        decoder.check_prompt([{"role": "user", "content": "x" * 40_000}], 4)
    assert Tokenizer.calls == 0
