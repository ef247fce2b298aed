"""`mlxhost bench prewarm`: a new conversation's question replaces only the user's last text, the SSE reader takes
the first content block as the first token, and the whole bench (a real `mlxhost serve` on the fixture model, an
agent's first turn with a system prompt and a tool) shows the pre-warmed turn reading its prefix from the cache."""

from __future__ import annotations

import json

from mlxhost.bench.prewarm import _events, medians, with_question
from mlxhost.server.cli import main

FIRST_TURN = {
    "model": "x", "max_tokens": 8, "stream": True,
    "system": [{"type": "text", "text": "You are a coding agent in a terminal. Answer briefly. " * 12}],
    "tools": [{"name": "Bash", "description": "Runs a shell command and returns its output. " * 6,
               "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                "required": ["command"]}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>be kind</system-reminder>"},
                                              {"type": "text", "text": "hi"}]},
                 {"role": "system", "content": [{"type": "text", "text": "Working directory: /home/dev/project"}]}],
}


def test_a_new_question_changes_only_the_users_last_text():
    asked = with_question(FIRST_TURN, "Name a fruit.")
    assert asked["messages"][0]["content"][1]["text"] == "Name a fruit."
    assert asked["messages"][0]["content"][0] == FIRST_TURN["messages"][0]["content"][0]
    assert asked["messages"][1] == FIRST_TURN["messages"][1] and asked["system"] == FIRST_TURN["system"]
    assert FIRST_TURN["messages"][0]["content"][1]["text"] == "hi"  # the capture itself is untouched
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert with_question(plain, "Name a tree.")["messages"][0]["content"] == "Name a tree."


def test_sse_events_are_named_and_parsed():
    lines = ["event: message_start", 'data: {"type": "message_start"}', "", "event: ping", 'data: {"type": "ping"}',
             "", "event: content_block_delta", 'data: {"type": "content_block_delta", "index": 0}']
    assert [name for name, _ in _events(lines)] == ["message_start", "ping", "content_block_delta"]


def test_medians_per_phase():
    rows = [{"phase": "cold", "prompt_tokens": 100, "cached_tokens": 0, "ttft_s": t, "e2e_s": t, "prefill_s": None}
            for t in (3.0, 1.0, 2.0)]
    rows += [{"phase": "pre-warmed", "prompt_tokens": 101, "cached_tokens": 96, "ttft_s": t, "e2e_s": t,
              "prefill_s": 2 * t} for t in (0.5, 0.1, 0.3)]
    cold, warm = medians(rows)
    assert (cold["phase"], cold["ttft_s"], cold["prefill_s"], cold["num_rounds"]) == ("cold", 2.0, None, 3)
    assert (warm["cached_tokens"], warm["ttft_s"], warm["prefill_s"]) == (96, 0.3, 0.6)


def test_the_bench_end_to_end(qwen3_model_dir, tmp_path, capsys):
    request, out = tmp_path / "first_turn.json", tmp_path / "prewarm.json"
    request.write_text(json.dumps(FIRST_TURN))
    assert main(["bench", "prewarm", "--model", str(qwen3_model_dir), "--request", str(request), "--rounds", "2",
                 "--max-tokens", "4", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["phase"] for r in result["rounds"]] == ["cold", "pre-warmed"] * 2
    for cold, warm in zip(result["rounds"][::2], result["rounds"][1::2]):
        assert cold["cached_tokens"] == 0 < cold["prompt_tokens"]  # the cache was cleared before it
        # The prefill computed the prefix; the new conversation read all of it but its own question's blocks.
        assert warm["prefill_computed_tokens"] > 0 and warm["prefill_prompt_tokens"] < warm["prompt_tokens"]
        assert warm["cached_tokens"] > 0.5 * warm["prompt_tokens"]
        assert warm["cached_tokens"] <= warm["prefill_prompt_tokens"]
        assert cold["ttft_s"] is not None and warm["ttft_s"] is not None
    cold, warm = result["medians"]
    assert (cold["phase"], warm["phase"]) == ("cold", "pre-warmed")
    assert warm["cached_tokens"] > cold["cached_tokens"] and warm["prefill_s"] is not None
    assert "pre-warmed" in capsys.readouterr().out
