"""`forerun run`: a JSONL file of prompts through batched decoding, resumable, and sharded under torchrun.

Input rows: `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`, with optional per-row settings that
override the command's (`max_new_tokens`, `chat`, `stop`, `do_sample`, `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `frequency_penalty`, `presence_penalty`, `seed`; the penalties act on greedy rows too;
`response_format`, OpenAI's, for JSON answers; `tools` and `tool_choice`, OpenAI's, for calls; `chat_template_kwargs`,
variables the chat template reads, such as Qwen3's `enable_thinking`; `continue_final_message`, the last message an
assistant's words that the answer continues).
Output rows: `{"id", "text", "tokens", "prompt_tokens", "stats"}`, one per record, and `"tool_calls"` (each
`{"name", "arguments"}`, the arguments as JSON text) where the record offered tools, `"reasoning"` and `"content"`
where a reasoning model thought first (`forerun.thoughts`: the thought, and the answer after it);
`text` ends before the first stop string, as the server's answers do.

Batching: every record is its own `GenerationRequest`, so records with different settings (greedy beside sampled,
short beside long) decode together, at most `--batch-size` rows at once; a finished row's place goes to the next
record at once (continuous batching), so no row waits for the slowest of its batch.

Crash safety: every finished record is appended and flushed at once, so a crash loses only the records in flight;
a rerun reads what is there (a torn last line is dropped) and skips those ids. A record the decoder refuses (a
prompt beyond the model's context, a bad setting) gets `{"id", "error"}` without costing its batchmates anything,
and is tried again by a rerun. When every record is done the file
is rewritten in input order (a temporary file renamed over it).

Under `torchrun --nproc-per-node N` (and `--nnodes` for several machines) each rank takes the pending records at
positions rank, rank + N, ... and appends to its own part file `OUT.partR-of-N`; once every rank is done (a
torch.distributed barrier: gloo on CPU, nccl on GPU), rank 0 merges the parts into OUT in input order.

Example:
    >>> line = '{"id": 7, "prompt": "Hi", "do_sample": true, "temperature": 0.5}'
    >>> record = parse_record(line, 3, {"max_new_tokens": 64})
    >>> record.ident, record.settings["max_new_tokens"], record.settings["temperature"]
    ('7', 64, 0.5)
    >>> parse_record('{"id": 1, "prompt": "Hi", "colour": "red"}', 4, {})
    Traceback (most recent call last):
    ...
    ValueError: line 4: unknown field(s) ['colour']
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from forerun.checks import check_number, offset_seed
from forerun.penalties import REQUEST_FIELDS as PENALTY_FIELDS
from forerun.request import GenerationRequest

SETTINGS = ("max_new_tokens", "chat", "stop", "do_sample", "temperature", "top_p", "top_k", "min_p",
            "repetition_penalty", *PENALTY_FIELDS, "seed", "response_format", "tools", "tool_choice",
            "chat_template_kwargs", "continue_final_message")  # fmt: skip
"""Per-row settings a record may carry (they override the command's)."""


@dataclass(frozen=True)
class Record:
    """One input row."""

    ident: str
    """The row's id, as a string (ids 7 and "7" are the same record)."""
    position: int
    """Index among the valid records, in input order."""
    prompt: str | list[dict]
    settings: dict

    def request(self) -> GenerationRequest:
        """The record's `GenerationRequest`. A sampled record draws from seed + its position among the input's
        records, whichever records are left to do; the command's sampling settings do not act on a record that turns
        sampling off (`"do_sample": false`)."""
        settings = dict(self.settings)
        max_new_tokens, chat = settings.pop("max_new_tokens"), settings.pop("chat", False)
        stop, seed = settings.pop("stop", None), settings.pop("seed", None)
        penalties = {k: settings.pop(k) for k in PENALTY_FIELDS if k in settings}
        response_format = settings.pop("response_format", None)
        tools, tool_choice = settings.pop("tools", None), settings.pop("tool_choice", None)
        template_kwargs = settings.pop("chat_template_kwargs", None)
        continued = settings.pop("continue_final_message", False)
        generation = {k: v for k, v in settings.items() if v is not None}
        do_sample = bool(generation.pop("do_sample", False))
        if not do_sample:  # the command's sampling settings idle; a repetition penalty acts on greedy rows too
            generation = {k: v for k, v in generation.items() if k not in SAMPLING_ONLY}
        return GenerationRequest(
            self.prompt,
            max_new_tokens,
            chat=chat,
            stop=stop or (),
            do_sample=do_sample,
            seed=None if seed is None else offset_seed(seed, self.position),
            generation=generation,
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
            chat_template_kwargs=template_kwargs,
            continue_final_message=continued,
            **{k: v for k, v in penalties.items() if v is not None},  # request fields, not transformers settings
        )


def parse_record(line: str, number: int, defaults: dict, position: int = 0) -> Record:
    """A JSONL line -> Record; a ValueError names the line number and what is wrong."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"line {number}: invalid JSON ({error.msg})") from None
    except RecursionError:  # json's decoder recurses per nesting level: '[' * 100000 would end the whole run
        raise ValueError(f"line {number}: invalid JSON (nested too deeply)") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"line {number}: invalid JSON ({error})") from None
    if not isinstance(row, dict):
        raise ValueError(f"line {number}: a record must be a JSON object")
    try:  # JSON may spell lone surrogates ("\ud800"): no output file could hold them, so no record may
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"line {number}: holds a lone surrogate ({error.object[error.start]!r}), not text") from None
    unknown = sorted(set(row) - {"id", "prompt", "messages", *SETTINGS})
    if unknown:
        raise ValueError(f"line {number}: unknown field(s) {unknown}")
    ident = row.get("id")
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or str(ident) == "":
        raise ValueError(f"line {number}: 'id' must be a non-empty string or an integer")
    if ("prompt" in row) == ("messages" in row):
        raise ValueError(f"line {number}: give exactly one of 'prompt' (text) and 'messages' (chat)")
    prompt = row.get("prompt", row.get("messages"))
    if "prompt" in row and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError(f"line {number}: 'prompt' must be a non-empty string")
    if "messages" in row and (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(m, dict) and (isinstance(m.get("content"), str) or m.get("tool_calls")) for m in prompt)
    ):
        raise ValueError(f"line {number}: 'messages' must be a list of {{role, content}} objects")
    for flag in ("chat", "do_sample"):
        if flag in row and not isinstance(row[flag], bool):
            raise ValueError(f"line {number}: '{flag}' must be true or false, got {json.dumps(row[flag])[:40]}")
    check_types(row, number)
    settings = {**defaults, **{k: row[k] for k in SETTINGS if k in row}}
    check_sampled(row, bool(settings.get("do_sample")), number)
    if "messages" in row:
        settings["chat"] = True
    return Record(str(ident), position, prompt, settings)


def check_types(row: dict, number: int) -> None:
    """Each setting of the record has its JSON type (null: the command's), checked here with the line's number;
    ranges are the decoder's to check."""

    def bad(name: str, what: str) -> ValueError:
        return ValueError(f"line {number}: '{name}' must be {what}, got {json.dumps(row[name])[:40]}")

    for name in ("temperature", "top_p", "min_p", "repetition_penalty", *PENALTY_FIELDS):
        if row.get(name) is not None:
            try:
                check_number(name, row[name])
            except ValueError:
                raise bad(name, "a finite number") from None
    for name in ("max_new_tokens", "top_k", "seed"):
        value = row.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(name, "an integer")
    stop = row.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise bad("stop", "a string or a list of strings")


SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p", "seed")
"""Settings that act only on sampled decoding (the penalties act on greedy decoding too)."""


def check_sampled(row: dict, do_sample: bool, number: int) -> None:
    """A ValueError naming the record's sampling settings where it decodes greedily (neither it nor the command
    sets do_sample): greedy decoding would ignore them and the user would never learn why nothing changed, so they
    are refused as `forerun generate --temperature` without `--sample` and `generate(temperature=...)` are.

    Example:
        >>> check_sampled({"temperature": 0.7}, False, 3)
        Traceback (most recent call last):
        ...
        ValueError: line 3: 'temperature' given without "do_sample": true: greedy decoding takes the likeliest token \
(add "do_sample": true to the record, or --sample to the command)
    """
    given = [name for name in SAMPLING_ONLY if row.get(name) is not None]
    if given and not do_sample:
        names = ", ".join(f"'{name}'" for name in given)
        raise ValueError(
            f'line {number}: {names} given without "do_sample": true: greedy decoding takes the likeliest token '
            '(add "do_sample": true to the record, or --sample to the command)'
        )


def read_records(path: str | Path, defaults: dict) -> tuple[list[Record], list[str]]:
    """Every valid record of the file, and one message per bad line (the others still run)."""
    records, problems, seen = [], [], set()
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:  # a byte order mark opens files saved by some Windows editors
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                problems.append(f"line {number}: not UTF-8 (byte {error.start} of the line)")
                continue
            if not line.strip():
                continue
            try:
                record = parse_record(line, number, defaults, len(records))
            except ValueError as error:
                problems.append(str(error))
                continue
            if record.ident in seen:
                problems.append(f"line {number}: id {record.ident!r} appears again (ignored)")
                continue
            seen.add(record.ident)
            records.append(record)
    return records, problems


def finished_rows(path: Path, repair: bool = False) -> dict[str, dict]:
    """id -> output row of a results file (or part file); a torn last line (a crash mid-write) is ignored, and
    with `repair` cut off the file (only a file this process is about to append to: another rank may be writing
    the others)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) != len(data):
        with open(path, "r+b") as handle:  # drop the torn tail so appends start on a fresh line
            handle.truncate(len(complete))
    rows = {}
    for number, raw in enumerate(complete.splitlines(), start=1):
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path}: line {number} is not UTF-8 (byte {error.start} of the line); fix or remove that line to "
                "resume, or write the results elsewhere"
            ) from None
        except (ValueError, RecursionError):  # a line that is not a result (a torn or foreign one): done again
            continue
        if isinstance(row, dict) and "id" in row:
            rows[str(row["id"])] = row
    return rows


def part_files(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.part*-of-*"))


def check_writable(out: Path) -> None:
    """Fail now (before a model loads) if the results file cannot be written."""
    if out.exists() and out.is_dir():
        raise ValueError(f"output {out} is a folder; give a file path")
    folder = out.resolve().parent
    if not folder.is_dir():
        raise ValueError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"output {out} cannot be written (permission denied)")


def merge_results(out: Path, records: list[Record]) -> int:
    """Write OUT with every finished row in input order (atomic rename), then delete the part files."""
    rows = finished_rows(out)  # called once every writer is done
    parts = part_files(out)
    for part in parts:
        rows.update(finished_rows(part))
    order = {record.ident: record.position for record in records}
    ordered = sorted(rows.values(), key=lambda row: (order.get(str(row["id"]), len(order)), str(row["id"])))
    temporary = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    with open(temporary, "w", encoding="utf-8") as handle:
        for row in ordered:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(temporary, out)
    for part in parts:
        part.unlink()
    return len(ordered)


def decode_records(decoder, records: list[Record], batch_size: int) -> Iterator[dict]:
    """Output rows for the records, each yielded as soon as its record is done (finishing order): at most
    `batch_size` rows decode at once, a finished row's place going to the next record (`Decoder.generate_each`),
    each row with its own settings.

    A record the decoder refuses (a prompt longer than the model's context, ids outside the vocabulary, a bad
    setting) gets `{"id", "error"}` without costing the others anything.
    """
    admitted, requests = [], []
    for record in records:
        try:
            request = record.request()
            shown = {"tools": request.shown_tools, "template_kwargs": request.chat_template_kwargs,
                     "continued": request.continue_final_message}  # fmt: skip
            ids = decoder.check_prompt(record.prompt, request.max_new_tokens, request.chat, **shown)
            if request.held_format is not None:  # a schema no grammar holds fails its record here, not the run
                decoder.grammars.compile(request.held_format, ids[0].tolist())
            # encoded once, here; a record with tools keeps its messages, which show them (its calls are read back
            # by the tools it was asked with)
            encoded = replace(request, prompt=ids, chat_template_kwargs=None, continue_final_message=False)
            requests.append(request if request.shown_tools else encoded)
            admitted.append(record)
        except ValueError as error:
            yield {"id": record.ident, "error": str(error)}
    if not admitted:
        return
    for index, result in decoder.generate_each(requests, batch_size=batch_size):
        yield output_row(admitted[index], result)


def output_row(record: Record, result) -> dict:
    """{"id", "text", "tokens", "prompt_tokens", "stats"} of one decoded record. `text` ends where the first stop
    string begins (as the server's answers do); `tokens` are every token generated, the one that completed the stop
    string included; `tool_calls` where the record offered tools; `reasoning` and `content` where the model
    thought first."""
    extra = {}
    if result.tool_calls is not None:
        extra = {"tool_calls": [{"name": call.name, "arguments": call.arguments} for call in result.tool_calls]}
    if result.thought is not None:  # a reasoning model's thought, apart from its answer
        extra |= {"reasoning": result.reasoning, "content": result.content}
    return {
        "id": record.ident,
        "text": result.shown_text if result.text is not None else None,
        "tokens": result.new_tokens,
        "prompt_tokens": result.prompt_len,
        "stats": {
            "forwards": result.stats.forwards,
            "tokens_per_forward": round(result.stats.tokens_per_forward, 3),
            "acceptance": round(result.stats.acceptance_rate, 3),
            "seconds": round(result.stats.total_seconds, 3),
        },
        **extra,
    }


@dataclass(frozen=True)
class Shard:
    """This process's share of the work: rank r of n takes pending positions r, r + n, ..."""

    rank: int = 0
    world: int = 1

    def take(self, records: list[Record]) -> list[Record]:
        return records[self.rank :: self.world]

    def output(self, out: Path) -> Path:
        return out if self.world == 1 else out.with_name(f"{out.name}.part{self.rank}-of-{self.world}")

    def label(self) -> str:
        """How messages name this shard: 'rank 1/4 ' under torchrun, '' alone."""
        return f"rank {self.rank}/{self.world} " if self.world > 1 else ""


def pending_records(records: list[Record], out: Path) -> list[Record]:
    """The records not yet in OUT or any part file (read only: call it on every rank before any rank writes).
    A record whose row is an error (a refused prompt) is tried again: the input may have been fixed since."""
    rows = finished_rows(out)
    for part in part_files(out):
        rows.update(finished_rows(part))
    done = {ident for ident, row in rows.items() if "error" not in row}
    return [record for record in records if record.ident not in done]


def run_records(
    decoder,
    pending: list[Record],
    out: Path,
    batch_size: int,
    shard: Shard = Shard(),
    on_row: Callable[[dict], None] | None = None,
) -> int:
    """Decode this shard's share of `pending`, appending (and syncing) each record's row the moment it is done,
    so a crash loses only the rows in flight. `on_row` sees each row once it is on disk.

    Returns the number of records decoded.
    """
    target = shard.output(out)
    finished_rows(target, repair=True)
    decoded = 0
    with open(target, "a", encoding="utf-8") as handle:
        for row in decode_records(decoder, shard.take(pending), batch_size):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
            decoded += 1
            if on_row is not None:
                on_row(row)
    return decoded
