"""A served model whose forward can be held, for tests of a step that takes minutes (a big model on a CPU).

`python -m mlxhost.testing.held_step MODEL_DIR --port N --hold-file PATH [--shutdown-timeout S]` serves
MODEL_DIR (e.g. a demo model folder) as `mlxhost serve` does: the port bound first, the model loaded the
usual way, then served until a signal. While PATH exists, each forward of the model waits (up to
`MAX_HOLD_S`), so the engine step it is part of lasts as long as the test wants; PATH.held appears once a
forward waits. The model is loaded before the file is made, so start-up's forwards run at their usual speed.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from mlxhost.config import ServerConfig
from mlxhost.models.loader import load_model

# A held forward lets go after this long even if the file stays: a leaked server ends its step in time.
MAX_HOLD_S = 120.0
_POLL_S = 0.02


class _HeldForward:
    """Put before the model's own class: its forward waits while `_hold_file` exists."""

    _hold_file: str = ""

    def __call__(self, *args, **kwargs):
        give_up = time.monotonic() + MAX_HOLD_S
        if os.path.exists(self._hold_file):
            open(self._hold_file + ".held", "w").close()  # tells the test a step is inside the forward
        while os.path.exists(self._hold_file) and time.monotonic() < give_up:
            time.sleep(_POLL_S)  # releases the GIL, as a long MLX evaluation does
        return super().__call__(*args, **kwargs)


def hold_forward(model, hold_file: str) -> None:
    """Makes `model`'s forward wait while `hold_file` exists: a subclass of its own class, so every
    attribute the engine reads (layers, args, make_cache) stays the model's."""
    model.__class__ = type(f"Held{type(model).__name__}", (_HeldForward, type(model)), {"_hold_file": hold_file})


def main(argv: list[str] | None = None) -> int:
    from mlxhost.server import process  # lazy: pulls in uvicorn
    from mlxhost.server.app import build_app  # lazy: pulls in fastapi

    parser = argparse.ArgumentParser(prog="python -m mlxhost.testing.held_step")
    parser.add_argument("model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hold-file", required=True)
    parser.add_argument("--shutdown-timeout", type=float, default=ServerConfig().shutdown_timeout_s)
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(model=args.model, served_model_name="tiny", host="127.0.0.1", port=args.port,
                          log_level="warning", shutdown_timeout_s=args.shutdown_timeout)
    sock = process.bind(config.host, config.port)
    loaded = load_model(config.model, config.load_strategy)
    hold_forward(loaded.model, args.hold_file)
    app = build_app(config, loaded)
    process.run(app, sock, config.log_level, config.shutdown_timeout_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
