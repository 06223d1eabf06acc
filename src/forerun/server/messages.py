"""A chat request's messages as the chat template takes them: content parts joined, an assistant's tool calls
with their arguments as objects, a tool's answer with its call's id; every message checked, each 400 naming it.

Example:
    >>> chat_messages(ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    [{'role': 'user', 'content': 'Hi'}]
"""

from __future__ import annotations

from forerun.server.fields import checked, refuse
from forerun.server.schemas import ChatRequest, Message
from forerun.server.tool_fields import template_calls
from forerun.tool_specs import templates


def chat_messages(body: ChatRequest, developer: bool = False) -> list[dict]:
    """Messages as the chat template takes them: content parts joined, everything checked; `developer`: whether
    the template names OpenAI's developer role (`takes_developer`; where it does not, such messages are system
    messages: `as_system`)."""
    messages = [message_of(f"messages[{i}]", message) for i, message in enumerate(body.messages)]
    if all(not (m["content"] or "").strip() and "tool_calls" not in m for m in messages):
        raise refuse("messages", "every message's content is empty or only whitespace: there is nothing to answer")
    return messages if developer else as_system(messages)


def takes_developer(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template names the `developer` role (gpt-oss's does; most do not)."""
    return any("developer" in text for text in templates(tokenizer))


def as_system(messages: list[dict]) -> list[dict]:
    """OpenAI's `developer` messages (Codex sends its instructions so) as `system` ones, for a template that does
    not name that role: Qwen's refuse an unknown role, others drop it or write a role the model never saw. Where
    they lead the conversation with other system messages (a Responses request's `instructions`), the leading
    ones are one message, their texts apart by a blank line: many templates take a system message only first.

    Example:
        >>> as_system([{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use French."},
        ...            {"role": "user", "content": "Hi"}])
        [{'role': 'system', 'content': 'Be brief.\\n\\nUse French.'}, {'role': 'user', 'content': 'Hi'}]
    """
    leading = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), len(messages))
    merge = leading > 1 and any(m["role"] == "developer" for m in messages[:leading])
    shown = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if merge:
        return [{"role": "system", "content": "\n\n".join(m["content"] for m in shown[:leading])}, *shown[leading:]]
    return shown


def message_of(where: str, message: Message) -> dict:
    """One message as the chat template takes it: its role, its content (text parts joined; None only beside an
    assistant's tool calls), its calls, a tool's answer's call id."""
    if message.function_call:
        raise refuse(f"{where}.function_call", f"{where}: function_call is OpenAI's old form; send tool_calls")
    calls = None
    if message.tool_calls:
        if message.role != "assistant":
            raise refuse(f"{where}.tool_calls", f"{where}: only an assistant's message makes tool calls")
        calls = template_calls(where, message.tool_calls)
    content = message.content
    if isinstance(content, list):
        content = "".join(text_of(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    if content is None and not calls:
        raise refuse(f"{where}.content", f"{where}.content is missing")
    checked(f"{where}.content", content or "")
    entry = {"role": message.role, "content": content}
    if calls:
        entry["tool_calls"] = calls
    if (thought := thought_of(where, message)) is not None:
        entry["reasoning_content"] = thought
    if message.role == "tool" and message.tool_call_id is not None:
        entry["tool_call_id"] = checked(f"{where}.tool_call_id", message.tool_call_id)
    return entry


def text_of(where: str, part: dict) -> str:
    """A content part's text: text parts only, with nothing but their type and text."""
    kind = part.get("type")
    unknown = sorted(set(part) - {"type", "text"})
    if kind == "text" and unknown:  # e.g. cache_control: honoured nowhere, so refused, not dropped
        raise refuse(where, f"{where}: unrecognized field(s) {unknown}")
    if kind != "text":
        why = "this server runs a text-only model (send text parts only)"
        raise refuse(where, f"{where}: {kind!r} parts are not supported: {why}")
    if not isinstance(part.get("text"), str):
        raise refuse(where, f"{where}: a text part needs a string 'text'")
    return part["text"]


def thought_of(where: str, message: Message) -> str | None:
    """An assistant's thought sent back (`reasoning_content`, or `reasoning`: one, or both the same), as the
    chat template reads it (`reasoning_content`, Qwen3's name)."""
    named = {"reasoning_content": message.reasoning_content, "reasoning": message.reasoning}
    given = {name: value for name, value in named.items() if value is not None}
    if not given:
        return None
    if message.role != "assistant":
        raise refuse(f"{where}.{next(iter(given))}", f"{where}: only an assistant's message holds a thought")
    if len(set(given.values())) > 1:
        raise refuse(f"{where}.reasoning", f"{where}: reasoning and reasoning_content differ; send one")
    return checked(f"{where}.{next(iter(given))}", given.popitem()[1])
