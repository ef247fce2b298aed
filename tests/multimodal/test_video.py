"""load_video: uniform sampling in time, frame caps, timestamps, refusals."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest

from mlxhost.config import MediaConfig
from mlxhost.multimodal.hashing import video_hash
from mlxhost.multimodal.media import MediaError, load_video
from tests.multimodal.conftest import png_bytes, sample_image

FPS, SECONDS, SIZE = 10, 3, 64


def make_mp4(seconds: int = SECONDS, size: int = SIZE, gop: int | None = None) -> bytes:
    """10 fps; frame i is a flat colour with red = 8 * i (mod 256), so a frame tells its index."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=FPS)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        for i in range(FPS * seconds):
            rgb = np.empty((size, size, 3), np.uint8)
            rgb[...] = (8 * i % 256, 255 - 8 * i % 256, 128)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_mp4()


def uri(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def frame_indices(video) -> list[int]:
    return [round(float(np.asarray(img)[..., 0].mean()) / 8) for img in video.frames]


def test_default_sampling_is_2_fps(mp4):
    video = load_video(uri(mp4), MediaConfig())
    assert video.fps == 2.0 and video.max_frames == 32 and video.sample_fps == pytest.approx(2.0)
    assert video.duration == pytest.approx(3.0)
    assert video.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert frame_indices(video) == [0, 5, 10, 15, 20, 25]
    assert all(img.mode == "RGB" and img.size == (SIZE, SIZE) for img in video.frames)


def test_max_frames_spreads_over_the_whole_video(mp4):
    video = load_video(uri(mp4), MediaConfig(), max_frames=4)
    assert len(video.frames) == 4 and video.sample_fps == pytest.approx(4 / 3)
    for k, t in enumerate(video.timestamps):  # targets 0, 0.75, 1.5, 2.25; frames are 0.1 s apart
        assert abs(t - 0.75 * k) <= 0.05 + 1e-9
    assert frame_indices(video) == [round(t * FPS) for t in video.timestamps]


def test_fps_above_the_video_rate_gives_each_frame_once(mp4):
    video = load_video(uri(mp4), MediaConfig(), fps=25, max_frames=64)
    assert frame_indices(video) == list(range(FPS * SECONDS))
    assert video.sample_fps == pytest.approx(FPS)


def test_one_frame(mp4):
    video = load_video(uri(mp4), MediaConfig(), fps=0.1)
    assert frame_indices(video) == [0] and video.timestamps == (0.0,)


@pytest.mark.parametrize("gop", [10, None])  # keyframe every second / only the first (seek lands behind)
def test_sparse_sampling_seeks_to_the_right_frames(gop):
    video = load_video(uri(make_mp4(seconds=12, size=32, gop=gop)), MediaConfig(), fps=0.25)
    assert video.timestamps == pytest.approx([0.0, 4.0, 8.0])
    assert frame_indices(video) == [0, 40 % 32, 80 % 32]


def test_frame_limits(mp4):
    config = MediaConfig()
    with pytest.raises(MediaError, match="too many frames requested: max_frames=200"):
        load_video("http://unreachable.invalid/v.mp4", config, max_frames=200)  # refused before fetching
    for bad in ({"fps": 0}, {"fps": -1.0}, {"fps": float("nan")}, {"max_frames": 0}):
        with pytest.raises(MediaError, match="must be a positive"):
            load_video(uri(mp4), config, **bad)
    with pytest.raises(MediaError, match="too many pixels: 64x64"):
        load_video(uri(mp4), MediaConfig(max_image_pixels=1000))


def test_video_hash_is_stable_and_covers_sampling(mp4, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4)
    config = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    a = load_video(uri(mp4), config)
    b = load_video(str(path), config)
    assert video_hash(a) == video_hash(b)
    assert len(video_hash(a)) == 32
    assert video_hash(load_video(str(path), config, max_frames=4)) != video_hash(a)
    assert video_hash(load_video(str(path), config, fps=1)) != video_hash(a)


def test_video_from_url(mp4, media_server, routes):
    routes["/clip.mp4"] = (200, {"Content-Type": "video/mp4"}, mp4)
    video = load_video(f"{media_server}/clip.mp4", MediaConfig(allow_private_media_urls=True))
    assert len(video.frames) == 6
    with pytest.raises(MediaError, match="private"):
        load_video(f"{media_server}/clip.mp4", MediaConfig())


def test_not_a_video(mp4):
    config = MediaConfig()
    for data in (b"\0\1\2 garbage" * 100, b"#EXTM3U\n#EXTINF:1,\nhttp://127.0.0.1:1/seg.ts\n#EXT-X-ENDLIST\n"):
        with pytest.raises(MediaError, match="not a video"):
            load_video(uri(data), config)
    with pytest.raises(MediaError, match="no video stream|not a video"):
        load_video(uri(png_bytes(sample_image()), "image/png"), config)
    with pytest.raises(MediaError):
        load_video(uri(mp4[: len(mp4) // 3]), config)  # truncated


def test_decoding_has_a_deadline(mp4):
    with pytest.raises(MediaError, match="decoding the video took"):
        load_video(uri(mp4), MediaConfig(video_decode_deadline_s=1e-9))
