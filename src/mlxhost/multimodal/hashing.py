"""Content hashes of decoded media: keys of the vision-embedding cache and extra keys of prefix blocks.

Hashing decoded pixels, not the encoded bytes, makes one picture one key however it was sent (URL,
base64, file; PNG or a re-saved copy with other metadata) and after EXIF rotation. blake2b for the
same reasons as cache/hashing.py: in the stdlib, stable across installs, not collidable on purpose.
"""

from __future__ import annotations

import hashlib
import struct

from PIL import Image

from mlxhost.multimodal.video import VideoFrames

HASH_SIZE = 16
# Bump when the byte layout below changes (the digests may key persisted prefix blocks).
_IMAGE_TAG = b"mlxhost-image-v1"
_VIDEO_TAG = b"mlxhost-video-v1"
# Pixels hashed per slice, so a 50 MP image is never copied out whole (tobytes of all of it at once).
_SLICE_PIXELS = 1 << 22


def _image_digest(img: Image.Image) -> bytes:
    h = hashlib.blake2b(_IMAGE_TAG, digest_size=HASH_SIZE)
    width, height = img.size
    mode = img.mode.encode()
    h.update(struct.pack("<BII", len(mode), width, height) + mode)
    rows = max(1, _SLICE_PIXELS // max(1, width))
    if rows >= height:
        h.update(img.tobytes())
    else:
        for top in range(0, height, rows):
            h.update(img.crop((0, top, width, min(height, top + rows))).tobytes())
    return h.digest()


def image_hash(img: Image.Image) -> str:
    """Hex digest of mode, size and raw pixels."""
    return _image_digest(img).hex()


def video_hash(frames: VideoFrames) -> str:
    """Hex digest of the sampling parameters and, per frame, its timestamp and pixel digest."""
    h = hashlib.blake2b(_VIDEO_TAG, digest_size=HASH_SIZE)
    h.update(struct.pack("<ddI", frames.fps, frames.sample_fps, frames.max_frames))
    h.update(struct.pack("<I", len(frames.frames)))
    for img, t in zip(frames.frames, frames.timestamps, strict=True):
        h.update(struct.pack("<d", t) + _image_digest(img))
    return h.digest().hex()
