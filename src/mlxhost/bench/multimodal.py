"""`mlxhost bench multimodal`: what the vision cache and the prefix cache save in a conversation
about one image or video, over HTTP against an in-process server.

Each conversation resends the whole history on every turn, as a chat client does: turn 1 asks
about the picture, turns 2 and 3 append the reply and a new question. TTFT is measured per turn (streaming, first
content chunk) under four cache settings: none, vision cache only, prefix (KV) cache only, both.
Every conversation uses a picture never sent before, so the caches only help within it. Requests
run one at a time: the numbers are the caches', not the batcher's.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import tempfile
import threading
import time

import httpx
import numpy as np
from PIL import Image

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import default_json_path, int_list
from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.testing.vlm_demo import build_vlm_folder

SETTINGS = {  # name: (prefix cache on, vision cache on)
    "none": (False, False),
    "vision": (False, True),
    "kv": (True, False),
    "both": (True, True),
}
_QUESTIONS = ("Describe this picture.", "What colors do you see?", "And the shapes?")
_COLUMNS = [
    ("media", "media", ""), ("tokens", "prompt tok", "d"), ("cache", "caches", ""), ("turn1_ms", "turn 1 ms", ".1f"),
    ("turn2_ms", "turn 2 ms", ".1f"), ("turn3_ms", "turn 3 ms", ".1f"), ("speedup2", "t1/t2", ".1f"),
    ("speedup3", "t1/t3", ".1f"),
]


def _image_uri(rng: np.random.Generator, size: int) -> str:
    # Smooth gradients plus noise: compresses like a photo, never equal to another run's picture.
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1)
    pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _video_uri(rng: np.random.Generator, num_frames: int, size: int, fps: float) -> str:
    import av  # optional: the vision extra

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=int(fps))
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(num_frames):
            frame = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def _ttft(client: httpx.Client, url: str, model: str, messages: list, max_tokens: int) -> tuple[float, str, int]:
    """(seconds to the first content chunk, full reply, prompt tokens) of one streamed chat request."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, parts, prompt_tokens = None, [], 0
    with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", ()):
                # The role chunk comes first with empty content, before the engine has run.
                text = choice.get("delta", {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
    return (first or time.perf_counter()) - start, "".join(parts), prompt_tokens


def _conversation(client, url, model, part: dict, max_tokens: int) -> tuple[list[float], int]:
    messages, times, tokens = [], [], 0
    for turn, question in enumerate(_QUESTIONS):
        # The picture is in the first message; later turns resend it as part of the history.
        content = [part, {"type": "text", "text": question}] if turn == 0 else question
        messages.append({"role": "user", "content": content})
        seconds, reply, n = _ttft(client, url, model, messages, max_tokens)
        tokens = tokens or n
        times.append(seconds)
        messages.append({"role": "assistant", "content": reply})
    return times, tokens


def _start_server(model: str, prefix: bool, vision: bool, args):
    import uvicorn  # lazy: uvicorn only when used

    from mlxhost.server.app import build_app  # lazy: pulls in fastapi

    engine = EngineConfig(enable_prefix_cache=prefix, vision_cache_bytes=(512 << 20) if vision else 0,
                          prefill_step_size=args.prefill_step_size, max_num_seqs=4)
    app = build_app(ServerConfig(model=model, served_model_name="bench", engine=engine))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server exited during start-up")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}/v1/chat/completions"


def run_multimodal_bench(args) -> dict:
    model = args.model
    if model is None:
        model = str(build_vlm_folder(tempfile.mkdtemp(prefix="mlxhost-vlm-"), family=args.family))
    media = [("image", s) for s in args.resolutions] + [("video", n) for n in args.video_frames]
    rows = []
    for name in args.caches:
        prefix, vision = SETTINGS[name]
        server, thread, url = _start_server(model, prefix, vision, args)
        try:
            with httpx.Client(timeout=600) as client:
                # Warm-up, one conversation per media shape with a picture not used again: first-use
                # costs (MLX-CUDA compiles kernels per shape, the allocator grows) are not a cache's.
                for kind, size in media:
                    _conversation(client, url, "bench", _part(kind, size, -1, args), args.max_tokens)
                for kind, size in media:
                    for rep in range(args.repeats):
                        times, tokens = _conversation(client, url, "bench", _part(kind, size, rep, args),
                                                      args.max_tokens)
                        label = f"image {size}x{size}" if kind == "image" else f"video {size} frames"
                        rows.append({"media": label, "cache": name, "tokens": tokens, "times": times})
                        print(f"{label:>16}  {name:>6}  {tokens:>5} tok  turns (ms): "
                              + "  ".join(f"{t * 1000:.1f}" for t in times), flush=True)
        finally:
            server.should_exit = True
            thread.join(timeout=60)
    return {"model": model, "rows": _summarize(rows), "raw": rows}


def _part(kind: str, size: int, rep: int, args) -> dict:
    """A content part with a picture (or video) of its own: no two runs share one."""
    rng = np.random.default_rng([abs(hash(tuple(args.caches))) % 2**32, size, rep + 1, kind == "video"])
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_uri(rng, size)}}
    uri = _video_uri(rng, size, args.video_size, args.video_fps)
    return {"type": "video_url", "video_url": {"url": uri, "fps": args.video_fps, "max_frames": size}}


def _summarize(raw: list[dict]) -> list[dict]:
    """Median over repeats per (media, cache setting)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in raw:
        groups.setdefault((r["media"], r["cache"]), []).append(r)
    out = []
    for (label, cache), runs in groups.items():
        t = np.median(np.array([r["times"] for r in runs]), axis=0) * 1000
        out.append({"media": label, "cache": cache, "tokens": runs[0]["tokens"], "turn1_ms": t[0],
                    "turn2_ms": t[1], "turn3_ms": t[2], "speedup2": t[0] / t[1], "speedup3": t[0] / t[2]})
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="VLM folder (default: a tiny random Qwen2.5-VL fixture)")
    parser.add_argument("--family", default="qwen2_5_vl", help="fixture family when no --model is given")
    parser.add_argument("--resolutions", type=int_list, default=[224, 448, 768, 1024],
                        help="comma-separated square image sides in pixels, one conversation each")
    parser.add_argument("--video-frames", type=int_list, default=[4, 8, 16, 32],
                        help="comma-separated video lengths in frames (the request's max_frames), one conversation"
                             " each")
    parser.add_argument("--video-size", type=int, default=224, help="video frame side in pixels")
    parser.add_argument("--video-fps", type=float, default=2.0, help="frame rate of the videos and the requests' fps")
    parser.add_argument("--caches", type=lambda s: s.split(","), default=list(SETTINGS),
                        help="comma-separated settings among " + ", ".join(SETTINGS))
    parser.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="the server's --prefill-step-size (prompt tokens per step)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="conversations per media shape and cache setting (the median is shown)")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-multimodal-<time>.json)")


def run(args: argparse.Namespace) -> int:
    bad = [c for c in args.caches if c not in SETTINGS]
    if bad:
        raise SystemExit(f"unknown cache setting(s) {bad}; choose among {list(SETTINGS)}")
    result = run_multimodal_bench(args)
    print(format_table(result["rows"], _COLUMNS))
    path = write_json(args.output_json or default_json_path("multimodal"), result)
    print(f"wrote {path}")
    return 0
