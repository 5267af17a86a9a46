"""The demo model's chat template and special tokens.

Turns are `<|role|>\\n<content>\\n`. Offered tools are listed in a system block, one JSON
object a line. An assistant's tool call is `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>` (the form mlx-lm's `json_tools` parser reads; it infers that parser
from this template), and a tool's result is a `<|tool|>` turn. With `enable_thinking` the
assistant turn opens with `<think>`, and the model writes its thought, `</think>`, then its
answer. The end of an answer is the next turn's marker: `<|user|>`, `<|tool|>` after a call,
`<|system|>` (`<|end|>` after a story).
"""

from __future__ import annotations

from typing import Any

SYSTEM, USER, ASSISTANT, TOOL, END = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", \
    "<|end|>"
THINK, THINK_END, CALL, CALL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = (END, SYSTEM, USER, ASSISTANT, TOOL, THINK, THINK_END, CALL, CALL_END)
EOS = (END, USER, TOOL, SYSTEM)

TOOLS_INTRO = "Tools:"
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>\\n" + TOOLS_INTRO + "\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{ '<|assistant|>\\n' }}"
    "{%- if message.reasoning_content %}{{ '<think>' + message.reasoning_content + '</think>' }}"
    "{%- endif %}{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{%- if not message.tool_calls %}{{ '\\n' }}{%- endif %}"
    "{%- elif message.role == 'tool' %}{{ '<|tool|>\\n' + message.content + '\\n' }}"
    "{%- else %}{{ '<|' + message.role + '|>\\n' + message.content + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{%- if enable_thinking %}{{ '<think>' }}{%- endif %}{%- endif %}"
)


def render(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False, enable_thinking: bool = False) -> str:
    """The template rendered by transformers' own renderer, as the tokenizer renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered = render_jinja_template(
        conversations=[messages], tools=tools,  # type: ignore[arg-type]
        chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking)[0]
    return str(rendered[0])
