"""Entry point of the ranks mlxhost starts itself on one host: `python -m mlxhost.distributed.worker`.

Everything it needs comes from rank 0 (setup, over the control connection named by MLXSRV_CONTROL) and
the environment (MLX_RANK, MLX_HOSTFILE or NCCL's rendezvous); it exits when its parent does, so a
killed server leaves no rank behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from mlxhost.distributed.launch import CONTROL_ENV, LOG_LEVEL_ENV, PARENT_ENV, WORLD_ENV, dump_stacks_on_sigusr1
from mlxhost.distributed.serve import follower_main


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            logging.getLogger(__name__).error("rank 0 (pid %d) is gone: exiting", parent)
            os._exit(1)


def main() -> int:
    rank = os.environ.get("MLX_RANK", "?")
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if parent:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()

    dump_stacks_on_sigusr1()

    try:
        return follower_main(os.environ[CONTROL_ENV], int(rank), int(os.environ[WORLD_ENV]))
    except Exception as exc:  # before the connection to rank 0 exists (rank 0 sees this rank exit)
        logging.getLogger(__name__).error("rank %s stops: %s", rank, exc, exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
