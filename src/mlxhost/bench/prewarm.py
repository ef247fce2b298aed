"""`mlxhost bench prewarm`: an agent's first-turn TTFT, cold vs pre-warmed the way `mlxhost launch` does it.

mlxhost is started as a subprocess (the demo model unless --model). The request is an agent's captured first turn
(Anthropic Messages; by default Claude Code's, tests/frontends/fixtures/claude_code_first_turn_full.json), sent
with the agent's User-Agent so the server notes its fixed prefix (system prompt, tools, context). An untimed
warm-up turn first, so compiles and the prefix note are done; then per round, each after `DELETE /v1/cache`:
  cold: the captured first turn, streamed; TTFT is the time to the first content block (text, thinking or tool),
        or to the end of the message when the model's first token ends it;
  pre-warmed: the prefix the server noted, saved and posted to `POST /v1/cache/prefill` by launch's own code
        (agents/prewarm.py), then a new conversation's first turn (same prefix, another question), timed alike.
The table has the medians over --rounds; the JSON has every round.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mlxhost.agents import prewarm as agent_prewarm
from mlxhost.agents.claude import AGENT as CLAUDE
from mlxhost.bench.compare import _free_port, _running
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import add_serve_args_argument, default_json_path

# The capture's client: its requests say this (tests/frontends/fixtures/README.md), and the server notes the
# prefix per User-Agent, which is how launch finds it.
USER_AGENT = "claude-cli/2.1.332 (external, sdk-cli)"
DEFAULT_REQUEST = Path(__file__).resolve().parents[3] / "tests/frontends/fixtures/claude_code_first_turn_full.json"
QUESTIONS = ("Name a colour in one word.", "Name a fruit in one word.", "Name a planet in one word.",
             "Name a river in one word.", "Name a tree in one word.")
COLUMNS = [
    ("phase", "phase", ""), ("prompt_tokens", "prompt tokens", "d"), ("cached_tokens", "cached tokens", "d"),
    ("ttft_s", "ttft s", ".3f"), ("prefill_s", "prewarm call s", ".3f"),
]
API_KEY = "bench"  # the server runs without keys; launch's helpers send one all the same


def with_question(body: dict, question: str) -> dict:
    """The request as a new conversation asking `question`: the last text of its last user message replaced."""
    out = copy.deepcopy(body)
    user = next(m for m in reversed(out["messages"]) if m["role"] == "user")
    if isinstance(user["content"], str):
        user["content"] = question
    else:
        text = [part for part in user["content"] if part.get("type") == "text"]
        text[-1]["text"] = question
    return out


def _events(lines):
    """(event name, data) of an SSE stream's lines."""
    name = None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, json.loads(line[5:])


def stream_turn(client: httpx.Client, body: dict, user_agent: str, max_tokens: int) -> dict:
    """One streamed Messages turn: TTFT and the usage split of its prompt."""
    body = {**body, "stream": True, "max_tokens": max_tokens}
    headers = {"User-Agent": user_agent, "anthropic-version": "2023-06-01"}
    start = time.perf_counter()
    first = None
    usage: dict = {}
    with client.stream("POST", "/v1/messages", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:500]}")
        for name, event in _events(resp.iter_lines()):
            now = time.perf_counter()
            if name == "error":
                raise RuntimeError(f"stream error: {json.dumps(event)[:500]}")
            if first is None and name in ("content_block_start", "content_block_delta", "message_delta"):
                first = now  # message_delta first: the model's first token ended the message
            if name == "message_delta":
                usage = event.get("usage") or {}
    end = time.perf_counter()
    cached = usage.get("cache_read_input_tokens", 0)
    prompt = usage.get("input_tokens", 0) + cached + usage.get("cache_creation_input_tokens", 0)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": usage.get("output_tokens"),
            "ttft_s": None if first is None else first - start, "e2e_s": end - start}


def prewarm(url: str, model: str, user_agent: str, folder: Path) -> dict:
    """Launch's pre-warm: the prefix the server noted for this agent version saved, then posted to
    /v1/cache/prefill. Its answer (tokens) and how long the call took."""
    found = agent_prewarm.VERSION.search(user_agent)
    if found is None:
        raise RuntimeError(f"no version in the User-Agent {user_agent!r} (launch saves prefixes per version)")
    version = found.group(0)
    path = agent_prewarm.prefix_path(folder, version, model)
    if not agent_prewarm.save_prefix(url, API_KEY, CLAUDE, version, model, path):
        raise RuntimeError(f"the server noted no prefix for {user_agent!r}: is it an agent's first turn?")
    start = time.perf_counter()
    reply = agent_prewarm.prefill(url, API_KEY, path, model)
    if reply is None:
        raise RuntimeError("POST /v1/cache/prefill failed")
    return {**reply, "prefill_s": time.perf_counter() - start}


def clear(client: httpx.Client) -> None:
    client.delete("/v1/cache").raise_for_status()


def run_rounds(url: str, model: str, body: dict, user_agent: str, rounds: int, max_tokens: int) -> list[dict]:
    """The warm-up turn, then `rounds` pairs of (cold, pre-warmed) rows."""
    body = {**body, "model": model}
    rows = []
    with httpx.Client(base_url=url, timeout=agent_prewarm.PREFILL_TIMEOUT_S, trust_env=False) as client, \
            tempfile.TemporaryDirectory(prefix="mlxhost-bench-prewarm-") as folder:
        warmup = stream_turn(client, body, user_agent, max_tokens)  # compiles; the server notes the prefix
        print(f"warm-up: {warmup['prompt_tokens']} prompt tokens, first turn {warmup['ttft_s']:.2f} s", flush=True)
        for i in range(rounds):
            clear(client)
            cold = stream_turn(client, body, user_agent, max_tokens)
            rows.append({"round": i, "phase": "cold", **cold, "prefill_s": None})
            clear(client)
            warmed = prewarm(url, model, user_agent, Path(folder))
            turn = stream_turn(client, with_question(body, QUESTIONS[i % len(QUESTIONS)]), user_agent, max_tokens)
            rows.append({"round": i, "phase": "pre-warmed", **turn, "prefill_s": warmed["prefill_s"],
                         "prefill_prompt_tokens": warmed["prompt_tokens"],
                         "prefill_computed_tokens": warmed["computed_tokens"]})
            print(f"round {i}: cold ttft {cold['ttft_s']:.3f} s ({cold['cached_tokens']} cached), pre-warmed "
                  f"{turn['ttft_s']:.3f} s ({turn['cached_tokens']} cached; prefill call {warmed['prefill_s']:.2f} s)",
                  flush=True)
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """A row per phase: the median of each number over the rounds."""
    out = []
    for phase in ("cold", "pre-warmed"):
        mine = [r for r in rows if r["phase"] == phase]
        row: dict = {"phase": phase, "num_rounds": len(mine)}
        for key in ("prompt_tokens", "cached_tokens", "ttft_s", "e2e_s", "prefill_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for key in ("prompt_tokens", "cached_tokens"):
            row[key] = None if row[key] is None else int(row[key])
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    from mlxhost.testing.demo import ensure_demo_model  # lazy: builds the demo model only when no --model

    request = Path(args.request)
    if not request.is_file():  # the default capture ships with the source tree, not with an installed wheel
        raise SystemExit(f"no captured request at {request}: pass --request FILE (an Anthropic Messages body), or run "
                         "from a checkout of the source tree")
    body = json.loads(request.read_text(encoding="utf-8"))
    model = args.model or str(ensure_demo_model())
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # Errors only: a long prompt's prefill logs a slow-step warning per chunk, which would bury the table.
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", model, "--port", str(port),
           "--served-model-name", "bench", "--no-web-ui", "--log-level", "error", *args.serve_args]
    with _running(cmd, url, args.startup_timeout, args.kernel_cache):
        rows = run_rounds(url, "bench", body, args.user_agent, args.rounds, args.max_tokens)
    table = medians(rows)
    print(format_table(table, COLUMNS))
    cold, warm = table
    if cold["ttft_s"] and warm["ttft_s"]:
        print(f"pre-warmed / cold ttft: x{warm['ttft_s'] / cold['ttft_s']:.3f}")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_json(args.output_json or default_json_path("prewarm"), {"config": config, "medians": table,
                                                                          "rounds": rows})
    print(f"wrote {path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the demo model)")
    parser.add_argument("--request", default=str(DEFAULT_REQUEST),
                        help="an agent's captured first turn, an Anthropic Messages body (default: Claude Code's)")
    parser.add_argument("--user-agent", default=USER_AGENT,
                        help="the agent's User-Agent, under which the server notes its prefix")
    parser.add_argument("--rounds", type=int, default=3, help="cold / pre-warmed pairs; the table has medians")
    parser.add_argument("--max-tokens", type=int, default=8, help="completion tokens per turn (TTFT is the point)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the server may take to start")
    add_serve_args_argument(parser)
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-prewarm-<time>.json)")
