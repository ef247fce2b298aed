"""A server that decoded a video on a pool thread can still start a subprocess from its event loop (uvloop forks,
and the child frees the other threads' state before it execs): PyAV 18.1.1's reformatter hung that child, and
uvloop's spawn with it, so an MCP stdio server never started (pyproject.toml excludes that release)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import asyncio, concurrent.futures, io
import av, numpy as np, uvloop
from mlxhost.config import MediaConfig
from mlxhost.multimodal.video import decode_video

buf = io.BytesIO()
with av.open(buf, "w", format="mp4") as out:
    stream = out.add_stream("mpeg4", rate=10)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    for i in range(20):
        frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, dtype=np.uint8), format="rgb24")
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
pool = concurrent.futures.ThreadPoolExecutor(2)  # alive, as a server's executor is
frames = pool.submit(decode_video, buf.getvalue(), MediaConfig(), 2.0, 4).result()
assert frames.frames

async def spawn():
    proc = await asyncio.create_subprocess_exec("true", start_new_session=True)
    return await proc.wait()

print("spawned", uvloop.run(spawn()), flush=True)
"""


def test_a_subprocess_starts_after_a_video_was_decoded_on_a_pool_thread():
    try:
        done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("spawning a subprocess under uvloop hung after a video was decoded on a pool thread")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "spawned 0" in done.stdout
