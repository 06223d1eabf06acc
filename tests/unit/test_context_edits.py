"""Anthropic's context edits (`forerun.server.context_edits`), as Claude Code asks for them: old tool results become
a placeholder past a threshold (the most recent kept, excluded tools' never), older turns' thinking goes, the
request's own messages are never changed, and a bad edit is a 400 naming its field."""

from __future__ import annotations

import copy

import pytest

from forerun.server.context_edits import PLACEHOLDER, ClearThinking, ClearToolUses, apply_edits, edits_of
from forerun.server.fields import APIError


def use(i: int, name: str = "ls") -> dict:
    thought = {"type": "thinking", "thinking": f"t{i}", "signature": ""}
    return {"role": "assistant", "content": [thought, {"type": "tool_use", "id": f"u{i}", "name": name,
                                                       "input": {"i": i}}]}  # fmt: skip


def result(i: int) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"u{i}", "content": "x" * 400,
                                         "is_error": True}]}  # fmt: skip


def chars(messages: list) -> int:
    """A stand-in for the prompt's tokens: its characters over four."""
    return len(str(messages)) // 4


CONVERSATION = [{"role": "user", "content": "Look around."}, use(0), result(0), use(1, "read"), result(1),
                use(2), result(2), {"role": "user", "content": "Now sum up."}, use(3), result(3)]  # fmt: skip


def results_of(messages: list) -> list[str]:
    return [b["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"]]  # fmt: skip


def test_old_tool_results_become_the_placeholder_past_the_trigger_the_recent_and_excluded_kept():
    sent = copy.deepcopy(CONVERSATION)
    edit = ClearToolUses(trigger=("input_tokens", 100), keep=2, exclude=frozenset({"read"}))
    edited, applied = apply_edits(sent, (edit,), chars)
    assert results_of(edited) == [PLACEHOLDER, "x" * 400, "x" * 400, "x" * 400]  # u1 excluded, u2 and u3 kept
    assert "is_error" not in edited[2]["content"][0] and edited[1]["content"][1]["input"] == {"i": 0}
    assert applied == [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1,
                        "cleared_input_tokens": chars(CONVERSATION) - chars(edited)}]  # fmt: skip
    assert sent == CONVERSATION  # the request's own messages are left as they are
    inputs = ClearToolUses(trigger=("tool_uses", 3), keep=1, clear_inputs=frozenset({"ls"}))
    edited, applied = apply_edits(sent, (inputs,), chars)
    assert results_of(edited) == [PLACEHOLDER] * 3 + ["x" * 400]
    assert [m["content"][1]["input"] for m in edited if m["role"] == "assistant"] == [{}, {"i": 1}, {}, {"i": 3}]
    assert applied[0]["cleared_tool_uses"] == 3


def test_nothing_is_cleared_below_the_trigger_or_where_too_few_tokens_would_go():
    for edit in (ClearToolUses(trigger=("input_tokens", 10**6)), ClearToolUses(trigger=("tool_uses", 4), keep=1),
                 ClearToolUses(trigger=("tool_uses", 0), keep=1, clear_at_least=10**6),
                 ClearToolUses(trigger=("tool_uses", 0), keep=9)):  # fmt: skip
        edited, applied = apply_edits(CONVERSATION, (edit,), chars)
        assert edited is CONVERSATION and applied == [], edit


def test_thinking_is_kept_in_the_last_turns_a_turn_running_across_its_tool_results():
    """Three tool uses answer the first question (one turn), the fourth the second: keeping one turn drops the
    first turn's thinking, keeping all drops none."""
    edited, applied = apply_edits(CONVERSATION, (ClearThinking(1),), chars)
    thoughts = [[b["thinking"] for b in m["content"] if b["type"] == "thinking"] for m in edited
                if m["role"] == "assistant"]  # fmt: skip
    assert thoughts == [[], [], [], ["t3"]] and applied[0]["cleared_thinking_turns"] == 1
    assert applied[0]["cleared_input_tokens"] > 0 and CONVERSATION[1]["content"][0]["type"] == "thinking"
    assert apply_edits(CONVERSATION, (ClearThinking(None),), chars) == (CONVERSATION, [])
    assert apply_edits(CONVERSATION, (ClearThinking(0),), chars)[1][0]["cleared_thinking_turns"] == 2


def test_edits_are_read_with_anthropics_defaults_and_bad_ones_name_their_field():
    claude_code = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                             {"type": "clear_tool_uses_20250919"}]}  # fmt: skip
    assert edits_of(claude_code) == (ClearThinking(None), ClearToolUses(("input_tokens", 100_000), 3))
    edit = {"type": "clear_tool_uses_20250919", "clear_tool_inputs": True}
    read = edits_of({"edits": [{**edit, "clear_at_least": {"type": "input_tokens", "value": 5}}]})
    assert read[0].clear_inputs is True and read[0].clear_at_least == 5
    assert edits_of(None) == () and edits_of({}) == ()
    bad = {
        "context_management": [],
        "context_management.edits": {"edits": [{"type": "clear_thinking_20251015"}] * 9},
        "context_management.edits[0].type": {"edits": [{"type": "compact_20260112"}]},
        "context_management.edits[1].type": {"edits": [{"type": "clear_thinking_20251015"}, {"type": "x"}]},
        "context_management.edits[0]": {"edits": [{"type": "clear_tool_uses_20250919", "placeholder": "-"}]},
        "context_management.edits[0].keep": {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]},
        "context_management.edits[0].trigger.value": {"edits": [{"type": "clear_tool_uses_20250919",
                                                                  "trigger": {"type": "tool_uses", "value": True}}]},
        "context_management.edits[0].exclude_tools": {"edits": [{"type": "clear_tool_uses_20250919",
                                                                 "exclude_tools": "ls"}]},
    }  # fmt: skip
    for field, config in bad.items():
        with pytest.raises(APIError) as refused:
            edits_of(config)
        assert refused.value.param == field and refused.value.status == 400, (field, refused.value.message)


def test_hostile_messages_are_left_for_the_request_check():
    """Messages that are not objects, blocks that are not, a tool use without an id: edits skip them and the
    request's own check refuses them later; nothing raises here."""
    odd = ["text", {"role": "assistant", "content": ["x", {"type": "tool_use"}]}, {"role": "user", "content": 5},
           {"role": "user"}, {"role": "assistant", "content": [{"type": "tool_use", "id": [1], "name": {}}]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": [1]}]}, *CONVERSATION]  # fmt: skip
    edits = (ClearToolUses(("tool_uses", 0), 0, exclude=frozenset({"x"}), clear_inputs=True), ClearThinking(0))
    edited, _ = apply_edits(odd, edits, chars)
    assert edited[0] == "text" and edited[2] == {"role": "user", "content": 5}
