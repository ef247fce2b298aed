"""The Anthropic translation's placement of Claude Code's first-turn system message, without a model: ahead of
the user's first words, apart from `system`, the same in every turn of a conversation, and part of the fixed
prefix the server notes for `mlxhost launch`."""

from __future__ import annotations

from mlxhost.frontends.anthropic.protocol import MessagesRequest
from mlxhost.frontends.anthropic.translate import to_chat_request
from mlxhost.frontends.common.prefixes import PrefixCaptures

SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.58d; cc_entrypoint=sdk-cli;"},
          {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
CONTEXT = {"role": "system", "content": [{"type": "text", "text": "# Environment\n - Primary working directory: /p",
                                          "cache_control": {"type": "ephemeral"}}]}
TOOLS = [{"name": "Bash", "description": "Runs a command.", "input_schema": {"type": "object"}}]


def chat(messages: list[dict]):
    return to_chat_request(MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "system": SYSTEM, "tools": TOOLS, "messages": messages}))


def shape(request) -> list[tuple[str, str]]:
    return [(m.role, m.text()) for m in request.messages]


def first_turn(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                         {"type": "text", "text": question}]}, CONTEXT]


def test_the_first_turns_system_message_goes_before_the_users_words_apart_from_system():
    assert shape(chat(first_turn("list the files"))) == [
        ("system", "You are an agent."), ("system", "# Environment\n - Primary working directory: /p"),
        ("user", "<system-reminder>r</system-reminder>\nlist the files")]


def test_later_turns_render_the_first_turn_as_it_was():
    later = [*first_turn("list the files"),
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"c": "ls"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]},
             {"role": "system", "content": "a reminder after the first answer"}]
    first, then = shape(chat(first_turn("list the files"))), shape(chat(later))
    assert then[: len(first)] == first
    assert [role for role, _ in then[len(first):]] == ["assistant", "tool", "system"]  # later ones stay in place


def test_without_a_system_message_after_the_first_user_turn_nothing_moves():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": "later"}, {"role": "user", "content": "bye"}]
    assert [role for role, _ in shape(chat(messages))] == ["system", "user", "assistant", "system", "user"]


def test_the_noted_prefix_holds_the_moved_context_and_no_words_of_the_user():
    captures = PrefixCaptures()
    captures.note("claude-cli/2.1.332 (external, cli)", "m", chat(first_turn("list the files")))
    (prefix,) = captures.list()
    assert [m["content"] for m in prefix["body"]["messages"]] == [
        "You are an agent.", "# Environment\n - Primary working directory: /p"]
    assert "list the files" not in str(prefix)
