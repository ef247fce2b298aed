"""A realistic Claude Code request body (the shape its agent loop sends: system as blocks with
`cache_control`, ~20 client tools with real-looking input schemas, a multi-turn history with tool_use /
tool_result blocks), for replaying against /v1/messages.

`CURRENT_FIELDS` are what Claude Code 2.1.197 adds to every turn (captured from the real CLI; the whole
captures are in tests/frontends/fixtures): a system message after the first user turn, adaptive thinking,
context management and an output effort. The anthropic SDK has no parameters for some of them: send
them as `extra_body`."""

from __future__ import annotations

import copy

_EPHEMERAL = {"type": "ephemeral"}
_SCHEMA = "http://json-schema.org/draft-07/schema#"


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": properties, "required": required,
                             "additionalProperties": False, "$schema": _SCHEMA}}


_STR = {"type": "string"}
TOOLS = [
    _tool("Task", "Launch a new agent to handle complex, multi-step tasks autonomously.",
          {"description": {"type": "string", "description": "A short (3-5 word) description of the task"},
           "prompt": {"type": "string", "description": "The task for the agent to perform"},
           "subagent_type": {"type": "string", "description": "The type of specialized agent to use"}},
          ["description", "prompt", "subagent_type"]),
    _tool("Bash", "Executes a given bash command in a persistent shell session with optional timeout.",
          {"command": {"type": "string", "description": "The command to execute"},
           "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
           "description": {"type": "string", "description": "Clear, concise description of what this command does"},
           "run_in_background": {"type": "boolean", "description": "Run this command in the background"}},
          ["command"]),
    _tool("Glob", "Fast file pattern matching tool that works with any codebase size.",
          {"pattern": {"type": "string", "description": "The glob pattern to match files against"},
           "path": {"type": "string", "description": "The directory to search in"}}, ["pattern"]),
    _tool("Grep", "A powerful search tool built on ripgrep.",
          {"pattern": {"type": "string", "description": "The regular expression pattern to search for"},
           "path": {"type": "string", "description": "File or directory to search in"},
           "glob": {"type": "string", "description": "Glob pattern to filter files (e.g. \"*.js\")"},
           "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"],
                           "description": "Output mode"},
           "-i": {"type": "boolean", "description": "Case insensitive search"},
           "-n": {"type": "boolean", "description": "Show line numbers in output"},
           "head_limit": {"type": "number", "description": "Limit output to first N lines/entries"},
           "multiline": {"type": "boolean", "description": "Enable multiline mode"}},
          ["pattern"]),
    _tool("LS", "Lists files and directories in a given path.",
          {"path": {"type": "string", "description": "The absolute path to the directory to list"},
           "ignore": {"type": "array", "items": _STR, "description": "List of glob patterns to ignore"}}, ["path"]),
    _tool("ExitPlanMode", "Use this tool when you are in plan mode and have finished presenting your plan.",
          {"plan": {"type": "string", "description": "The plan you came up with"}}, ["plan"]),
    _tool("Read", "Reads a file from the local filesystem.",
          {"file_path": {"type": "string", "description": "The absolute path to the file to read"},
           "offset": {"type": "number", "description": "The line number to start reading from"},
           "limit": {"type": "number", "description": "The number of lines to read"}}, ["file_path"]),
    _tool("Edit", "Performs exact string replacements in files.",
          {"file_path": {"type": "string", "description": "The absolute path to the file to modify"},
           "old_string": {"type": "string", "description": "The text to replace"},
           "new_string": {"type": "string", "description": "The text to replace it with"},
           "replace_all": {"type": "boolean", "default": False, "description": "Replace all occurrences"}},
          ["file_path", "old_string", "new_string"]),
    _tool("MultiEdit", "Makes multiple edits to a single file in one operation.",
          {"file_path": {"type": "string", "description": "The absolute path to the file to modify"},
           "edits": {"type": "array", "minItems": 1, "description": "Array of edit operations",
                     "items": {"type": "object", "additionalProperties": False,
                               "required": ["old_string", "new_string"],
                               "properties": {"old_string": _STR, "new_string": _STR,
                                              "replace_all": {"type": "boolean", "default": False}}}}},
          ["file_path", "edits"]),
    _tool("Write", "Writes a file to the local filesystem.",
          {"file_path": {"type": "string", "description": "The absolute path to the file to write"},
           "content": {"type": "string", "description": "The content to write to the file"}},
          ["file_path", "content"]),
    _tool("NotebookEdit", "Completely replaces the contents of a specific cell in a Jupyter notebook.",
          {"notebook_path": {"type": "string", "description": "The absolute path to the notebook"},
           "cell_id": {"type": "string", "description": "The ID of the cell to edit"},
           "new_source": {"type": "string", "description": "The new source for the cell"},
           "cell_type": {"type": "string", "enum": ["code", "markdown"]},
           "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
          ["notebook_path", "new_source"]),
    _tool("WebFetch", "Fetches content from a specified URL and processes it using an AI model.",
          {"url": {"type": "string", "format": "uri", "description": "The URL to fetch content from"},
           "prompt": {"type": "string", "description": "The prompt to run on the fetched content"}},
          ["url", "prompt"]),
    _tool("TodoWrite", "Use this tool to create and manage a structured task list for your current session.",
          {"todos": {"type": "array", "description": "The updated todo list",
                     "items": {"type": "object", "additionalProperties": False,
                               "required": ["content", "status", "activeForm"],
                               "properties": {"content": {"type": "string", "minLength": 1},
                                              "status": {"type": "string",
                                                         "enum": ["pending", "in_progress", "completed"]},
                                              "activeForm": {"type": "string", "minLength": 1}}}}},
          ["todos"]),
    _tool("WebSearch", "Allows Claude to search the web and use the results to inform responses.",
          {"query": {"type": "string", "minLength": 2, "description": "The search query to use"},
           "allowed_domains": {"type": "array", "items": _STR},
           "blocked_domains": {"type": "array", "items": _STR}}, ["query"]),
    _tool("BashOutput", "Retrieves output from a running or completed background bash shell.",
          {"bash_id": {"type": "string", "description": "The ID of the background shell"},
           "filter": {"type": "string", "description": "Optional regular expression to filter lines"}},
          ["bash_id"]),
    _tool("KillShell", "Kills a running background bash shell by its ID.",
          {"shell_id": {"type": "string", "description": "The ID of the background shell to kill"}}, ["shell_id"]),
    _tool("SlashCommand", "Execute a slash command within the main conversation.",
          {"command": {"type": "string", "description": "The slash command to execute with its arguments"}},
          ["command"]),
    _tool("AskUserQuestion", "Ask the user a multiple-choice question.",
          {"question": _STR,
           "options": {"type": "array", "minItems": 2, "maxItems": 4,
                       "items": {"type": "object", "additionalProperties": False, "required": ["label"],
                                 "properties": {"label": _STR, "description": _STR}}}},
          ["question", "options"]),
    _tool("NotebookRead", "Reads a Jupyter notebook and returns all of the cells with their outputs.",
          {"notebook_path": _STR, "cell_id": _STR}, ["notebook_path"]),
    _tool("Skill", "Execute a skill within the main conversation.",
          {"skill": {"type": "string", "description": "The skill name"}}, ["skill"]),
]
TOOLS[-1]["cache_control"] = _EPHEMERAL  # Claude Code marks the end of the tools for caching

SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.", "cache_control": _EPHEMERAL},
    {"type": "text", "cache_control": _EPHEMERAL, "text": (
        "You are an interactive CLI tool that helps users with software engineering tasks. Use the instructions "
        "below and the tools available to you to assist the user.\n\n# Tone and style\nYou should be concise, "
        "direct, and to the point. Only use emojis if the user explicitly requests it.\n\n# Doing tasks\nThe user "
        "will primarily request you perform software engineering tasks. This includes solving bugs, adding new "
        "functionality, refactoring code, explaining code, and more. Use the TodoWrite tool to plan the task if "
        "required. Use the available search tools to understand the codebase and the user's query.\n\n"
        "# Tool usage policy\nWhen doing file search, prefer to use the Task tool in order to reduce context usage. "
        "You have the capability to call multiple tools in a single response.\n\n"
        "Here is useful information about the environment you are running in:\n<env>\nWorking directory: "
        "/home/dev/project\nIs directory a git repo: Yes\nPlatform: darwin\nToday's date: 2025-06-01\n</env>")},
]

HISTORY = [
    {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following "
                                 "context: # important-instruction-reminders\nDo what has been asked; nothing more, "
                                 "nothing less.\n</system-reminder>"},
        {"type": "text", "text": "Why does test_parse fail? Fix it.", "cache_control": _EPHEMERAL}]},
    {"role": "assistant", "content": [
        {"type": "text", "text": "I'll look at the failing test first."},
        {"type": "tool_use", "id": "toolu_01A", "name": "Bash",
         "input": {"command": "pytest tests/test_parse.py -x -q"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01A", "is_error": True, "content": (
            "F\n=================================== FAILURES ===================================\n"
            "_________________________________ test_parse _________________________________\n"
            "    def test_parse():\n>       assert parse('a=1; b=2') == {'a': 1, 'b': 2}\n"
            "E       AssertionError: assert {'a': 1, ' b': 2} == {'a': 1, 'b': 2}\n"
            "tests/test_parse.py:4: AssertionError\n1 failed in 0.03s")}]},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_01B", "name": "Read", "input": {"file_path": "/home/dev/project/parse.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01B", "content": [{"type": "text", "text": (
            "     1\tdef parse(text):\n     2\t    out = {}\n     3\t    for pair in text.split(';'):\n"
            "     4\t        key, value = pair.split('=')\n     5\t        out[key] = int(value)\n"
            "     6\t    return out\n")}]}]},
    {"role": "assistant", "content": [
        {"type": "text", "text": "The keys keep the space after `;`. Stripping them fixes it."},
        {"type": "tool_use", "id": "toolu_01C", "name": "Edit",
         "input": {"file_path": "/home/dev/project/parse.py", "old_string": "out[key] = int(value)",
                   "new_string": "out[key.strip()] = int(value)"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01C",
         "content": "The file /home/dev/project/parse.py has been updated."},
        {"type": "text", "text": "Now run the whole test suite.", "cache_control": _EPHEMERAL}]},
]


AGENT_TYPES = ("Available agent types for the Agent tool:\n- general-purpose: General-purpose agent for researching "
               "complex questions, searching for code, and executing multi-step tasks. (Tools: *)\n- Explore: "
               "Read-only search agent for broad fan-out searches. (Tools: All tools except Agent, Edit, Write)")
CURRENT_FIELDS = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                  "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}


def claude_code_request(model: str, max_tokens: int = 16) -> dict:
    """A fresh copy each call: tests append turns to it."""
    messages = copy.deepcopy(HISTORY)
    messages.insert(1, {"role": "system", "content": AGENT_TYPES})
    return {"model": model, "max_tokens": max_tokens, "system": copy.deepcopy(SYSTEM), "tools": copy.deepcopy(TOOLS),
            "messages": messages, "metadata": {"user_id": "user_abc_account_123_session_456"}}
