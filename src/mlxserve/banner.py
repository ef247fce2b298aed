"""The start-up banner: where the server listens, what it serves, its memory budget, its endpoints and
a request to paste, printed once the models are up (the app's lifespan calls `app.state.on_ready`)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

ENDPOINTS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages",
             "POST /v1/embeddings", "GET /v1/models", "GET /v1/status", "GET /health", "GET /metrics",
             "GET /docs")


@dataclass(frozen=True)
class BannerModel:
    name: str
    source: str
    status: str  # the manager's card status: loaded, not_loaded, ...


def display_url(host: str, port: int) -> str:
    # 0.0.0.0 / :: listen everywhere but cannot be dialled: show the loopback address to paste.
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def format_banner(version: str, url: str, models: list[BannerModel], memory: str, needs_key: bool,
                  all_interfaces: bool = False) -> str:
    first = models[0].name
    where = " (all interfaces)" if all_interfaces else ""
    if len(models) == 1:
        model_line = f"  model      {first}  ({models[0].source})"
    else:
        loaded = [m.name for m in models if m.status == "loaded"]
        lazy = [m.name for m in models if m.status != "loaded"]
        model_line = f"  models     {len(models)}: " + ", ".join(loaded + lazy)
        if lazy:
            model_line += f"  ({len(lazy)} load on first use)"
    auth = ' -H "Authorization: Bearer $MLXSERVE_API_KEY"' if needs_key else ""
    key = 'os.environ["MLXSERVE_API_KEY"]' if needs_key else '"unused"'
    body = json.dumps({"model": first, "messages": [{"role": "user", "content": "Hello!"}]})
    lines = [
        f"mlxserve {version} ready on {url}{where}",
        model_line,
        f"  memory     {memory}",
        "  endpoints  " + ", ".join(e.split()[1] for e in ENDPOINTS),
        "  try it:",
        f"    curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        f'    python -c \'from openai import OpenAI;{" import os;" if needs_key else ""} c = OpenAI(base_url="{url}/v1", api_key={key}); '
        f'print(c.chat.completions.create(model="{first}", messages=[{{"role": "user", "content": "Hello!"}}])'
        f".choices[0].message.content)'",
    ]
    return "\n".join(lines)


def memory_line(budget, kv_tokens: int | None) -> str:
    """One line from an engine's MemoryBudget (memory/budget.py): the ceiling and where it goes."""
    if budget is None:
        return "no budget (the device reports no memory figures): KV grows on demand"
    gib = 1 << 30
    kv = f"KV {budget.kv / gib:.2f} GiB" + (f" ({kv_tokens:,} tokens)" if kv_tokens else "")
    return (f"{budget.mode} budget {budget.ceiling / gib:.2f} GiB = weights {budget.weights / gib:.2f}"
            f" + {kv} + prefix cache {budget.prefix_cache / gib:.2f} + activations {budget.activations / gib:.2f}"
            f" GiB")


def ceiling_line(mode: str, utilization: float) -> str:
    """Before any model is loaded (all lazy): the process ceiling the budget would start from."""
    from mlxserve.memory.budget import BudgetConfig, compute_ceiling
    from mlxserve.memory.device import read_memory

    ceiling = compute_ceiling(read_memory(), BudgetConfig(mode=mode, memory_utilization=utilization))
    return f"{mode} ceiling {ceiling / (1 << 30):.2f} GiB for all models (each budgets its KV when it loads)"


def make_ready_hook(config, manager, specs, port: int, out=None):
    """The coroutine the app's lifespan awaits once the models' engines run: prints the banner."""
    from mlxserve import __version__

    async def on_ready() -> None:
        cards = manager.cards()
        models = [BannerModel(c["id"], spec.source, c["status"]) for c, spec in zip(cards, specs)]
        engines = manager.loaded_engines()
        if engines:
            budget, kv_tokens = await engines[0].call(lambda core: (core.budget, core.kv_capacity_tokens))
            memory = memory_line(budget, kv_tokens)
        else:
            memory = ceiling_line(config.engine.memory_mode, config.engine.memory_utilization)
        text = format_banner(__version__, display_url(config.host, port), models, memory,
                             needs_key=bool(config.security.api_keys),
                             all_interfaces=config.host in ("0.0.0.0", "::", ""))
        print(text, file=out or sys.stderr, flush=True)

    return on_ready
