"""`mlxhost pull HF_ID`: download a model into the Hugging Face cache (or `--local-dir`).

huggingface_hub's `snapshot_download` does the work: the cache layout mlx-lm's loader reads, resumed
partial files, parallel downloads. Its progress bars hide themselves when stderr is not a terminal
(its TTY auto-detection); ours stay on, so a pull in CI or under `nohup` still shows it moves.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from mlxhost.models.catalog import describe, format_size


class _VisibleTqdm(tqdm):
    """A plain tqdm (not huggingface_hub's subclass, which it would switch off without a terminal)."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)  # huggingface_hub's group name; plain tqdm rejects it
        kwargs.setdefault("file", sys.stderr)
        kwargs.setdefault("mininterval", 0.5)
        super().__init__(*args, **kwargs)


class HubError(Exception):
    """The hub cannot give us `repo_id`; the message says why and what to do next."""


def check_on_hub(repo_id: str, revision: str | None = None, timeout: float = 3.0, pulling: bool = False) -> None:
    """Asks the hub once, within `timeout` and with no retries, whether it serves `repo_id`; HubError if not.
    A download's own requests retry, which is right once the hub has answered but turns a machine with no
    network into half a minute of warnings. `pulling`: the next step for `mlxhost pull` itself."""
    from huggingface_hub import HfApi, constants  # lazy: huggingface_hub only when used

    # lazy: huggingface_hub only when used
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    here = "" if "/" in repo_id or pulling else " and no such folder here"
    if constants.is_offline_mode() and pulling:
        raise HubError(f"HF_HUB_OFFLINE is set: unset it to download {repo_id}")
    if constants.is_offline_mode():
        raise HubError(f"{repo_id} is not in the Hugging Face cache{here}, and HF_HUB_OFFLINE is set: serve a local"
                       f" folder, or unset HF_HUB_OFFLINE and run `mlxhost pull {repo_id}`")
    try:
        HfApi().model_info(repo_id, revision=revision or "main", timeout=timeout)
    except OfflineModeIsEnabled:
        raise HubError(f"{repo_id}: HF_HUB_OFFLINE is set; unset it to download") from None
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated on the hub: accept its terms on huggingface.co, then `hf auth login`"
                       " or set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r} on the hub") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id}: not found on the Hugging Face hub{here} (a private one needs"
                       " `hf auth login` or HF_TOKEN)") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise HubError(f"the Hugging Face hub answered {status} for {repo_id}; try again later, or serve a local"
                       " folder") from None
    except Exception as e:  # noqa: BLE001  the HTTP client's connection and timeout errors: no network
        reason = str(e).strip() or type(e).__name__
        if pulling:
            raise HubError(f"cannot reach the Hugging Face hub ({constants.ENDPOINT}: {reason}): check the network"
                           " (or HTTPS_PROXY) and try again") from None
        raise HubError(f"cannot reach the Hugging Face hub ({constants.ENDPOINT}: {reason}) and {repo_id} is not in"
                       f" its cache{here}: serve a local folder, run `mlxhost pull {repo_id}` when online, or set"
                       " HF_HUB_OFFLINE=1 to use cached models without asking the hub") from None


def pull(repo_id: str, revision: str | None = None, local_dir: str | None = None,
         allow_patterns: list[str] | None = None) -> Path:
    """Downloads `repo_id` at `revision` (a branch, tag or commit; default main) and returns the folder."""
    from huggingface_hub import snapshot_download  # lazy: huggingface_hub only when used

    path = snapshot_download(repo_id, revision=revision, local_dir=local_dir, allow_patterns=allow_patterns,
                             tqdm_class=_VisibleTqdm)
    return Path(path)


def run(args) -> int:
    # lazy: huggingface_hub only when used
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    for name in ("httpx", "httpx2"):  # one INFO line per request would drown the progress bars
        logging.getLogger(name).setLevel(logging.WARNING)
    print(f"pulling {args.repo_id}" + (f" at {args.revision}" if args.revision else ""), file=sys.stderr)
    try:
        check_on_hub(args.repo_id, args.revision, timeout=10.0, pulling=True)  # asked for: may wait longer
    except HubError as e:
        print(f"mlxhost pull: {e}", file=sys.stderr)
        return 2
    try:
        path = pull(args.repo_id, args.revision, args.local_dir, args.include or None)
    except RepositoryNotFoundError:
        print(f"mlxhost pull: {args.repo_id} not found (a private repo needs `hf auth login` or HF_TOKEN)",
              file=sys.stderr)
        return 2
    except LocalEntryNotFoundError as e:
        print(f"mlxhost pull: cannot reach the hub (HF_HUB_OFFLINE set, or no network): {e}", file=sys.stderr)
        return 2
    except (HfHubHTTPError, OSError, ValueError) as e:
        print(f"mlxhost pull: {e}", file=sys.stderr)
        return 2
    model = describe(args.repo_id, path)
    if model is None:
        print(f"{path} (no config.json: not a model folder mlxhost can serve)")
        return 0
    bits = f", {model.bits}-bit" if model.bits else ""
    serve = "servable" if model.servable else f"not servable: {model.why_not}"
    print(f"{path} ({format_size(model.num_bytes)}, {model.family}{bits}, {serve})")
    if model.servable:
        print(f"serve it with: mlxhost serve {args.repo_id if args.local_dir is None else path}", file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("repo_id", metavar="HF_ID", help="Hugging Face model id, e.g. mlx-community/Qwen3-0.6B-4bit")
    p.add_argument("--revision", default=None, metavar="REV", help="branch, tag or commit (default: main)")
    p.add_argument("--local-dir", default=None, metavar="DIR",
                   help="download into this folder instead of the Hugging Face cache (default: the cache,"
                        " HF_HUB_CACHE)")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="only files matching this glob (repeatable; default: every file)")
