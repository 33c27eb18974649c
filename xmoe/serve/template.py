"""The demo model's chat template: SmolLM2's ChatML turns (same default system prompt, so plain chats read
exactly as the model was trained), plus function calling in the `<tool_call>{json}</tool_call>` form that
vLLM's `hermes` tool parser reads. SmolLM2's own template has no tools and fails on tool-call turns."""

CHAT_TEMPLATE = r"""
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = messages[0]['content'] -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set system = default_system -%}
  {%- set turns = messages -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system -}}
{%- if tools -%}
  {{- '\n\nYou can call functions. To call one, answer with <tool_call>{"name": <function name>, "arguments": '
      '<JSON object>}</tool_call>. The functions:' -}}
  {%- for tool in tools -%}
    {{- '\n' + ((tool.function if tool.function is defined else tool) | tojson) -}}
  {%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for m in turns -%}
  {%- if m['role'] == 'tool' -%}
    {{- '<|im_start|>tool\n<tool_response>\n' + (m['content'] or '') + '\n</tool_response><|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') -}}
    {%- for call in (m['tool_calls'] or []) if m['tool_calls'] is defined -%}
      {%- set args = call.function.arguments -%}
      {{- '<tool_call>{"name": "' + call.function.name + '", "arguments": '
          + (args if args is string else args | tojson) + '}</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()
