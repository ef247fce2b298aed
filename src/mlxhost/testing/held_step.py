"""A served model whose forward can be held, for tests of a step that takes minutes (a big model on a CPU).

`python -m mlxhost.testing.held_step MODEL_DIR --port N --hold-file PATH [--shutdown-timeout S]
[--default-max-tokens N] [--log-level L] [--end-chance P] [--max-hold S]` serves
MODEL_DIR (e.g. a demo model folder) as `mlxhost serve` does: the port bound first, the model loaded the
usual way, then served until a signal. While PATH exists, each forward of the model waits (up to
`--max-hold`, MAX_HOLD_S by default), so the engine step it is part of lasts as long as the test wants; PATH.held appears once a
forward waits. The model is loaded before the file is made, so start-up's forwards run at their usual speed.
`--end-chance P` makes each sampled token (temperature 1) the end-of-text token with probability P: a random
model's answers otherwise run for thousands of tokens, and some clients (Claude Code) fail an answer cut short.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time

import mlx.core as mx

from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.models.loader import load_model

# A held forward lets go after this long even if the file stays: a leaked server ends its step in time.
MAX_HOLD_S = 120.0
_POLL_S = 0.02


class _HeldForward:
    """Put before the model's own class: its forward waits while `_hold_file` exists."""

    _hold_file: str = ""
    _max_hold_s: float = MAX_HOLD_S
    _end_token: int | None = None  # given the logit that makes it `_end_chance` likely at temperature 1
    _end_chance: float = 0.0

    def __call__(self, *args, **kwargs):
        give_up = time.monotonic() + self._max_hold_s
        if os.path.exists(self._hold_file):
            open(self._hold_file + ".held", "w").close()  # tells the test a step is inside the forward
        while os.path.exists(self._hold_file) and time.monotonic() < give_up:
            time.sleep(_POLL_S)  # releases the GIL, as a long MLX evaluation does
        logits = super().__call__(*args, **kwargs)
        if self._end_token is None:
            return logits
        # softmax(logits)[end] = p when its logit is log(sum of the others' exp) + log(p / (1 - p)).
        others = mx.logsumexp(logits, axis=-1)
        logits[..., self._end_token] = others + math.log(self._end_chance / (1 - self._end_chance))
        return logits


def hold_forward(model, hold_file: str, end_token: int | None = None, end_chance: float = 0.0,
                 max_hold_s: float = MAX_HOLD_S) -> None:
    """Makes `model`'s forward wait while `hold_file` exists, and its answers end with `end_chance` per token
    when `end_token` is given: a subclass of its own class, so every attribute the engine reads (layers, args,
    make_cache) stays the model's."""
    fields = {"_hold_file": hold_file, "_end_token": end_token if end_chance > 0 else None, "_end_chance": end_chance,
              "_max_hold_s": max_hold_s}
    model.__class__ = type(f"Held{type(model).__name__}", (_HeldForward, type(model)), fields)


def main(argv: list[str] | None = None) -> int:
    from mlxhost.server import process  # lazy: pulls in uvicorn
    from mlxhost.server.app import build_app  # lazy: pulls in fastapi

    parser = argparse.ArgumentParser(prog="python -m mlxhost.testing.held_step")
    parser.add_argument("model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hold-file", required=True)
    parser.add_argument("--shutdown-timeout", type=float, default=ServerConfig().shutdown_timeout_s)
    parser.add_argument("--default-max-tokens", type=int, default=EngineConfig().default_max_tokens)
    parser.add_argument("--log-level", default="warning", help="info logs each request (uvicorn's access log)")
    parser.add_argument("--end-chance", type=float, default=0.0, help="each token ends the answer with this chance")
    parser.add_argument("--max-hold", type=float, default=MAX_HOLD_S, help="a forward waits this long at most")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(model=args.model, served_model_name="tiny", host="127.0.0.1", port=args.port,
                          log_level=args.log_level, shutdown_timeout_s=args.shutdown_timeout,
                          engine=EngineConfig(default_max_tokens=args.default_max_tokens))
    sock = process.bind(config.host, config.port)
    loaded = load_model(config.model, config.load_strategy)
    hold_forward(loaded.model, args.hold_file, min(loaded.eos_token_ids), args.end_chance, args.max_hold)
    app = build_app(config, loaded)
    process.run(app, sock, config.log_level, config.shutdown_timeout_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
