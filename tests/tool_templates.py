"""Chat templates teaching tool calls as model families other than ChatML's are taught them, written for the tests
(no hub downloads): what `forerun.tool_specs` detects in a template and the form it holds a required call to.

`LLAMA3_JSON` is shaped as Llama 3.1's own template is (its headers, the tools shown as JSON in the first user
message with the instruction to answer `{"name": function name, "parameters": ...}`, an assistant's call written
as that object, a tool's answer under the `ipython` role, one call per assistant message); the words are ours.
"""

from __future__ import annotations

LLAMA3_JSON = (
    "{%- set head = messages[0] if messages and messages[0].role == 'system' else none -%}"
    "{%- set rest = messages[1:] if head is not none else messages -%}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools %}{{ 'Environment: ipython\n' }}{% endif -%}"
    "{{ head.content if head is not none else 'You are a helpful assistant.' }}{{ '<|eot_id|>' }}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'user' and loop.first and tools -%}"
    "{{ '<|start_header_id|>user<|end_header_id|>\n\nAnswer with a JSON call of one of these functions, in the format"
    ' {"name": function name, "parameters": an object of its arguments}. Do not use variables.\n\n\' }}'
    "{%- for tool in tools %}{{ tool | tojson(indent=4) }}{{ '\n\n' }}{% endfor -%}"
    "{{ message.content }}{{ '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{%- if message.tool_calls | length != 1 %}{{ raise_exception('one tool call per message') }}{% endif -%}"
    "{%- set call = message.tool_calls[0].function -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{{ '{\"name\": \"' + call.name + '\", ' }}"
    "{{- '\"parameters\": ' }}{{ call.arguments | tojson }}{{ '}<|eot_id|>' }}"
    "{%- elif message.role in ('tool', 'ipython') -%}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
    "{%- else -%}"
    "{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif -%}"
)

MISTRAL_TOOLS = (
    "{%- set rest = messages[1:] if messages and messages[0].role == 'system' else messages -%}"
    "{%- set users = rest | selectattr('role', 'equalto', 'user') | list -%}"
    "{{- bos_token -}}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'user' -%}"
    "{%- if tools and message == users[-1] -%}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}"
    "{%- endif -%}"
    "{{- '[INST] ' + message.content + '[/INST]' -}}"
    "{%- elif message.tool_calls is defined and message.tool_calls -%}"
    "{{- '[TOOL_CALLS] [' -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- if call.id is not defined or call.id | length != 9 -%}"
    "{{- raise_exception('call ids are 9 letters and digits') -}}"
    "{%- endif -%}"
    "{%- set out = call.function | tojson -%}"
    "{{- out[:-1] + ', \"id\": \"' + call.id + '\"}' -}}"
    "{{- ', ' if not loop.last else ']' + eos_token -}}"
    "{%- endfor -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- ' ' + message.content | trim + eos_token -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 -%}"
    "{{- raise_exception('call ids are 9 letters and digits') -}}"
    "{%- endif -%}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content + ', \"call_id\": \"' + message.tool_call_id + '\"}' -}}"
    "{{- '[/TOOL_RESULTS]' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""Shaped as Mistral-7B-Instruct-v0.3's template: calls as one JSON list after its own `[TOOL_CALLS]` token, each
with its 9-character id (other ids refused), the tools shown before the last user message; no generation prompt
(an answer follows `[/INST]`)."""

TOOLCALL_MARKS = (
    "{%- for message in messages -%}"
    "{%- if loop.first and tools -%}"
    "{{- '<extra_id_0>System\nTools: ' + (tools | map(attribute='function') | list | tojson) + '\n' -}}"
    "{%- endif -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<extra_id_1>Assistant\n' + (message.content or '') -}}"
    "{%- if message.tool_calls -%}"
    "{{- '<TOOLCALL>[' -}}"
    "{%- for call in message.tool_calls -%}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}' -}}"
    "{{- ', ' if not loop.last else '' -}}"
    "{%- endfor -%}"
    "{{- ']</TOOLCALL>' -}}"
    "{%- endif -%}"
    "{{- '\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<extra_id_1>User\n<TOOL_RESPONSE>[' + message.content + ']</TOOL_RESPONSE>\n' -}}"
    "{%- else -%}"
    "{{- '<extra_id_1>' + (message.role | capitalize) + '\n' + message.content + '\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<extra_id_1>Assistant\n' }}{% endif -%}"
)
"""Shaped as Nemotron's JSON tool template: calls as one JSON list between `<TOOLCALL>` and `</TOOLCALL>`, tokens
of the tokenizer's own."""

MISTRAL_NAMED = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message.role == 'user' -%}"
    "{%- if tools and loop.last -%}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}{%- endif -%}"
    "{{- '[INST]' + message.content + '[/INST]' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- message.content or '' -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' -}}"
    "{{- call.function.arguments if call.function.arguments is string else call.function.arguments | tojson -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""Shaped as the templates of Mistral's newer models (Ministral 3, Devstral 2): each call its own `[TOOL_CALLS]`,
the function's name, `[ARGS]`, the arguments' JSON, tokens of the tokenizer's own; no call ids."""

GRANITE_TOOLS = (
    "{%- if tools -%}{{- '<|start_of_role|>available_tools<|end_of_role|>' + (tools | tojson(indent=4)) -}}"
    "{{- '<|end_of_text|>\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined -%}"
    "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' -}}"
    "{{- message.tool_calls | map(attribute='function') | list | tojson(indent=4) -}}{{- '<|end_of_text|>\n' -}}"
    "{%- else -%}"
    "{{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + message.content + '<|end_of_text|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}"
)
"""Shaped as Granite 3.1's template: calls as one JSON list after its own `<|tool_call|>` token, written back
indented (`tojson(indent=4)`), no closing mark."""

QWEN35_XML = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n# Tools\n\n<tools>' -}}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) -}}{% endfor -%}"
    "{{- '\n</tools>\n\nCall a function as:\n<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n'"
    " + '</function>\n</tool_call><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set call = call.function if call.function is defined else call -%}"
    "{{- ('\n' if not loop.first or (message.content or '') | trim else '') + '<tool_call>\n<function=' -}}"
    "{{- call.name + '>\n' -}}"
    "{%- for key, value in call.arguments | items -%}"
    "{{- '<parameter=' + key + '>\n' -}}"
    "{{- value | tojson if value is mapping or (value is sequence and value is not string) else value | string -}}"
    "{{- '\n</parameter>\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
"""Shaped as Qwen3.5's (and Qwen3-Coder's) template: each call XML in its own `<tool_call>` block, `<function=name>`
and a `<parameter=key>` element per argument, a string's value as it is, an object or a list as JSON."""

LFM2_PYTHONIC = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}"
    "{%- set messages = messages[1:] -%}{%- endif -%}"
    "{%- if tools -%}{%- set ns.system = ns.system + ('\n' if ns.system else '') + 'List of tools: "
    "<|tool_list_start|>[' -%}"
    "{%- for tool in tools -%}{%- set ns.system = ns.system + (tool | tojson) + ('' if loop.last else ', ') -%}"
    "{%- endfor -%}{%- set ns.system = ns.system + ']<|tool_list_end|>' -%}{%- endif -%}"
    "{%- if ns.system -%}{{ '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}{%- endif -%}"
    "{%- for message in messages -%}{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role == 'tool' -%}{%- set content = '<|tool_response_start|>' + content + "
    "'<|tool_response_end|>' -%}{%- endif -%}"
    "{{ content + '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
"""Shaped as LFM2's template: the tools as JSON after `<|tool_list_start|>` in the system message, a tool's answer
between `<|tool_response_start|>` and `<|tool_response_end|>`, an assistant's calls only as its content (the model
writes `<|tool_call_start|>[name(key=value)]<|tool_call_end|>`); the words are ours."""

LFM2_MARKS = ["<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
              "<|tool_response_start|>", "<|tool_response_end|>"]  # fmt: skip
"""LFM2's special tokens of its tool calls."""


def held_answer(model, tokenizer, messages, tools, choice, new: int, parallel: bool = True) -> str:
    """Plain generate's answer to `messages` with `tools` shown, held by the request's constraint (a required or
    named call's grammar), decoded as a server decodes it: what a server's call is compared with."""
    from transformers import LogitsProcessorList

    import forerun

    decoder = forerun.Decoder(model, tokenizer, "plain")
    request = forerun.GenerationRequest(messages, new, tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
    ids = decoder.encode(messages, tools=tools)
    constraint = decoder.grammars.constraint(request.held_format, ids.shape[1], frozenset({tokenizer.eos_token_id}))
    out = model.generate(ids, max_new_tokens=new, do_sample=False, logits_processor=LogitsProcessorList([constraint]),
                         pad_token_id=0)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
