"""A Responses API request (`/v1/responses`) as the chat request it stands for: `instructions` and the `input`
items as chat messages, its tools, `text.format` and `reasoning` in chat's shape, so one path (`translate`)
decides every 400, and each error names the Responses field the client sent (`forerun.server.renaming`).

Stateless, as vLLM's without its store: nothing is kept, so `previous_response_id`, `conversation`,
`item_reference` and `background` are refused by name; a client sends the conversation's items each time (the
OpenAI SDKs' `store=False` way, and Codex's).

Example:
    >>> body = ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ...                                {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
    ...                                {"type": "function_call_output", "call_id": "c1", "output": "noon"}],
    ...                         instructions="Be brief.", max_output_tokens=16)
    >>> chat, rename = chat_request(body)
    >>> [(m.role, m.content) for m in chat.messages], chat.max_completion_tokens, rename.origins
    ([('system', 'Be brief.'), ('user', 'Hi'), ('assistant', None), ('tool', 'noon')], 16, ['instructions', \
'input[0]', 'input[1]', 'input[2]'])
"""

from __future__ import annotations

import json
from typing import Any

from forerun.server.fields import refuse
from forerun.server.renaming import Renaming
from forerun.server.schemas import ChatRequest, ResponsesRequest

INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")
"""`include` values taken: the answer's log-probabilities, and reasoning items' encrypted content (there is none:
a thought comes as text, `encrypted_content` null), which clients that keep no store ask for."""
TEXT_PARTS = ("input_text", "output_text", "text")
RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "include",
}
"""Chat's field names in the errors `translate` raises, as the Responses API names them."""
NOT_STORED = "responses are not stored here: send the conversation's items in input"


def chat_request(body: ResponsesRequest) -> tuple[ChatRequest, Renaming]:
    """(the chat request `body` stands for, how its errors name the Responses fields: its messages came from
    'instructions' or 'input[j]'), or an APIError naming the Responses field that is wrong."""
    unsupported(body)
    messages, origins = messages_of(body)
    fields: dict[str, Any] = {
        name: getattr(body, name)
        for name in ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                     "logit_bias", "ignore_eos", "stop_token_ids", "min_tokens", "cache_salt", "chat_template_kwargs",
                     "forerun", "stream", "parallel_tool_calls", "metadata", "user")
    }  # fmt: skip
    fields |= {
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "tools": tools_of(body.tools),
        "tool_choice": tool_choice_of(body.tool_choice),
        "response_format": format_of(body.text),
        **logprobs_of(body),
        **reasoning_of(body.reasoning, body.chat_template_kwargs),
    }
    rename = Renaming(origins, RENAMED, "input")
    return rename.chat(fields), rename


def unsupported(body: ResponsesRequest) -> None:
    """The Responses fields this stateless server cannot honour, refused when set to anything but their no-op."""
    checks: list[tuple[str, bool, str]] = [
        ("previous_response_id", body.previous_response_id is not None, NOT_STORED),
        ("conversation", body.conversation is not None, NOT_STORED),
        ("background", bool(body.background), "background responses are not supported: nothing is stored"),
        ("prompt", body.prompt is not None, "stored prompts are not supported: send instructions and input"),
        ("max_tool_calls", body.max_tool_calls is not None, "max_tool_calls is not supported (parallel_tool_calls "
         "false makes one call at most)"),
        ("truncation", body.truncation not in (None, "disabled"),
         "truncation takes 'disabled' only: a prompt over the context is refused, not cut"),
        ("service_tier", body.service_tier not in (None, "auto", "default"),
         "service_tier takes 'auto' or 'default' (one tier)"),
    ]  # fmt: skip
    for name, refused, message in checks:
        if refused:
            raise refuse(name, message)
    for value in body.include or []:
        if value not in INCLUDES:
            raise refuse("include", f"include takes {', '.join(INCLUDES)}; got {value!r:.60}")
    options = body.stream_options
    if options is not None:
        if not body.stream:
            raise refuse("stream_options", "stream_options needs stream: true")
        if set(options) - {"include_obfuscation"} or options.get("include_obfuscation", False) is not False:
            raise refuse("stream_options", "stream_options takes include_obfuscation: false only (events unpadded)")


def messages_of(body: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """The chat messages of `instructions` and the input items, with the item each message came from: a
    function call joins the assistant's message before it (or opens one), a reasoning item's text is the thought
    of the assistant's message after it."""
    messages: list[dict] = []
    origins: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    thought: str | None = None
    for j, item in enumerate(items):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise refuse(where, f"{where} must be an object (a message or an item)")
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = reasoning_text(where, item)
            continue
        if kind == "function_call":
            call = function_call(where, item)
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and thought is None:  # the same turn: its words, then its calls
                last.setdefault("tool_calls", []).append(call)
                continue
            message: dict = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            message = tool_output(where, item)
        elif kind == "message":
            message = message_item(where, item)
        elif kind == "item_reference":
            raise refuse(where, f"{where}: {NOT_STORED}")
        else:
            raise refuse(f"{where}.type", f"{where}: {kind!r:.40} items are not supported (a text model's messages, "
                         "function calls and their outputs, reasoning)")  # fmt: skip
        if thought is not None and message["role"] == "assistant":
            message["reasoning_content"], thought = thought, None
        messages.append(message)
        origins.append(where)
    return messages, origins


def message_item(where: str, item: dict) -> dict:
    """A message item: its role and its content's text (input_text/output_text parts joined)."""
    unknown = sorted(set(item) - {"type", "role", "content", "id", "status", "phase"})
    if unknown:
        raise refuse(where, f"{where}: unrecognized field(s) {unknown}")
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise refuse(f"{where}.role", f"{where}.role must be user, system, developer or assistant, got {role!r:.40}")
    return {"role": role, "content": text_of(f"{where}.content", item.get("content"))}


def text_of(where: str, content: Any) -> str:
    """A content's text: a string, or its text parts joined (images, files and audio refused by name)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise refuse(where, f"{where} must be a string or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS:
            why = "this server runs a text-only model (send input_text parts)"
            raise refuse(f"{where}[{k}]", f"{where}[{k}]: {kind!r:.40} parts are not supported: {why}")
        if not isinstance(part.get("text"), str):
            raise refuse(f"{where}[{k}]", f"{where}[{k}]: a text part needs a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


def function_call(where: str, item: dict) -> dict:
    """A function call item as a chat tool call (its arguments JSON text, checked by `translate`)."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not all(isinstance(value, str) for value in (call_id, name, arguments)):
        raise refuse(where, f"{where}: a function_call needs call_id, name and arguments (JSON text), as strings")
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # json's decoder recurses per level: "[" * 100000 must not be a 500
        parsed = None
    if not isinstance(parsed, dict):
        raise refuse(f"{where}.arguments", f"{where}.arguments must be a JSON object's text")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_output(where: str, item: dict) -> dict:
    """A function call's output item as a tool message, with its call's id."""
    if not isinstance(item.get("call_id"), str):
        raise refuse(f"{where}.call_id", f"{where}: a function_call_output needs its call's call_id")
    output = text_of(f"{where}.output", item.get("output"))
    return {"role": "tool", "content": output, "tool_call_id": item["call_id"]}


def reasoning_text(where: str, item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise refuse(where, f"{where}: a reasoning item's content and summary are lists of parts with text")
    return "\n\n".join(part["text"] for part in parts)


def tools_of(tools: list | None) -> list[dict] | None:
    """Responses' function tools (`{"type": "function", "name", ...}`) in chat's shape; OpenAI's hosted tools
    (web search, files, computers) refused by name."""
    if tools is None:
        return None
    shaped = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise refuse(where, f"{where}: {kind!r:.40} tools are not supported: this server offers function tools")
        unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise refuse(where, f"{where}: unrecognized field(s) {unknown}")
        function = {key: value for key, value in tool.items() if key != "type" and value is not None}
        shaped.append({"type": "function", "function": function})
    return shaped


def tool_choice_of(choice: Any) -> Any:
    """Responses' `tool_choice` in chat's shape: a string as it is, `{"type": "function", "name"}` nested."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise refuse("tool_choice", 'tool_choice takes "none", "auto", "required" or {"type": "function", "name"}')
    return {"type": "function", "function": {"name": choice["name"]}}


def format_of(text: dict | None) -> dict | None:
    """`text.format` as chat's `response_format` (a json_schema format's fields nested under `json_schema`)."""
    if text is None:
        return None
    if set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
        raise refuse("text", "text takes format, and verbosity 'medium' only (an answer's length is the model's)")
    form = text.get("format")
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return form
    nested = {key: value for key, value in form.items() if key != "type"}
    return {"type": "json_schema", "json_schema": nested}


def logprobs_of(body: ResponsesRequest) -> dict:
    """Chat's `logprobs` and `top_logprobs`: asked by `include`'s 'message.output_text.logprobs'."""
    if "message.output_text.logprobs" not in (body.include or []):
        if body.top_logprobs not in (None, 0):
            raise refuse("top_logprobs", "top_logprobs needs include: ['message.output_text.logprobs']")
        return {}
    return {"logprobs": True, "top_logprobs": body.top_logprobs}


def reasoning_of(reasoning: dict | None, kwargs: dict | None) -> dict:
    """`reasoning.effort` as chat's `reasoning_effort` (checked by `translate` against the template); 'auto' and
    no summary taken, as a thought comes whole, never summarised."""
    if reasoning is None:
        return {}
    if set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise refuse("reasoning", f"reasoning takes effort and summary, got {sorted(reasoning)}")
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) not in (None, "auto"):
            raise refuse(f"reasoning.{name}", f"reasoning.{name} takes 'auto' only: a thought is sent whole, as text")
    return {} if reasoning.get("effort") is None else {"reasoning_effort": reasoning["effort"]}
