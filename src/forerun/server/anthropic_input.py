"""An Anthropic Messages request (`/v1/messages`) as the chat request it stands for: `system` and the messages'
content blocks as chat messages (text, tool use and its results, thinking), its tools and `tool_choice` in chat's
shape, so one path (`translate`) decides every 400, each naming the field the client sent (`forerun.server.renaming`).

Example:
    >>> body = AnthropicRequest(max_tokens=16, system="Be brief.", messages=[
    ...     {"role": "user", "content": "What time is it?"},
    ...     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "now", "input": {}}]},
    ...     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon"}]}])
    >>> chat, rename = chat_request(body)
    >>> [(m.role, m.content) for m in chat.messages], rename.origins
    ([('system', 'Be brief.'), ('user', 'What time is it?'), ('assistant', None), ('tool', 'noon')], ['system', \
'messages[0]', 'messages[1]', 'messages[2]'])
"""

from __future__ import annotations

import json
from typing import Any

from forerun.server.fields import refuse
from forerun.server.renaming import Renaming
from forerun.server.schemas import AnthropicRequest, ChatRequest, CountTokensRequest

NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice",
    "response_format": "output_config.format",
}
"""Chat's field names in the errors `translate` raises, as Anthropic's API names them."""
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
"""Anthropic's `output_config.effort` as a template's `reasoning_effort` (OpenAI's scale ends at high)."""
TOOL_KEYS = {
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
    "strict",
    "defer_loading",
    "eager_input_streaming",
    "input_examples",
    "allowed_callers",
}
"""A client tool's keys: every tool is shown to the model (`defer_loading` defers nothing: no tool search here),
its input streams as it is written whatever `eager_input_streaming` says, and `input_examples` are not shown."""
BLOCK_KEYS = {"type", "text", "cache_control", "citations"}
"""A text block's keys: `cache_control` is taken and changes nothing (the prefix cache reads every shared head)."""


def chat_request(
    body: AnthropicRequest | CountTokensRequest, variables: frozenset[str] = frozenset()
) -> tuple[ChatRequest, Renaming]:
    """(the chat request `body` stands for, how its errors name the fields sent: its messages came from 'system'
    or 'messages[j]'), or an APIError naming the field that is wrong; `variables`: the chat template's
    (`thinking` sets its `enable_thinking` where it reads one)."""
    unsupported(body)
    messages, origins = messages_of(body)
    fields: dict[str, Any] = {"messages": messages, "tools": tools_of(body.tools),
                              "chat_template_kwargs": template_kwargs_of(body, variables)}  # fmt: skip
    fields |= tool_choice_of(body.tool_choice)
    fields |= format_of(body.output_config)
    last = messages[-1]
    if last["role"] == "assistant" and isinstance(last["content"], str) and last["content"].strip():
        if last["content"] != last["content"].rstrip():  # the template would drop it: Anthropic refuses it too
            where = f"{origins[-1]}.content"
            raise refuse(where, f"{where}: a final assistant content (a prefill) cannot end with whitespace")
        fields["continue_final_message"] = True  # Anthropic's prefill: the answer continues the assistant's text
    if isinstance(body, AnthropicRequest):
        fields |= {
            name: getattr(body, name) for name in ("model", "temperature", "top_p", "top_k", "stream", "forerun")
        }
        fields |= {"max_completion_tokens": body.max_tokens, "stop": body.stop_sequences}
    rename = Renaming(origins, NAMES, "messages")
    return rename.chat(fields), rename


def unsupported(body: AnthropicRequest | CountTokensRequest) -> None:
    """What this server cannot honour, refused by name: Anthropic's hosted containers and MCP servers (context
    edits are applied before, `forerun.server.context_edits`)."""
    if isinstance(body, AnthropicRequest):
        for name in ("container", "mcp_servers"):
            if getattr(body, name) is not None:
                raise refuse(name, f"{name} is not supported: this server runs a text model, with function tools")
        if body.service_tier not in (None, "auto", "standard_only"):
            raise refuse("service_tier", "service_tier takes 'auto' or 'standard_only' (one tier)")
    if body.speed not in (None, "standard", "fast"):  # one speed here: as fast as this machine decodes
        raise refuse("speed", "speed takes 'standard' or 'fast'")
    if set(body.output_config or {}) - {"effort", "format"}:
        unknown = sorted(set(body.output_config) - {"effort", "format"})
        raise refuse("output_config", f"output_config takes effort and format; {unknown} are not supported here")


def messages_of(body: AnthropicRequest | CountTokensRequest) -> tuple[list[dict], list[str]]:
    """The chat messages of `system` and the messages' blocks, with the field each came from: a user's tool
    results are tool messages (before the user's words), an assistant's blocks one message (its thinking the
    thought, its text the content, its tool uses the calls)."""
    messages: list[dict] = []
    origins: list[str] = []
    if body.system is not None:
        messages.append({"role": "system", "content": text_of("system", body.system)})
        origins.append("system")
    for j, message in enumerate(body.messages):
        where = f"messages[{j}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise refuse(where, f"{where} must be an object with a role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise refuse(f"{where}.role", f"{where}.role must be user or assistant, got {role!r:.40}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise refuse(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
        shaped = users_blocks(where, blocks) if role == "user" else [assistants_blocks(where, blocks)]
        messages += shaped
        origins += [where] * len(shaped)
    return messages, origins


def users_blocks(where: str, blocks: list) -> list[dict]:
    """A user's blocks as chat messages: each tool result a tool message, then the words (if any) a user's."""
    results, words = [], []
    for k, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append(tool_result(f"{where}.content[{k}]", block))
        else:
            words.append(text_of(f"{where}.content[{k}]", [block]))
    return [*results, *([{"role": "user", "content": "".join(words)}] if words or not results else [])]


def assistants_blocks(where: str, blocks: list) -> dict:
    """An assistant's blocks as one chat message: thinking as its thought, text as its content, tool uses as its
    calls (their input as JSON text, as chat's calls carry it)."""
    thoughts, words, calls = [], [], []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            ident, name, given = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(ident, str) or not isinstance(name, str) or not isinstance(given, dict):
                raise refuse(at, f"{at}: a tool_use block needs an id, a name and an input object")
            calls.append({"id": ident, "type": "function", "function": {"name": name, "arguments": json.dumps(given)}})
        else:
            words.append(text_of(at, [block]))
    message: dict = {"role": "assistant", "content": "".join(words) if words or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    return message


def tool_result(where: str, block: dict) -> dict:
    """A tool_result block as a tool message, with its call's id (an error's text as it is: the model reads it)."""
    if not isinstance(block.get("tool_use_id"), str) or set(block) - {"type", "tool_use_id", "content", "is_error",
                                                                       "cache_control"}:  # fmt: skip
        raise refuse(where, f"{where}: a tool_result block takes tool_use_id, content and is_error")
    content = block.get("content", "")
    return {"role": "tool", "content": text_of(f"{where}.content", content), "tool_call_id": block["tool_use_id"]}


def text_of(where: str, content: Any) -> str:
    """A string, or text blocks' texts joined (a system prompt's blocks apart by a blank line); images and
    documents refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise refuse(where, f"{where} must be a string or a list of text blocks")
    texts = []
    for k, block in enumerate(content):
        at = where if len(content) == 1 and where.endswith("]") else f"{where}[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            why = "this server runs a text-only model (send text blocks)"
            raise refuse(at, f"{at}: {kind!r:.40} blocks are not supported here: {why}")
        if not isinstance(block.get("text"), str) or set(block) - BLOCK_KEYS:
            raise refuse(at, f"{at}: a text block takes a string 'text' (and cache_control)")
        texts.append(block["text"])
    return ("\n\n" if where == "system" else "").join(texts)


def tools_of(tools: list | None) -> list[dict] | None:
    """Anthropic's client tools (`{"name", "description", "input_schema"}`) in chat's shape; its server tools (web
    search, code execution, a computer) refused by name."""
    if tools is None:
        return None
    shaped = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise refuse(where, f"{where}: {kind!r:.40} tools are not supported: this server offers client tools")
        unknown = sorted(set(tool) - TOOL_KEYS)
        if unknown:
            raise refuse(where, f"{where}: unrecognized field(s) {unknown}")
        if tool.get("allowed_callers") not in (None, ["direct"]):
            raise refuse(f"{where}.allowed_callers", f"{where}: only the model calls tools here (['direct'])")
        function = {"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("input_schema"), "strict": tool.get("strict")}  # fmt: skip
        shaped.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return shaped


def tool_choice_of(choice: dict | None) -> dict:
    """Anthropic's `tool_choice` as chat's `tool_choice` and `parallel_tool_calls`."""
    if choice is None:
        return {}
    kind = choice.get("type")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if kind not in ("auto", "any", "tool", "none") or unknown or (kind == "tool") != ("name" in choice):
        raise refuse("tool_choice", 'tool_choice takes {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}')
    shaped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        shaped = {"type": "function", "function": {"name": choice["name"]}}
    parallel = choice.get("disable_parallel_tool_use")
    return {"tool_choice": shaped, "parallel_tool_calls": None if parallel is None else not parallel}


def template_kwargs_of(body: AnthropicRequest | CountTokensRequest, variables: frozenset[str]) -> dict | None:
    """`chat_template_kwargs`, with `thinking` as the template's `enable_thinking` where the template reads one
    and the request does not set it itself (elsewhere the model thinks or not as it was taught); `budget_tokens`
    is not held: `max_tokens` bounds the whole answer, thought included."""
    kwargs = dict(body.chat_template_kwargs or {})
    effort = (body.output_config or {}).get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise refuse("output_config.effort", f"output_config.effort must be one of {', '.join(EFFORTS)}")
    if effort is not None and "reasoning_effort" in variables:  # gpt-oss's template reads one; high is its most
        kwargs.setdefault("reasoning_effort", EFFORTS[effort])
    thinking = body.thinking
    if thinking is None:
        return kwargs or None
    known = {"type", "budget_tokens", "display"}
    if thinking.get("type") not in ("enabled", "disabled", "adaptive") or set(thinking) - known:
        raise refuse("thinking", 'thinking takes {"type": "enabled", "budget_tokens"}, "adaptive" or "disabled"')
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise refuse("thinking.display", "thinking.display takes 'summarized' or 'omitted'")
    if "enable_thinking" in variables:
        kwargs.setdefault("enable_thinking", thinking["type"] != "disabled")
    return kwargs or None


def format_of(config: dict | None) -> dict:
    """`output_config.format` (`{"type": "json_schema", "schema"}`) as chat's `response_format`."""
    shape = (config or {}).get("format")
    if shape is None:
        return {}
    if not isinstance(shape, dict) or shape.get("type") != "json_schema" or set(shape) != {"type", "schema"}:
        raise refuse("output_config.format", 'output_config.format takes {"type": "json_schema", "schema": {...}}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": shape["schema"],
                                                                       "strict": True}}}  # fmt: skip
