"""The one stream loop of every dialect: engine outputs in, the dialect's frames out. The loop decides what
happens (a heartbeat while nothing comes, an output, the failure, the end); the dialect only writes each
event in its own shape, so shutdown, a grammar's dead end, an engine fault and a client that leaves behave
the same in every dialect and for n > 1. Imports no MLX."""

from __future__ import annotations

import logging
from typing import AsyncIterator, Protocol

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.errors import output_error
from mlxhost.frontends.common.metrics import RequestTimer
from mlxhost.frontends.common.sse import heartbeats
from mlxhost.serving.errors import APIError

log = logging.getLogger(__name__)


class Frames(Protocol):
    """One dialect's stream events, as text to send."""

    def start(self) -> str:
        """Sent at once, before the prompt prefills: the first bytes a client's idle timer sees."""

    def waiting(self) -> str:
        """Sent whenever the heartbeat interval passes with no output (a prompt prefilling, a queue)."""

    def output(self, out: RequestOutput) -> str | None:
        """One engine output's events; None or "" when it shows nothing yet."""

    def error(self, error: APIError, out: RequestOutput | None) -> str:
        """The stream's last frames when its request failed: `error` typed once (errors.output_error), `out` the
        output that carried it (None when the failure came from elsewhere, e.g. n > 1 copies refused)."""

    def end(self, last: RequestOutput | None) -> str:
        """The stream's last frames after its last output."""


async def stream(outputs: AsyncIterator[RequestOutput], frames: Frames, timer: RequestTimer) -> AsyncIterator[str]:
    """`outputs` as `frames`' text. A client that leaves closes this generator: the outputs are closed with it,
    which aborts their requests."""
    yield frames.start()
    beats = heartbeats(outputs, timer.heartbeat_s)
    last: RequestOutput | None = None
    failed: tuple[APIError, RequestOutput | None] | None = None
    try:
        async for out in beats:
            if out is None:
                yield frames.waiting()
                continue
            if out.error:
                failed = output_error(out), out
                break
            timer.on_output(out)
            last = out
            text = frames.output(out)
            if text:
                yield text
    except APIError as exc:  # refused while the stream ran (n > 1: the copies could not be queued)
        failed = exc, None
    except Exception as exc:  # a bug: the client still learns the stream failed, in its dialect's shape
        log.exception("stream failed")
        failed = APIError(500, f"internal error: {exc}"), None
    finally:
        await beats.aclose()  # now, not when collected: n > 1's other choices stop with the stream
    timer.done(last)
    yield frames.error(*failed) if failed is not None else frames.end(last)
