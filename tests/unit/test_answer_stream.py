"""`forerun generate` shows its answer as it is written: whole characters, never a stop string or what follows it."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from forerun.chat import AnswerStream
from forerun.stopping import HeldText, first_stop


def shown_steps(tokenizer, text: str, stops: tuple[str, ...], per_put: int = 1) -> list[str]:
    """What the console holds after the prompt, after each put of `per_put` tokens of `text`, and after the end."""
    out = io.StringIO()
    stream = AnswerStream(Console(file=out, width=200), tokenizer, stops)
    stream.put(torch.tensor([[1, 2, 3]]))  # the prompt: never shown
    steps = [out.getvalue()]
    ids = tokenizer.encode(text, add_special_tokens=False)
    for start in range(0, len(ids), per_put):
        stream.put(torch.tensor(ids[start : start + per_put]))
        steps.append(out.getvalue())
    stream.end()
    return [*steps, out.getvalue()]


@pytest.mark.real_model
def test_an_answer_shows_while_it_is_written_and_ends_before_its_stop_string(smollm2):
    _, tokenizer = smollm2
    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))"
    steps = shown_steps(tokenizer, text, ("\n\n",))
    assert steps[0] == "" and steps[-1] == "def add(a, b):\n    return a + b\n"
    assert any(0 < len(step) < len(steps[-1]) - 1 for step in steps)  # shown piece by piece, not at the end
    assert all(later.startswith(earlier) for earlier, later in zip(steps, steps[1:], strict=False))
    assert "print" not in steps[-1]
    whole = shown_steps(tokenizer, "Café: naïve ☕ résumé", (), per_put=1)  # multi-byte characters, no stops
    assert whole[-1] == "Café: naïve ☕ résumé\n" and all("\ufffd" not in step for step in whole)


def test_held_text_holds_the_last_characters_a_stop_string_could_begin_with():
    held = HeldText(["END", "\n\n"])  # the longest stop less one: two characters held
    assert held.release("abcE") == "ab"
    assert held.release("abcEx") == "c"
    assert held.release("abcExEN") == "Ex"
    assert held.release("abcExENDzz") == "" and held.stopped  # "EN" began the stop: never shown
    assert held.release("abcExENDzz", final=True) == ""
    done = HeldText(["END"])
    assert done.release("abcE") == "ab" and done.release("abcE", final=True) == "cE"  # no stop came: all shown
    free = HeldText([])
    assert free.release("a") == "a" and free.release("ab") == "b" and free.release("ab", final=True) == ""


def test_the_earliest_stop_string_ends_the_answer_whichever_is_listed_first():
    """Two stop strings complete in the same text: the answer ends before the one that begins first, wherever
    each sits in the list (one arriving later in the text must not let the earlier one through)."""
    for stops in (["END", "\n\n"], ["\n\n", "END"]):
        held = HeldText(stops)
        assert held.release("one\n\ntwo END three", final=True) == "one", stops
        assert first_stop("one END two\n\n", stops) == 4
