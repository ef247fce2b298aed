"""POST /v1/cache/prefill through the real app in every dialect: the prompt is computed into the prefix cache without
generating, and the same prefix in that dialect's own route then reports its tokens cached. Also the usage a
cache breakpoint reports, and the agents' fixed prefixes the gateway notes (GET /v1/cache/prefixes)."""

from __future__ import annotations

import httpx
import pytest

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Reads a file from the disk",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def system_text(seed: str) -> str:
    # Long enough for several blocks; the seed keeps the tests' prompts apart on one module's server.
    return f"You are agent {seed}. " + " ".join(f"rule {seed}-{i}: answer briefly." for i in range(40))


@pytest.fixture(scope="module")
def block_size(http) -> int:
    return http.get("/v1/cache/stats").json()["block_size"]


def prefill(http, body: dict) -> dict:
    r = http.post("/v1/cache/prefill", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "cache.prefill"
    assert out["computed_tokens"] == out["prompt_tokens"] - out["cached_tokens"]
    return out


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Tokens a later identical prompt can read from the cache: its full blocks, one token always computed."""
    return (num_tokens - 1) // block_size * block_size


def test_chat_prefill_then_the_same_prefix_reads_it(http, server, block_size):
    messages = [{"role": "system", "content": system_text("chat")}, {"role": "user", "content": "hello"}]
    done = prefill(http, {"model": server.model_name, "messages": messages, "tools": TOOLS})
    assert done["cached_tokens"] == 0 and done["prompt_tokens"] > 4 * block_size
    again = prefill(http, {"model": server.model_name, "messages": messages, "tools": TOOLS})
    assert again["cached_tokens"] == full_blocks(done["prompt_tokens"], block_size)
    r = http.post("/v1/chat/completions", json={"model": server.model_name, "messages": messages, "tools": TOOLS,
                                                "max_tokens": 2})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == done["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == full_blocks(done["prompt_tokens"], block_size)


def test_completions_prefill_with_token_ids(http, server, block_size):
    ids = [100 + i % 500 for i in range(5 * block_size + 3)]
    done = prefill(http, {"model": server.model_name, "prompt": ids})
    assert done["prompt_tokens"] == len(ids) and done["cached_tokens"] == 0
    r = http.post("/v1/completions", json={"model": server.model_name, "prompt": ids + [7, 8], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * block_size


def test_anthropic_prefill_and_cache_usage(http, server, block_size):
    system = [{"type": "text", "text": system_text("messages"), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = [{"role": "user", "content": "first conversation"}]
    done = prefill(http, {"api": "messages", "model": server.model_name, "system": system, "messages": first})
    assert done["cached_tokens"] == 0
    # A new conversation with the same system prompt: everything before its user turn comes from the cache.
    r = http.post("/v1/messages", json={"model": server.model_name, "max_tokens": 2, "system": system,
                                        "messages": [{"role": "user", "content": "another one"}]})
    usage = r.json()["usage"]
    assert usage["cache_read_input_tokens"] >= 4 * block_size
    total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    count = http.post("/v1/messages/count_tokens", json={"model": server.model_name, "system": system,
                                                         "messages": [{"role": "user", "content": "another one"}]})
    assert total == count.json()["input_tokens"]
    # Under a breakpoint, the prompt's full blocks beyond the hit are written to the cache: reported as such.
    assert usage["cache_creation_input_tokens"] == (total // block_size * block_size
                                                    - usage["cache_read_input_tokens"])
    assert usage["input_tokens"] == total % block_size
    stats = http.get("/v1/cache/stats").json()
    assert stats["num_kept_blocks"] + stats["num_used_blocks"] >= total // block_size


def test_a_request_without_breakpoint_creates_nothing(http, server):
    r = http.post("/v1/messages", json={"model": server.model_name, "max_tokens": 2, "system": system_text("plain"),
                                        "messages": [{"role": "user", "content": "hi"}]})
    usage = r.json()["usage"]
    assert usage["cache_creation_input_tokens"] == 0 and usage["cache_read_input_tokens"] == 0


def test_responses_prefill(http, server, block_size):
    body = {"model": server.model_name, "instructions": system_text("responses"), "input": "what is here?",
            "prompt_cache_key": "agent-x"}
    done = prefill(http, body)  # `input` names the dialect
    r = http.post("/v1/responses", json={**body, "max_output_tokens": 16})
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == full_blocks(done["prompt_tokens"], block_size)


def test_prefill_errors_are_the_clients(http, server):
    r = http.post("/v1/cache/prefill", json={"api": "nope", "model": server.model_name, "prompt": "x"})
    assert r.status_code == 400 and "api" in r.json()["error"]["message"]
    r = http.post("/v1/cache/prefill", json={"api": "messages", "model": server.model_name, "messages": "x"})
    assert r.status_code == 400
    r = http.post("/v1/cache/prefill", json={"model": "not-served", "prompt": "x"})
    assert r.status_code == 404
    r = http.post("/v1/cache/prefill", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_the_gateway_notes_an_agents_fixed_prefix_without_the_conversation(server):
    agent = {"User-Agent": "test-agent/1.2.3 (cli)"}
    messages = [{"role": "system", "content": system_text("agent")}, {"role": "user", "content": "secret question"}]
    with httpx.Client(base_url=server.url, timeout=120, headers=agent) as c:
        assert c.post("/v1/chat/completions", json={"model": server.model_name, "messages": messages,
                                                    "tools": TOOLS, "max_tokens": 1}).status_code == 200
        # A side request with a smaller prefix does not replace the larger one.
        c.post("/v1/chat/completions", json={"model": server.model_name, "max_tokens": 1,
                                             "messages": [{"role": "system", "content": "title this"}, messages[1]]})
        found = [p for p in c.get("/v1/cache/prefixes").json()["data"] if p["user_agent"] == agent["User-Agent"]]
    assert len(found) == 1 and found[0]["model"] == server.model_name and found[0]["num_tools"] == 1
    body = found[0]["body"]
    assert body["messages"] == [messages[0]] and "secret" not in str(body)
    again = httpx.post(server.url + "/v1/cache/prefill", json=body, timeout=120).json()
    assert again["cached_tokens"] > 0  # the prefix the agent's request stored
