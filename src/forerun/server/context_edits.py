"""Anthropic's context editing (a Messages request's `context_management`, which Claude Code sends), done here as
Anthropic's API does it, before the prompt is rendered: the oldest tool results replaced by a placeholder once the
prompt grows past a threshold (`clear_tool_uses_20250919`), and older turns' thinking dropped
(`clear_thinking_20251015`). The client keeps its whole history; the answer says what was cleared
(`applied_edits`). Server-side compaction (`compact_20260112`, a summary the model writes) is refused by name.

Example (three tool uses, the two most recent kept; the prompt's tokens counted by `count`):
    >>> use = lambda i: {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "ls",
    ...                                                   "input": {}}]}
    >>> result = lambda i: {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
    ...                                                 "content": "a.py b.py"}]}
    >>> messages = [{"role": "user", "content": "Look."}, *[m for i in range(3) for m in (use(i), result(i))]]
    >>> edits = edits_of({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 2},
    ...                              "trigger": {"type": "tool_uses", "value": 2}}]})
    >>> edited, applied = apply_edits(messages, edits, count=lambda ms: sum(len(str(m)) for m in ms) // 4)
    >>> edited[2]["content"][0]["content"], applied[0]["cleared_tool_uses"]
    ('[This tool result was cleared to save context.]', 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forerun.server.fields import refuse

PLACEHOLDER = "[This tool result was cleared to save context.]"
"""What a cleared tool result says, so that the model knows a result was there."""
WHERE = "context_management"
MAX_EDITS = 8
"""Edits one request may ask for (Anthropic's API has two kinds, each given once)."""


@dataclass(frozen=True)
class ClearToolUses:
    """`clear_tool_uses_20250919`: once `trigger` (input tokens, or tool uses) is passed, every tool use's result
    but the `keep` most recent ones' (and those of `exclude`d tools) is the placeholder, and their inputs emptied
    where `clear_inputs` says (True: all; names: those tools'); not at all unless `clear_at_least` tokens go."""

    trigger: tuple[str, int] = ("input_tokens", 100_000)
    keep: int = 3
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False


@dataclass(frozen=True)
class ClearThinking:
    """`clear_thinking_20251015`: thinking blocks are kept in the `keep` most recent assistant turns (None: all)."""

    keep: int | None = 1


Edit = ClearToolUses | ClearThinking


def edits_of(config: Any) -> tuple[Edit, ...]:
    """The edits of a request's `context_management` (None: none), or a 400 naming the field that is wrong."""
    if config is None:
        return ()
    if not isinstance(config, dict) or set(config) - {"edits"} or not isinstance(config.get("edits", []), list):
        raise refuse(WHERE, f'{WHERE} takes {{"edits": [...]}}')
    if len(config.get("edits", [])) > MAX_EDITS:  # each edit reads every message: a bound, not a loop to order
        raise refuse(f"{WHERE}.edits", f"{WHERE}.edits takes at most {MAX_EDITS} edits")
    return tuple(edit_of(f"{WHERE}.edits[{i}]", edit) for i, edit in enumerate(config.get("edits", [])))


def edit_of(where: str, edit: Any) -> Edit:
    kind = edit.get("type") if isinstance(edit, dict) else None
    if kind == "clear_thinking_20251015":
        unknown(where, edit, {"type", "keep"})
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all" or keep == {"type": "all"}:
            return ClearThinking(None)
        return ClearThinking(amount(f"{where}.keep", keep, ("thinking_turns",))[1])
    if kind == "clear_tool_uses_20250919":
        unknown(where, edit, {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"})
        trigger = amount(f"{where}.trigger", edit.get("trigger", {"type": "input_tokens", "value": 100_000}),
                         ("input_tokens", "tool_uses"))  # fmt: skip
        keep = amount(f"{where}.keep", edit.get("keep", {"type": "tool_uses", "value": 3}), ("tool_uses",))[1]
        least = edit.get("clear_at_least")
        least = 0 if least is None else amount(f"{where}.clear_at_least", least, ("input_tokens",))[1]
        exclude = names(f"{where}.exclude_tools", edit.get("exclude_tools") or [])
        inputs = edit.get("clear_tool_inputs") or False
        if not isinstance(inputs, bool):
            inputs = names(f"{where}.clear_tool_inputs", inputs)
        return ClearToolUses(trigger, keep, least, exclude, inputs)
    if kind == "compact_20260112":
        raise refuse(f"{where}.type", f"{where}: compaction (a summary the model writes) is not done here")
    raise refuse(f"{where}.type", f"{where}.type must be clear_tool_uses_20250919 or clear_thinking_20251015")


def unknown(where: str, edit: dict, known: set[str]) -> None:
    if extra := sorted(set(edit) - known):
        raise refuse(where, f"{where}: unrecognized field(s) {extra}")


def amount(where: str, value: Any, kinds: tuple[str, ...]) -> tuple[str, int]:
    """(kind, value) of `{"type": kind, "value": n}` with kind one of `kinds` and n a count; else a 400."""
    if not isinstance(value, dict) or set(value) != {"type", "value"} or value["type"] not in kinds:
        raise refuse(where, f'{where} takes {{"type": {" | ".join(map(repr, kinds))}, "value": n}}')
    count = value["value"]
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 2**31:
        raise refuse(f"{where}.value", f"{where}.value must be a whole number from 0, got {count!r:.40}")
    return value["type"], count


def names(where: str, value: Any) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value) or len(value) > 1000:
        raise refuse(where, f"{where} must be a list of tool names")
    return frozenset(value)


def apply_edits(messages: list, edits: tuple[Edit, ...], count: Callable[[list], int]) -> tuple[list, list[dict]]:
    """(the messages with `edits` applied in order, the report of each edit that cleared something), the
    request's own messages left as they are (edited ones are copies). `count(messages)`: the prompt's tokens
    with those messages (the system prompt and tools as the request gives them)."""
    known: dict[int, tuple[list, int]] = {}  # each list's count, the list held so that its id stays its own

    def counted(these: list) -> int:
        if id(these) not in known:
            known[id(these)] = (these, count(these))
        return known[id(these)][1]

    applied = []
    for edit in edits:
        before = messages
        if isinstance(edit, ClearThinking):
            messages, cleared = clear_thinking(messages, edit.keep)
            report = {"type": "clear_thinking_20251015", "cleared_thinking_turns": cleared}
        else:
            messages, cleared = clear_tool_uses(messages, edit, counted)
            report = {"type": "clear_tool_uses_20250919", "cleared_tool_uses": cleared}
        if cleared:
            applied.append({**report, "cleared_input_tokens": max(counted(before) - counted(messages), 0)})
    return messages, applied


def turns(messages: list) -> list[list[int]]:
    """The assistant turns: the indices of the assistant's messages from one user's words to the next (tool
    results between them are the same turn's)."""
    found: list[list[int]] = []
    fresh = True
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant":
            if fresh or not found:
                found.append([])
            found[-1].append(i)
            fresh = False
        elif role == "user" and not only_results(message.get("content")):
            fresh = True
    return found


def only_results(content: Any) -> bool:
    return isinstance(content, list) and bool(content) and all(block_type(b) == "tool_result" for b in content)


def block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def clear_thinking(messages: list, keep: int | None) -> tuple[list, int]:
    """`messages` with the thinking blocks of all but the `keep` most recent assistant turns dropped, and how many
    turns lost some."""
    if keep is None:
        return messages, 0
    edited, cleared = list(messages), 0
    old = turns(messages)[: -keep or None]
    for turn in old:
        dropped = False
        for i in turn:
            content = messages[i].get("content")
            if isinstance(content, list):
                kept = [b for b in content if block_type(b) not in ("thinking", "redacted_thinking")]
                if len(kept) < len(content):
                    edited[i], dropped = {**messages[i], "content": kept}, True
        cleared += dropped
    return edited, cleared


def clear_tool_uses(messages: list, edit: ClearToolUses, count: Callable[[list], int]) -> tuple[list, int]:
    """`messages` with the tool uses `edit` clears cleared (their results the placeholder), and how many; the
    messages as they were where the trigger is not passed or too few tokens would go."""
    uses = [(i, block) for i, message in enumerate(messages) if isinstance(message, dict)
            and message.get("role") == "assistant" and isinstance(message.get("content"), list)
            for block in message["content"] if block_type(block) == "tool_use"
            and isinstance(block.get("id"), str) and isinstance(block.get("name"), str)]  # fmt: skip
    kind, threshold = edit.trigger
    gone = [(i, block) for i, block in uses[: max(len(uses) - edit.keep, 0)] if block.get("name") not in edit.exclude]
    if not gone or (len(uses) if kind == "tool_uses" else count(messages)) <= threshold:
        return messages, 0
    ids = {block.get("id") for _, block in gone}
    inputs = {block.get("id") for _, block in gone if edit.clear_inputs is True
              or (edit.clear_inputs and block.get("name") in edit.clear_inputs)}  # fmt: skip
    edited = [cleared(message, ids, inputs) if isinstance(message, dict) else message for message in messages]
    if edit.clear_at_least and count(messages) - count(edited) < edit.clear_at_least:
        return messages, 0
    return edited, len(gone)


def cleared(message: dict, ids: set, inputs: set) -> dict:
    """`message` (a copy where it changes) with the results of tool uses `ids` the placeholder and the inputs of
    `inputs` emptied."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    blocks = []
    for block in content:
        if block_type(block) == "tool_result" and str_in(block.get("tool_use_id"), ids):
            block = {**block, "content": PLACEHOLDER}
            block.pop("is_error", None)
        elif block_type(block) == "tool_use" and str_in(block.get("id"), inputs):
            block = {**block, "input": {}}
        blocks.append(block)
    return message if blocks == content else {**message, "content": blocks}


def str_in(value: Any, names: set) -> bool:
    """Whether `value` is one of `names`' strings (a client's list or object is none of them, and not hashed)."""
    return isinstance(value, str) and value in names
