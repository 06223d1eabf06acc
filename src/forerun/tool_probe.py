"""How a chat template writes an assistant's calls, read off what it renders of a probe call: for templates that
teach calls after a special token of the tokenizer's own rather than the spellings `forerun.tool_specs` knows by
sight (`<tool_call>` blocks, Llama 3's bare objects). Two shapes are read: JSON after the mark (Mistral v0.3's
`[TOOL_CALLS] [{"name": ..., "arguments": ...}]`, Granite's `<|tool_call|>[...]`, a `<TOOLCALL>[...]</TOOLCALL>`
pair of tokens of their own), and the name between two marks, then the arguments' JSON, each call after its own
opening mark (Mistral's newer `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`: Ministral 3, Devstral 2).

Such marks are tokens the decoded answer drops (`skip_special_tokens`), so what is left of the calls is bare JSON,
or names each followed by their arguments' JSON, which `forerun.tool_calls.read_calls` reads; a required call's
grammar spells the marks as those tokens (`forerun.tool_specs.call_form`). A template whose calls are neither
(pythonic calls), whose marks are text, or which writes OpenAI's nested objects back, is not taken: its tools are
refused by name.

Example:
    >>> template = ("{% for m in messages %}{% if m.role == 'user' %}{{ '[INST]' + m.content + '[/INST]' }}"
    ...     "{% elif m.tool_calls %}{{ '[TOOL_CALLS] ' + (m.tool_calls | map(attribute='function') | list | tojson) }}"
    ...     "{{ '</s>' }}{% else %}{{ m.content + '</s>' }}{% endif %}{% endfor %}")
    >>> written = written_calls(lambda messages: rendered(template, messages), lambda mark: mark == "[TOOL_CALLS]")
    >>> written.open, written.lead, written.close, written.listed, written.arguments
    ('[TOOL_CALLS]', ' ', '', True, 'arguments')
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

NAME, ARGUMENTS = "forerun_probe", {"probe_value": 7}
"""The probe call a template is asked to render."""
TOOL = {"type": "function", "function": {"name": NAME, "parameters": {"type": "object", "properties": {
    "probe_value": {"type": "integer"}}}}}  # fmt: skip
TEXT = "zq probe text"
"""An assistant's words, rendered to find where a turn's own text ends (no mark begins so)."""
SHORT_ID, LONG_ID = "a1B2c3D4e", "call_0123456789abcdef"
"""Call ids: Mistral's templates refuse any but 9 letters and digits."""
REACH = 64
"""How far before the call's name the JSON holding it may begin."""


@dataclass(frozen=True)
class Written:
    """How a template writes an assistant's calls: `open` (a special token's text), then `lead` (whitespace), the
    JSON (one list of calls where `listed`, else one object), `trail` (whitespace), `close` (a special token's text,
    or "" where the turn just ends); the arguments under `arguments`; `short_ids`: whether it takes only
    9-character call ids (Mistral's)."""

    open: str
    lead: str
    close: str
    trail: str
    listed: bool
    arguments: str
    short_ids: bool
    between: str = ""
    """The mark between a call's name and its arguments' JSON where the name stands outside the JSON (Mistral's
    newer `[TOOL_CALLS]name[ARGS]{...}`, each call after its own opening mark); "" where the JSON holds both."""


def probed(tokenizer: object) -> Written | None:
    """How the tokenizer's chat template (the one it renders with tools) writes calls (`written_calls`)."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tools=[TOOL], tokenize=False)

    def own(mark: str) -> bool:  # one token, which the decoded answer drops
        ids = tokenizer(mark, add_special_tokens=False)["input_ids"]
        return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""

    return written_calls(render, own)


def written_calls(render: Callable[[list[dict]], str], own: Callable[[str], bool]) -> Written | None:
    """How a chat template writes calls (None: not as JSON after a mark `own` says is a special token of the
    tokenizer's own); `render(messages)`: the text it renders of `messages` with the probe tool offered."""
    user = {"role": "user", "content": "Hi"}
    try:
        words = render([user, {"role": "assistant", "content": TEXT}])
        short = False
        try:
            one = render([user, assistant(1, LONG_ID)])
        except Exception:  # a template refusing a call id of OpenAI's shape
            one, short = render([user, assistant(1, SHORT_ID)]), True
    except Exception:  # the template's own refusals and faults: it teaches no calls forerun reads
        return None
    start = shared(one, words)
    if words.find(TEXT, start) < 0:
        return None
    ending = words[words.index(TEXT, start) + len(TEXT) :]  # how a turn ends after its text
    if not one.endswith(ending) or len(one) - len(ending) < start:
        return None
    call = one[start : len(one) - len(ending)]  # the probe call as the template writes it, and nothing else
    return json_form(call, own, short) or named_form(call, own, short)


def json_form(call: str, own: Callable[[str], bool], short: bool) -> Written | None:
    """The form of `call` where it is a mark, the JSON (a call object, or a list of them), and maybe a mark."""
    found = call_json(call)
    if found is None:
        return None
    at, end, value, key = found
    opening, lead = split_mark(call[:at], own, "lead")
    closing, trail = split_mark(call[end:], own, "trail")
    if not opening or closing is None:
        return None
    return Written(opening, lead, closing, trail, isinstance(value, list), key, short)


def named_form(call: str, own: Callable[[str], bool], short: bool) -> Written | None:
    """The form of `call` where it is a mark, the function's name, another mark, the arguments' JSON, and maybe a
    mark (Mistral's newer `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`)."""
    at = call.find(NAME)
    brace = call.find("{", at + len(NAME))
    if at <= 0 or brace < 0:
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(call, brace)
    except ValueError:
        return None
    opening, between, closing = call[:at], call[at + len(NAME) : brace], call[end:]
    if value != ARGUMENTS or not (own(opening) and own(between)) or (closing and not own(closing)):
        return None
    return Written(opening, "", closing, "", False, "arguments", short, between)


def split_mark(text: str, own: Callable[[str], bool], side: str) -> tuple[str | None, str]:
    """(the mark, the whitespace beside it) of the `text` before ("lead") or after ("trail") a call's JSON: the
    mark "" where there is none, None where it is not one special token of the tokenizer's own."""
    mark = text.rstrip() if side == "lead" else text.lstrip()
    gap = text[len(mark) :] if side == "lead" else text[: len(text) - len(mark)]
    if mark and (mark != mark.strip() or not own(mark)):
        return None, gap
    return mark, gap


def assistant(calls: int, ident: str) -> dict:
    """An assistant message making `calls` probe calls (the arguments an object, as templates take them)."""
    made = [{"id": ident, "type": "function", "function": {"name": NAME, "arguments": dict(ARGUMENTS)}}] * calls
    return {"role": "assistant", "content": "", "tool_calls": made}


def shared(first: str, second: str) -> int:
    """The length of the text `first` and `second` begin with alike."""
    for i, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return i
    return min(len(first), len(second))


def call_json(text: str) -> tuple[int, int, object, str] | None:
    """(where it begins, where it ends, the value, the arguments' key) of the outermost JSON value in `text` that is
    the probe call or a list of it, or None."""
    name = text.find(json.dumps(NAME))
    found = None
    for at in range(name - 1, max(0, name - REACH) - 1, -1):
        if name < 0 or text[at] not in "[{":
            continue
        try:
            value, end = json.JSONDecoder().raw_decode(text, at)
        except ValueError:
            continue
        key = probe_key(value[0] if isinstance(value, list) and len(value) == 1 else value)
        if end > name and key is not None:
            found = (at, end, value, key)
    return found


def probe_key(value: object) -> str | None:
    """The key a rendered probe call holds its arguments under ("arguments" or "parameters"), or None where
    `value` is not the probe call."""
    if not isinstance(value, Mapping) or value.get("name") != NAME:
        return None
    for key in ("arguments", "parameters"):
        arguments = value.get(key)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if arguments == ARGUMENTS:
            return key
    return None


def rendered(template: str, messages: list[dict]) -> str:
    """`template` rendered over `messages` with the probe tool offered, as transformers renders chat templates."""
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, _ = render_jinja_template(
        conversations=[messages], tools=[TOOL], chat_template=template, bos_token="<s>", eos_token="</s>"
    )
    return texts[0]
