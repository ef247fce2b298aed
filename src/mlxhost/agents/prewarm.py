"""Warm starts: an agent's fixed prompt prefix (system prompt and tools), saved once per agent version and model,
computed into the server's prefix cache before the agent's next conversation starts.

Capture: the server notes, per User-Agent and model, the largest prefix before the first user message of the
requests it served (frontends/common/prefixes.py, `GET /v1/cache/prefixes`). After a launched agent exits, the
prefix under the agent's User-Agent and version is saved to `<agent folder>/prefixes/<version>--<model>.json`
(an OpenAI chat body, whatever dialect the agent speaks: the server's one internal request).
Pre-warm: a later launch of the same version on the same model posts it to `POST /v1/cache/prefill` before the
agent starts (`--prewarm wait`) or beside it (`background`, the default: requests needing blocks being
prefilled wait for them, so nothing is computed twice). A new version has no file yet: it is captured again.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import threading

from mlxhost.agents.base import Agent, write_json

VERSION = re.compile(r"\d+(?:\.\d+)+[\w.+-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# A prefill's own answer comes when the prompt is computed: minutes for a long one on a slow machine.
PREFILL_TIMEOUT_S = 3600.0


def agent_version(executable: str) -> str | None:
    """The agent's version from `EXECUTABLE --version` (`2.1.332 (Claude Code)`); None if it tells none."""
    try:
        done = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = VERSION.search(done.stdout or "")
    return found.group(0) if done.returncode == 0 and found else None


def prefix_path(folder: pathlib.Path, version: str, model: str) -> pathlib.Path:
    return folder / "prefixes" / f"{_UNSAFE.sub('_', version)}--{_UNSAFE.sub('_', model)}.json"


def save_prefix(url: str, api_key: str, agent: Agent, version: str, model: str, path: pathlib.Path) -> bool:
    """Saves the prefix the server noted for this agent version and model; False if it noted none."""
    import httpx  # lazy: httpx only when used

    reply = httpx.get(f"{url}/v1/cache/prefixes", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    if reply.status_code != 200:  # an older server without the route
        return False
    wanted = f"{agent.user_agent}{version}"
    found = [p for p in reply.json().get("data", ())
             if p.get("model") == model and (p.get("user_agent") or "").startswith(wanted)]
    if not found:
        return False
    best = max(found, key=lambda p: p.get("num_chars", 0))
    write_json(path, {"agent": agent.name, "version": version, "model": model, "user_agent": best["user_agent"],
                      "body": best["body"]})
    return True


def prefill(url: str, api_key: str, path: pathlib.Path, model: str) -> dict | None:
    """Posts the saved prefix to /v1/cache/prefill; its answer (tokens computed, cached), None on failure."""
    import httpx  # lazy: httpx only when used

    try:
        body = json.loads(path.read_text(encoding="utf-8"))["body"]
    except (OSError, ValueError, KeyError):
        return None
    # The served name may differ from the one saved under (an alias); a prompt cache key keeps the blocks
    # ahead of plain LRU eviction until the agent's first turn reads them (each hit renews it).
    body = {**body, "api": "chat", "model": model, "prompt_cache_key": body.get("prompt_cache_key") or "mlxhost-launch"}
    try:
        reply = httpx.post(f"{url}/v1/cache/prefill", json=body, headers={"Authorization": f"Bearer {api_key}"},
                           timeout=PREFILL_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return reply.json() if reply.status_code == 200 else None


def start_prefill(url: str, api_key: str, path: pathlib.Path, model: str) -> threading.Thread:
    """`prefill` beside the agent: a daemon thread, so launch never waits for it once the agent exits."""
    thread = threading.Thread(target=prefill, args=(url, api_key, path, model), name="prewarm", daemon=True)
    thread.start()
    return thread
