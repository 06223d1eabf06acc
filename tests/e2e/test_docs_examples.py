"""The Python examples of the README and the usage page run as written, on the embedded model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(path: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(encoding="utf-8"), re.S)


@pytest.mark.real_model
def test_the_readme_example_runs():
    (block,) = python_blocks("README.md")
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert scope["result"].text and len(scope["results"]) == 2


@pytest.mark.real_model
def test_the_usage_examples_run_in_order():
    blocks = python_blocks("docs/usage.md")
    scope: dict = {"prompts": ["Name a colour.", "Count to three.", "Say hi."]}
    for index in (0, 1, 2, 3, 4, 5):  # one prompt, many prompts, requests, JSON, scoring, tools (later: others)
        exec(compile(blocks[index], f"docs/usage.md block {index}", "exec"), scope)  # noqa: S102
    assert isinstance(scope["json"].loads(scope["result"].text)["answer"], int)
    assert scope["entries"][0] is None and len(scope["entries"]) == scope["whole"].shape[1]
    (call,) = scope["called"].tool_calls
    assert call.name == "get_weather" and scope["called"].finish_reason == "tool_calls" and scope["told"].content
    assert scope["result"].text and all(r.text for r in scope["results"])
    assert len(scope["results"]) == 3 and len(scope["requests"]) == 3 and scope["result"].finish_reason
