"""`mlxhost launch AGENT [MODEL] [-- AGENT ARGS]`: reuses the server answering at --host/--port (or starts one
that stops with the agent), then runs the agent against it; the agent's exit code is launch's."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import platformdirs

from mlxhost.agents import AGENTS
from mlxhost.agents.base import MAX_OUTPUT_TOKENS, Target, default_max_output_tokens
from mlxhost.agents.prewarm import agent_version, prefill, prefix_path, save_prefix, start_prefill

if TYPE_CHECKING:  # imported where used: `mlxhost serve` builds this parser too (0.4 s)
    import httpx

_PLACEHOLDER_KEY = "mlxhost"  # a server without --api-key takes any key; agents insist on having one


class LaunchError(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", choices=sorted(AGENTS), metavar="AGENT",
                   help="the coding agent to run: " + ", ".join(sorted(AGENTS)))
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model to serve: a folder or hub id, or the name a running server knows it by (default: "
                        "the running server's model, or the demo model)")
    p.add_argument("--host", default="127.0.0.1", help="where the server listens (or is started)")
    p.add_argument("--port", type=int, default=8000, help="the server's port")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="key the agent sends (default: the first of MLXHOST_API_KEY, else a placeholder)")
    p.add_argument("--max-output-tokens", type=int, default=None, metavar="N",
                   help="most tokens per answer the agent asks for (default: a quarter of the context, at most 32000)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="passed to a started `mlxhost serve` (repeatable; --serve-arg=--max-num-seqs=8)")
    p.add_argument("--prewarm", choices=("background", "wait", "off"), default="background",
                   help="compute the agent's saved system prompt and tools into the server's cache before its first "
                        "turn: beside the agent starting (background), before it (wait), or not (off); saved from "
                        "the first run of each agent version on each model")
    p.add_argument("--start-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long a started server may take to load its model")
    p.epilog = "Arguments after -- go to the agent: mlxhost launch codex -- exec 'explain this repository'"
    p.set_defaults(agent_args=[])


def split_agent_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`mlxhost [--log-level L] launch ... -- ARGS`: (argv without `-- ARGS`, ARGS). argparse drops a `--` that
    follows the positionals directly, which would make `launch codex -- exec hi` read `exec` as the model."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--log-level" else 1
    if i >= len(argv) or argv[i] != "launch" or "--" not in argv[i:]:
        return argv, []
    cut = argv.index("--", i)
    return argv[:cut], argv[cut + 1:]


def agent_clis_prefix() -> pathlib.Path:
    """Where tools/install-agent-clis.sh installs the pinned CLIs."""
    default = pathlib.Path.home() / ".cache" / "mlxhost" / "agent-clis"
    return pathlib.Path(os.environ.get("MLXHOST_AGENT_CLIS") or default)


def find_command(command: str) -> str | None:
    return shutil.which(command) or shutil.which(command, path=str(agent_clis_prefix() / "bin"))


def agent_folder(name: str) -> pathlib.Path:
    return pathlib.Path(platformdirs.user_cache_dir("mlxhost")) / "agents" / name


def find_model(url: str, model: str | None, api_key: str, client: httpx.Client | None = None) -> dict | None:
    """The model card (/v1/models) of `model` (None: the server's first loaded model) at url; None when
    nothing answers there. A server without that model is a LaunchError."""
    import httpx  # lazy: httpx only when used

    http = client or httpx.Client(timeout=30)
    try:
        reply = http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    except httpx.TransportError:
        return None
    finally:
        if client is None:
            http.close()
    if reply.status_code == 401:
        raise LaunchError(f"the server at {url} wants an API key: pass --api-key or set MLXHOST_API_KEY")
    cards = reply.json().get("data", []) if reply.status_code == 200 else []
    if not cards:
        raise LaunchError(f"{url} answers but lists no models (HTTP {reply.status_code}): not an mlxhost server?")
    if model is None:
        return next((c for c in cards if c.get("status") == "loaded"), cards[0])
    for card in cards:
        if model == card["id"] or model in card.get("aliases", ()):
            return card
    names = ", ".join(c["id"] for c in cards)
    raise LaunchError(f"the server at {url} serves {names}, not {model}: stop it, or pick another --port")


def _context(url: str, card: dict, api_key: str) -> int:
    import httpx  # lazy: httpx only when used

    if card.get("max_model_len") is None:  # listed, not loaded yet: loading tells its context
        httpx.post(f"{url}/v1/models/{card['id']}/load", headers={"Authorization": f"Bearer {api_key}"}, timeout=None)
        card = find_model(url, card["id"], api_key)
    return int(card["max_model_len"])


def start_server(args, log_path: pathlib.Path) -> subprocess.Popen:
    # Codex sends no answer limit and fails a turn whose answer was cut: the server's default (2048) would cut
    # long answers. The server still keeps each answer within the context; --serve-arg comes last and wins.
    default_max_tokens = args.max_output_tokens or MAX_OUTPUT_TOKENS
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", *([args.model] if args.model else []),
           "--host", args.host, "--port", str(args.port), "--default-max-tokens", str(default_max_tokens),
           *args.serve_arg]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        # A session of its own: Ctrl-C in the agent's terminal goes to the agent, not to the server.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait_ready(server: subprocess.Popen, url: str, model: str | None, api_key: str, timeout_s: float,
               log_path: pathlib.Path) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise LaunchError(f"the server exited with code {server.returncode}:\n  " + "\n  ".join(tail))
        card = find_model(url, None, api_key)
        if card is not None:
            # A started server serves one model, whatever name it gave it.
            return card if model is None else (_find_or(url, model, api_key) or card)
        time.sleep(0.5)
    raise LaunchError(f"the server did not answer within {timeout_s:.0f} s (log: {log_path})")


def _find_or(url: str, model: str, api_key: str) -> dict | None:
    try:
        return find_model(url, model, api_key)
    except LaunchError:
        return None


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextlib.contextmanager
def _sigint_to_child():
    """Ctrl-C belongs to the agent (it reaches the whole foreground group): launch waits for it to exit."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _prewarm(url: str, api_key: str, saved: pathlib.Path, model: str, wait: bool) -> None:
    if not wait:
        start_prefill(url, api_key, saved, model)
        return
    print("mlxhost launch: pre-warming the agent's system prompt and tools", file=sys.stderr)
    done = prefill(url, api_key, saved, model)
    if done is not None:
        print(f"mlxhost launch: pre-warmed {done['prompt_tokens']} tokens ({done['cached_tokens']} already cached)",
              file=sys.stderr)


def run(args) -> int:
    import httpx  # lazy: httpx only when used

    agent = AGENTS[args.agent]
    executable = find_command(agent.command)
    if executable is None:
        print(f"mlxhost launch: `{agent.command}` is not installed; install it with:\n  {agent.install_command}",
              file=sys.stderr)
        return 127
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}"
    keys = [k.strip() for k in os.environ.get("MLXHOST_API_KEY", "").split(",") if k.strip()]
    api_key = args.api_key or (keys[0] if keys else _PLACEHOLDER_KEY)
    server = None
    try:
        card = find_model(url, args.model, api_key)
        if card is None:
            log_path = agent_folder("server") / f"serve-{args.port}.log"
            print(f"mlxhost launch: starting a server at {url} (log: {log_path})", file=sys.stderr)
            server = start_server(args, log_path)
            card = wait_ready(server, url, args.model, api_key, args.start_timeout, log_path)
        context = _context(url, card, api_key)
        target = Target(url=url, model=card["id"], api_key=api_key, context_tokens=context,
                        max_output_tokens=args.max_output_tokens or default_max_output_tokens(context))
        setup = agent.configure(target, agent_folder(agent.name))
        print(f"mlxhost launch: {agent.name} on {target.model} at {url} (context {context} tokens, answers up to "
              f"{target.max_output_tokens})", file=sys.stderr)
        version = agent_version(executable) if agent.user_agent and args.prewarm != "off" else None
        saved = prefix_path(agent_folder(agent.name), version, target.model) if version else None
        if saved is not None and saved.exists():
            _prewarm(url, api_key, saved, target.model, args.prewarm == "wait")
        with _sigint_to_child():
            code = subprocess.call([executable, *setup.args, *args.agent_args], env={**os.environ, **setup.env})
        if saved is not None and not saved.exists() and save_prefix(url, api_key, agent, version, target.model, saved):
            print(f"mlxhost launch: saved {agent.name} {version}'s prompt prefix for the next start ({saved})",
                  file=sys.stderr)
        return code
    except (LaunchError, httpx.HTTPError) as e:
        print(f"mlxhost launch: {e}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            stop_server(server)
