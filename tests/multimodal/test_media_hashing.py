"""image_hash / video_hash: pixels and mode decide, not encoding; sliced hashing equals whole."""

from __future__ import annotations

import numpy as np
from PIL import Image

from mlxhost.multimodal import hashing
from mlxhost.multimodal.hashing import image_hash, video_hash
from mlxhost.multimodal.video import VideoFrames
from tests.multimodal.conftest import sample_image


def test_image_hash_depends_on_pixels_mode_and_size():
    img = sample_image()
    assert image_hash(img) == image_hash(img.copy())
    assert len(image_hash(img)) == 32 and int(image_hash(img), 16) >= 0
    arr = np.asarray(img).copy()
    arr[5, 7, 1] ^= 1
    assert image_hash(Image.fromarray(arr)) != image_hash(img)
    assert image_hash(img.convert("L")) != image_hash(img)
    # Same bytes, other shape: the size header keeps them apart.
    flat = np.asarray(img).reshape(16, 96, 3)
    assert image_hash(Image.fromarray(flat)) != image_hash(img)


def test_sliced_hash_equals_whole(monkeypatch):
    img = sample_image(64, 50)
    whole = image_hash(img)
    monkeypatch.setattr(hashing, "_SLICE_PIXELS", 64 * 7)  # 7 rows per slice, last one shorter
    assert image_hash(img) == whole


def test_video_hash():
    frames = (sample_image(), sample_image().rotate(180))
    video = VideoFrames(frames=frames, timestamps=(0.0, 0.5), fps=2.0, max_frames=32, sample_fps=2.0, duration=1.0)
    same = VideoFrames(frames=tuple(f.copy() for f in frames), timestamps=(0.0, 0.5), fps=2.0, max_frames=32,
                       sample_fps=2.0, duration=1.0)
    assert video_hash(video) == video_hash(same)
    variants = [
        VideoFrames(frames=frames[::-1], timestamps=(0.0, 0.5), fps=2.0, max_frames=32, sample_fps=2.0,
                    duration=1.0),
        VideoFrames(frames=frames, timestamps=(0.0, 0.6), fps=2.0, max_frames=32, sample_fps=2.0, duration=1.0),
        VideoFrames(frames=frames, timestamps=(0.0, 0.5), fps=2.0, max_frames=8, sample_fps=2.0, duration=1.0),
        VideoFrames(frames=frames[:1], timestamps=(0.0,), fps=2.0, max_frames=32, sample_fps=2.0, duration=1.0),
    ]
    assert len({video_hash(v) for v in variants} | {video_hash(video)}) == 5
    # A one-frame video is not the same key as the image itself.
    assert video_hash(variants[3]) != image_hash(frames[0])
