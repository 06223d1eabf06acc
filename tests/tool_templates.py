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
