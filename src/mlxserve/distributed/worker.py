"""Entry point of the ranks mlxserve starts itself on one host: `python -m mlxserve.distributed.worker`.

Everything it needs comes from rank 0 (setup) and the environment (MLX_RANK, MLX_HOSTFILE or NCCL's
rendezvous); it exits when its parent does, so a killed server leaves no rank behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from mlxserve.distributed.launch import BACKEND_ENV, LOG_LEVEL_ENV, PARENT_ENV, WORLD_ENV, init_group


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            logging.getLogger(__name__).error("rank 0 (pid %d) is gone: exiting", parent)
            os._exit(1)


def main() -> int:
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
                        format=f"%(asctime)s %(levelname)s rank{os.environ.get('MLX_RANK', '?')} %(name)s: %(message)s")
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if parent:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    from mlxserve.distributed.serve import run_follower

    backend = os.environ.get(BACKEND_ENV, "ring")
    try:
        group = init_group(backend, int(os.environ[WORLD_ENV]))
        run_follower(group, backend)
    except Exception as exc:
        logging.getLogger(__name__).error("rank %s stops: %s", os.environ.get("MLX_RANK"), exc, exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
