"""`POST /api/pull` as `mlxhost pull`: a Hugging Face id (also spelled `hf.co/owner/name`) is downloaded
into the Hugging Face cache, with Ollama's status lines; an Ollama library name (`llama3.2:1b`) is a
400 that says what to send instead. The download runs on a worker thread; a downloaded model is served
once a server is started with it (this server serves the models it was started with).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, AsyncIterator, Callable

from mlxhost.frontends.common.errors import APIError

log = logging.getLogger(__name__)

_HUB_PREFIXES = ("https://huggingface.co/", "huggingface.co/", "hf.co/")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# While a download runs, a status line this often: clients and proxies see the stream is alive.
_PROGRESS_EVERY_S = 2.0


def hub_id(name: str) -> str:
    """The Hugging Face id an Ollama pull names; APIError(400) for anything else."""
    repo = name.strip()
    for prefix in _HUB_PREFIXES:
        if repo.startswith(prefix):
            repo = repo[len(prefix):]
            break
    repo, _, tag = repo.partition(":")
    if tag not in ("", "latest"):
        raise APIError(400, f"pull {name!r}: tags pick Ollama files (quantizations) that Hugging Face repositories do"
                       " not have; send the repository id alone, e.g. mlx-community/Qwen3-0.6B-4bit", "model")
    if not _HUB_ID.match(repo):
        raise APIError(400, f"pull {name!r}: mlxhost pulls Hugging Face model ids (owner/name, e.g. "
                       "mlx-community/Qwen3-0.6B-4bit), not Ollama library names", "model")
    return repo


def default_pull(repo_id: str) -> str:
    """Checks the hub answers for `repo_id` (one quick request), then downloads it; returns the folder.
    Runs on a worker thread. Raises HubError (no such repository, no network) or OSError."""
    from mlxhost.models.pull import check_on_hub, pull  # the hub client and tqdm: only when pulling

    check_on_hub(repo_id)
    return str(pull(repo_id))


def pull_error(exc: Exception) -> APIError:
    from mlxhost.models.pull import HubError  # as above: only once a pull failed

    if isinstance(exc, HubError):
        # The hub refused or could not be reached: an upstream failure, said as `mlxhost pull` says it.
        return APIError(502, f"pull failed: {exc}")
    return APIError(502, f"pull failed: {type(exc).__name__}: {exc}")


async def pull_lines(repo_id: str, pull_fn: Callable[[str], Any]) -> AsyncIterator[dict]:
    """Ollama's status objects for a pull: `pulling manifest`, progress while it downloads, `success`
    (or one `{"error": ...}`)."""
    yield {"status": "pulling manifest"}
    task = asyncio.ensure_future(asyncio.to_thread(pull_fn, repo_id))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_PROGRESS_EVERY_S)
            if done:
                break
            yield {"status": f"downloading {repo_id}"}
        folder = task.result()
    except Exception as exc:  # noqa: BLE001  every failure becomes the stream's error line
        log.info("/api/pull %s: %s", repo_id, exc)
        yield {"error": pull_error(exc).message}
        return
    finally:
        if not task.done():
            task.cancel()  # the client left: the thread finishes its file; nothing waits for it
    yield {"status": f"downloaded to {folder}; serve it with: mlxhost serve {repo_id}"}
    yield {"status": "success"}
