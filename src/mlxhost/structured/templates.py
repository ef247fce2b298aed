"""Chat template with tools for the demo model (ChatML tokens, Qwen3's tool conventions).

`AGENT_CHAT_TEMPLATE` renders, the way Qwen3's template does:
- `tools`: a system turn holding the first system message (if any), then a `# Tools` section with one JSON
  per tool inside `<tools></tools>` and the instruction to answer with
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (so the `hermes` tool parser reads the replies);
- assistant `tool_calls` (OpenAI shape, or bare `{"name", "arguments"}`): `<tool_call>` blocks after the
  content; `arguments` may be a dict (rendered with `tojson`) or a JSON string (rendered as is);
- `tool` messages: consecutive ones share one user turn, each as `<tool_response>...</tool_response>`;
- `enable_thinking=true`: the generation prompt ends with `<think>\\n` (thinking forced, as Qwen3's
  thinking-only templates do: `StreamingReasoningParser(starts_in_reasoning=True)`); false or undefined:
  nothing is added. (Unlike Qwen3's, false adds no empty block: mlx-lm's TokenizerWrapper passes
  `enable_thinking=False` whenever the tokenizer has no think tokens, as the demo's has not, and plain
  chats must render byte-identically, see below.)
- `reasoning_effort` is accepted and unused; `reasoning_content` of past turns is not rendered.
Content is a string, a list of OpenAI parts (text parts concatenated) or none.

For conversations without tools and tool messages, with `enable_thinking` undefined, the rendering is
byte-identical to `mlxhost.testing.demo.CHAT_TEMPLATE`, so switching templates keeps prompts (and their
prefix-cache hits) unchanged. Whitespace control is explicit (`{%- -%}`, no newlines in the source), so it
renders the same with or without transformers' `trim_blocks`/`lstrip_blocks`.
"""

AGENT_CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    # Tools: one system turn, the user's system message first.
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- render_content(messages[0]['content']) -}}{{- '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first and tools -%}"
    # Already rendered into the tools turn above.
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- set content = render_content(message['content']) -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
    '{{- \'<tool_call>\\n{"name": "\' + call[\'name\'] + \'", "arguments": \' -}}'
    "{%- if call['arguments'] is string -%}"
    "{{- call['arguments'] -}}"
    "{%- else -%}"
    "{{- call['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    # Consecutive tool results share one user turn.
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- render_content(message['content']) -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    # Every other turn exactly as the demo's CHAT_TEMPLATE renders it.
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- render_content(message['content']) -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
