"""Images for OpenAI content parts: fetched (fetch.py), checked, decoded and normalized.

The returned image is what both the content hash and the model's processor see: EXIF orientation
applied and RGB mode, so one picture gives one hash whether it came as a URL, base64 or a file, and
whether its rotation was in the pixels or in an EXIF tag.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mlxhost.config import MediaConfig
from mlxhost.multimodal.fetch import MediaError, read_media_bytes
from mlxhost.multimodal.video import VideoFrames, load_video

__all__ = ["MediaConfig", "MediaError", "VideoFrames", "decode_image", "load_image", "load_video", "to_rgb"]

# Formats Pillow may try. An allow-list, not every plugin: EPS would run Ghostscript on client bytes,
# and exotic decoders (FITS, SPIDER, ...) are attack surface no chat client needs. JPEG covers MPO
# (multi-picture phone photos); AVIF only where this Pillow has it (Pillow raises on unknown names).
Image.init()
IMAGE_FORMATS = tuple(f for f in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "AVIF") if f in Image.OPEN)

_EXIF_ORIENTATION = 0x0112
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_WHITE = (255, 255, 255, 255)


def load_image(source: str, config: MediaConfig, *, param: str | None = "image_url") -> Image.Image:
    """An http(s) URL, data:image/...;base64 URI, file:// URL or local path -> a decoded RGB image."""
    media = read_media_bytes(source, config, param)
    return decode_image(media.data, config, param=param, content_type=media.content_type)


def decode_image(data: bytes, config: MediaConfig, *, param: str | None = "image_url",
                 content_type: str | None = None) -> Image.Image:
    """Encoded bytes -> RGB image with EXIF orientation applied; pixel count checked before decoding."""
    what = f" (content-type {content_type})" if content_type else ""
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image has too many pixels: {exc}", param) from None
    except UnidentifiedImageError:
        raise MediaError(f"media is not an image in a supported format{what} "
                         f"(supported: {', '.join(IMAGE_FORMATS)})", param) from None
    except Exception as exc:  # Pillow's parsers raise many types on hostile input; none is a server bug
        raise MediaError(f"cannot decode image{what}: {exc}", param) from None
    width, height = img.size
    if width * height > config.max_image_pixels:
        raise MediaError(f"image has too many pixels: {width}x{height} = {width * height}, "
                         f"the limit is {config.max_image_pixels}", param)
    if width == 0 or height == 0:
        raise MediaError(f"image is empty ({width}x{height})", param)
    try:
        img.load()
        if img.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            img = ImageOps.exif_transpose(img)
        return to_rgb(img)
    except Exception as exc:  # truncated or corrupt data shows up only while decoding
        raise MediaError(f"cannot decode image{what}: {exc}", param) from None


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with transparency composited on white.

    White, not black: it is what Hugging Face image processors' `convert_rgb` does, so the pixels match
    the reference pipeline, and it is how a transparent logo or screenshot looks on a page.
    """
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I"):
        # 16-bit grayscale (PNG, TIFF): Pillow's convert clips everything above 255 to white; scale instead.
        arr = np.clip(np.asarray(img), 0, 65535).astype(np.uint16)
        return Image.fromarray((arr >> 8).astype(np.uint8)).convert("RGB")
    return img.convert("RGB")
