"""The start-up banner: where the server listens, what it serves, its memory budget, its endpoints and
a request to paste, printed once the models are up (the app's lifespan calls `app.state.on_ready`)."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxhost import __version__
from mlxhost.memory.budget import BudgetConfig, compute_ceiling
from mlxhost.memory.device import read_memory
from mlxhost.platform.blas import INSTALL_HINT
from mlxhost.testing import demo

# One line per front door: the paths a client is pointed at, not every route (/docs lists them all).
ENDPOINTS = (("OpenAI", "/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/models"),
             ("Anthropic", "/v1/messages"),
             ("Ollama", "/api/* (chat, generate, embed, tags, show, ps, pull, version)"),
             ("server", "/v1/status, /health, /metrics, /version"),
             ("API docs", "/docs, /redoc"))


# A reply of a few tokens: enough to see the server answer, and the demo model's random text stays short.
TRY_MAX_TOKENS = 32
REAL_MODEL_HINT = ("mlxhost serve mlx-community/Qwen3-0.6B-4bit (a hub id), or a local model folder or .gguf"
                   " file")


@dataclass(frozen=True)
class BannerModel:
    name: str
    source: str
    status: str  # the manager's card status: loaded, not_loaded, ...


def is_demo_source(source: str) -> bool:
    """The built-in demo model (`mlxhost serve` with no model): tiny, random weights."""
    try:
        return Path(source).expanduser().resolve() == demo.default_demo_model_dir().resolve()
    except OSError:
        return False


def display_url(host: str, port: int) -> str:
    # 0.0.0.0 / :: listen everywhere but cannot be dialled: show the loopback address to paste.
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def try_lines(url: str, model: str, needs_key: bool) -> list[str]:
    """A curl line and a Python line that need nothing beyond Python itself (the openai package is no
    dependency of the plain install): each asks `model` for a short reply."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": TRY_MAX_TOKENS}
    auth = ' -H "Authorization: Bearer $MLXHOST_API_KEY"' if needs_key else ""
    headers = '{"Content-Type": "application/json"' + (
        ', "Authorization": "Bearer " + os.environ["MLXHOST_API_KEY"]}' if needs_key else "}")
    code = (f"import json,{' os,' if needs_key else ''} urllib.request as u; "
            f"r = u.Request({json.dumps(url + '/v1/chat/completions')}, data=json.dumps({json.dumps(body)}).encode(),"
            f" headers={headers}); "
            'print(json.load(u.urlopen(r))["choices"][0]["message"]["content"])')
    curl = f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth}"
    return [f"{curl} -d {shlex.quote(json.dumps(body))}", f"python3 -c {shlex.quote(code)}"]


def endpoint_lines(url: str, web_ui: bool = True) -> list[str]:
    width = max(len(name) for name, _ in ENDPOINTS) + 2
    lines = [f"  web page   {url}/  (chat and dashboard)"] if web_ui else []
    return lines + [f"  {'endpoints' if i == 0 else '':<11}{name:<{width}}{paths}"
                    for i, (name, paths) in enumerate(ENDPOINTS)]


def format_banner(version: str, url: str, models: list[BannerModel], memory: str, needs_key: bool,
                  all_interfaces: bool = False, demo: bool = False, web_ui: bool = True,
                  speed_hint: str | None = None) -> str:
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
    lines = [f"mlxhost {version} ready on {url}{where}", model_line]
    if demo:
        lines += ["  note       the demo model has random weights: its replies are gibberish by design",
                  f"  real model {REAL_MODEL_HINT}"]
    lines.append(f"  memory     {memory}")
    if speed_hint:
        lines.append(f"  speed      {speed_hint}")
    lines += endpoint_lines(url, web_ui)
    lines.append("  try it:")
    lines += ["    " + line for line in try_lines(url, first, needs_key)]
    lines.append(f"    or any OpenAI client with base_url={url}/v1")
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
    ceiling = compute_ceiling(read_memory(), BudgetConfig(mode=mode, memory_utilization=utilization))
    return f"{mode} ceiling {ceiling / (1 << 30):.2f} GiB for all models (each budgets its KV when it loads)"


def blas_hint(blas) -> str | None:
    """A line for a CPU user whose MLX multiplies with its slow reference BLAS (platform/blas.py)."""
    if blas is None or not blas.slow:
        return None
    return (f"MLX's CPU matmul here is the slow reference BLAS: `{INSTALL_HINT}` and restart"
            " (mlxhost loads OpenBLAS by itself; float32 matmul ~10x faster)")


def make_ready_hook(config, manager, specs, port: int, out=None, speed_hint: str | None = None):
    """The coroutine the app's lifespan awaits once the models' engines run: prints the banner."""
    async def on_ready() -> None:
        cards = manager.cards()
        models = [BannerModel(c["id"], spec.source, c["status"]) for c, spec in zip(cards, specs)]
        engines = manager.loaded_engines()
        if engines:
            budget, kv_tokens = await engines[0].call(lambda core: (core.budget, core.stats().kv_capacity_tokens))
            memory = memory_line(budget, kv_tokens)
        else:
            memory = ceiling_line(config.engine.memory_mode, config.engine.memory_utilization)
        text = format_banner(__version__, display_url(config.host, port), models, memory,
                             needs_key=bool(config.security.api_keys),
                             all_interfaces=config.host in ("0.0.0.0", "::", ""),
                             demo=any(is_demo_source(spec.source) for spec in specs), web_ui=config.web_ui,
                             speed_hint=speed_hint)
        print(text, file=out or sys.stderr, flush=True)

    return on_ready
