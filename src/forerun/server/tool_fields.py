"""A chat request's tool fields read and checked (`tools`, `tool_choice`, `parallel_tool_calls`, an assistant
message's `tool_calls`), each 400 naming its field. Whether the served model can take tools at all is its chat
template's (`forerun.tool_specs.takes_tools`): where it cannot, tools are refused by name.

Example:
    >>> body = ChatRequest(messages=[{"role": "user", "content": "Hi"}], tools=[{"type": "function",
    ...                    "function": {"name": "now"}}], tool_choice="required")
    >>> tools_of(body, takes=True)
    (({'type': 'function', 'function': {'name': 'now'}},), 'required', True)
    >>> tools_of(body, takes=False)
    Traceback (most recent call last):
    ...
    forerun.server.fields.APIError: tools are not supported by this model: its chat template does not teach tool ...
    >>> template_calls("messages[1]", [{"id": "call_1", "type": "function",
    ...                                 "function": {"name": "now", "arguments": "{}"}}])
    [{'id': 'call_1', 'type': 'function', 'function': {'name': 'now', 'arguments': {}}}]
"""

from __future__ import annotations

import json

from forerun.checks import MAX_DEPTH, nesting
from forerun.server.fields import refuse
from forerun.server.schemas import ChatRequest
from forerun.tool_specs import check_tool_choice, check_tools, held_calls

NO_TOOLS = (
    "this model: its chat template does not teach tool calls in a format forerun reads (<tool_call> blocks, "
    "Llama 3's JSON calls, or JSON calls after a special token, as Mistral's [TOOL_CALLS]; serve it with "
    "--chat-template FILE for one that does)"
)
MAX_CALLS = 128
"""Calls one assistant message may carry."""


def tools_of(body: ChatRequest, takes: bool) -> tuple[tuple[dict, ...], str, bool]:
    """(tools, tool_choice as one string, parallel_tool_calls) of a chat request (no tools: (), 'none', True);
    `takes`: whether the served chat template takes tools."""
    if body.tools and not takes and body.tool_choice != "none":
        raise refuse("tools", f"tools are not supported by {NO_TOOLS}")
    for i, message in enumerate(body.messages):
        if message.tool_calls and not takes:
            where = f"messages[{i}].tool_calls"
            raise refuse(where, f"{where}: tool calls cannot be shown to {NO_TOOLS}")
    try:
        tools = check_tools(body.tools)
    except ValueError as error:
        raise refuse("tools", str(error)) from None
    try:
        choice = check_tool_choice(body.tool_choice, tools)
    except ValueError as error:
        raise refuse("tool_choice", str(error)) from None
    if choice != "none" and body.response_format is not None and body.response_format.get("type") != "text":
        raise refuse("response_format", "tools and response_format cannot be used together: give one")
    if held_calls(tools, choice, True) is not None and body.ignore_eos and not body.stop_token_ids:
        raise refuse(
            "ignore_eos",
            "a required or strict tool call ends at an end-of-text token: with ignore_eos, give stop_token_ids",
        )
    return tools, choice, True if body.parallel_tool_calls is None else body.parallel_tool_calls


def template_calls(where: str, calls: list) -> list[dict]:
    """An assistant message's `tool_calls` (OpenAI's: arguments as JSON text) as chat templates take them (the
    arguments an object), or an APIError naming the first wrong one."""
    if len(calls) > MAX_CALLS:
        raise refuse(f"{where}.tool_calls", f"{where}.tool_calls holds {len(calls)} calls; at most {MAX_CALLS}")
    taken = []
    for j, call in enumerate(calls):
        name = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise refuse(name, f'{name} must be {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}')
        if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments", "{}"), str):
            raise refuse(name, f"{name}.function needs a name and its arguments as JSON text")
        try:
            arguments = json.loads(function.get("arguments", "{}"))
        except (ValueError, RecursionError):  # json's decoder recurses per level: "[" * 100000 must not be a 500
            arguments = None
        if not isinstance(arguments, dict):
            raise refuse(name, f"{name}.function.arguments must be a JSON object's text")
        if nesting(arguments) > MAX_DEPTH:
            raise refuse(name, f"{name}.function.arguments nest more than {MAX_DEPTH} levels")
        ident = call.get("id")
        taken.append({"id": ident if isinstance(ident, str) else f"call_{j}", "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return taken
