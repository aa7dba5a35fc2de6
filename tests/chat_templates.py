"""Chat templates written for the tests (our own text, not any model's): one with native tool
rendering in the Hermes `<tool_call>` format, and one that also thinks (`<think>` blocks and an
`enable_thinking` switch, the mechanics Qwen3-style templates have)."""

# ChatML turns; tools listed in the system turn; past calls as <tool_call> blocks; tool results
# in a "tool" turn wrapped in <tool_result>.
TOOLS_TEMPLATE = """
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{%- if tools -%}
<|im_start|>system
{{ system ~ '\n\n' if system }}Tools you may call, one JSON description a line:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, answer with <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call> (one block per call).<|im_end|>
{% elif system -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- elif message['role'] == 'assistant' -%}
<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}{% endif -%}
{%- for call in message.get('tool_calls') or [] %}
{% if not loop.first or message['content'] %}
{% endif %}<tool_call>
{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' -%}
<|im_start|>tool
<tool_result>
{{ message['content'] }}
</tool_result><|im_end|>
{% else -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

# The same, plus thought: a past assistant turn's thought is dropped; with thinking on the
# generation prompt opens the think block (the model starts in thought), with it off the prompt
# carries an empty block, so the model answers at once.
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% if message['content'] %}{{ message['content'] }}{% endif -%}",
    "{% if message['content'] %}{{ message['content'].split('</think>')[-1] | trim }}{% endif -%}",
).replace(
    "<|im_start|>assistant\n{% endif -%}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif -%}",
)
assert THINKING_TEMPLATE.count("<think>") == 2
