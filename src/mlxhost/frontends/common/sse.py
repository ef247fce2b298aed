"""Server-sent events as the dialects frame them, the streamed response that carries them, and the
heartbeat that keeps a silent stream alive while its prompt prefills. Imports no MLX."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

from fastapi.responses import Response, StreamingResponse

EVENT_STREAM = "text/event-stream"
# Proxies (nginx) must pass each frame on at once, not buffer the stream.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Not an HTTP status a client reads (it left): nginx's code for "client closed request", in the logs and metrics.
CLIENT_CLOSED = 499
SSE_DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    """A `data:` frame (OpenAI's chunks and audio events)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(name: str, obj: Any) -> str:
    """A named `event:` frame (Anthropic's and Responses' event grammars)."""
    return f"event: {name}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(frames: AsyncIterator[str], media_type: str = EVENT_STREAM) -> StreamingResponse:
    return StreamingResponse(frames, media_type=media_type, headers=STREAM_HEADERS)


def client_gone() -> Response:
    return Response(status_code=CLIENT_CLOSED)


async def heartbeats(outputs: AsyncIterator[Any], every_s: float) -> AsyncIterator[Any]:
    """`outputs`, with a None between them whenever `every_s` seconds pass without one: the caller sends its
    dialect's heartbeat frame then. Leaving early (a client gone mid-prefill cancels the response) stops
    the wait for the next output, which aborts the request as leaving `outputs` itself does."""
    it = aiter(outputs)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                out = task.result()
            except StopAsyncIteration:
                return
            yield out
    finally:
        if pending is not None:
            pending.cancel()  # the stream's own cleanup (the abort) runs as the cancellation lands
        elif hasattr(it, "aclose"):
            with contextlib.suppress(Exception):
                await it.aclose()
