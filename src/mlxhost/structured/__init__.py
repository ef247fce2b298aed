"""Output parsers and grammars for agents.

Small text units over tokens and text, tested without a model: streaming parsers that split a model's
output into content, reasoning and tool calls (`tool_parsers` over the `tool_formats` registry,
`reasoning`), the chat template that renders tools, tool calls and tool results for the demo model
(`templates`), and the grammars that constrain what a model may generate (JSON schemas, tool-call shapes),
whose masks the runner applies.
"""
