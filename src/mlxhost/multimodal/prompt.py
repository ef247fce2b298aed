"""Chat messages with image and video parts -> prompt token ids and the engine's `MediaItem`s.

Runs on the HTTP side, in a worker thread (media fetching and pixel preprocessing block). It does
what the model's processor does to the text — each placeholder becomes one token per feature row,
Qwen3-VL videos get a "<t seconds>" marker per frame group — then tokenizes once, so the ids equal
mlx-vlm's. An image whose bytes were seen before is neither decoded nor preprocessed again: its
hash and grid are remembered by the bytes' digest, and the engine takes its features from the
vision cache (with no vision cache, every image carries its pixels).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlxhost.config import MediaConfig
from mlxhost.multimodal.fetch import read_media_bytes
from mlxhost.multimodal.hashing import image_hash, video_hash
from mlxhost.multimodal.media import MediaError, decode_image
from mlxhost.multimodal.media_item import MediaItem
from mlxhost.multimodal.video import check_sampling, decode_video

_VISION_START, _VISION_END = "<|vision_start|>", "<|vision_end|>"
_VIDEO_PAD = "<|video_pad|>"  # image markers come from the model (`image_marker`, `expand_image`)
_PLACEHOLDER = "\x00mlxhost-placeholder\x00"
# Media remembered by their encoded bytes; a few short tuples each, so thousands cost about a megabyte.
_MAX_KNOWN = 4096


class PromptError(ValueError):
    """The messages cannot become a prompt (the chat template refused them): a 400."""


@dataclass(frozen=True)
class MediaPart:
    """One image or video content part as the client sent it."""

    kind: str  # "image" | "video"
    url: str
    fps: float | None = None
    max_frames: int | None = None


@dataclass
class _Loaded:
    part: MediaPart
    content_hash: str
    grid_thw: tuple[int, int, int]
    pixel_values: Any
    timestamps: tuple[float, ...] = ()
    encoded: bytes | None = None
    sampling: tuple[float, int] | None = None  # videos: (fps, max_frames)


class MultimodalPromptBuilder:
    def __init__(self, model: Any, tokenizer: Any, config: MediaConfig, reuse_known: bool = True) -> None:
        self.model = model  # models.vlm.VisionLanguageModel: processor, family, token ids
        self.tokenizer = tokenizer
        self.config = config
        # Digest of the encoded bytes -> (content hash, grid) of images seen before; only useful with a
        # vision cache (`reuse_known`), else the engine would decode them again on its own thread.
        # Requests are built in parallel worker threads, so the memo has a lock.
        self.reuse_known = reuse_known
        self._known: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def build(self, messages: list[dict], parts: list[MediaPart], tools: list[dict] | None = None,
              **template_kwargs) -> tuple[list[int], tuple[MediaItem, ...]]:
        """`messages` already hold {"type": "image"} / {"type": "video"} parts where the media go,
        and `parts` lists the media in that order. `tools` and `template_kwargs` go to the chat template, as
        for a text-only prompt."""
        if len(parts) > self.config.max_media_per_request:
            raise MediaError(f"{len(parts)} images/videos in one request; this server takes at most "
                             f"{self.config.max_media_per_request}", "messages")
        loaded = [self._load(p) for p in parts]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False, **template_kwargs)
        except Exception as exc:  # a template may reject a role order, e.g. two system messages
            raise PromptError(f"the chat template rejected these messages: {exc}") from exc
        text = self._expand(text, loaded)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids, self._items(ids, loaded)

    # -- media -----------------------------------------------------------------------------------
    def _load(self, part: MediaPart) -> _Loaded:
        param = "image_url" if part.kind == "image" else "video_url"
        sampling = None
        if part.kind == "video" and not self.model.supports_video:
            raise MediaError("this model takes no video input", param)
        if part.kind == "video":  # limits checked before anything is downloaded
            sampling = check_sampling(self.config, part.fps, part.max_frames, param)
        media = read_media_bytes(part.url, self.config, param)
        if part.kind == "video":  # always preprocessed here: decoding one again would stall the engine
            video = decode_video(media.data, self.config, *sampling, param=param)
            pixels, grid = self._preprocess(self.model.preprocess_video, video.frames, param)
            return _Loaded(part, video_hash(video), grid, pixels, tuple(video.timestamps), sampling=sampling)
        # The same image bytes again (a client resending its conversation): no decoding, hashing or
        # pixel preprocessing; all of it was done, and checked, the first time. The engine takes the
        # features from its vision cache, or (evicted meanwhile) decodes `encoded` itself.
        key = hashlib.blake2b(media.data, digest_size=16).hexdigest()
        with self._lock:
            known = self._known.get(key) if self.reuse_known else None
            if known is not None:
                self._known.move_to_end(key)
        if known is not None:
            return _Loaded(part, known[0], known[1], None, encoded=media.data)
        image = decode_image(media.data, self.config, content_type=media.content_type)
        digest = image_hash(image)
        pixels, grid = self._preprocess(self.model.preprocess_image, image, param)
        with self._lock:
            self._known[key] = (digest, grid)
            if len(self._known) > _MAX_KNOWN:
                self._known.popitem(last=False)
        return _Loaded(part, digest, grid, pixels)

    @staticmethod
    def _preprocess(fn, media, param: str):
        try:
            return fn(media)
        except ValueError as exc:  # the processor's own limits: aspect ratio, tiny frames, mixed sizes
            raise MediaError(f"this model cannot take this media: {exc}", param) from exc

    # -- text ------------------------------------------------------------------------------------
    def _expand(self, text: str, loaded: list[_Loaded]) -> str:
        """Each placeholder of the rendered template -> one placeholder token per feature row."""
        merge = self.model.merge_size**2
        images = [m for m in loaded if m.part.kind == "image"]
        videos = [m for m in loaded if m.part.kind == "video"]
        marker = self.model.image_marker  # Qwen: <|image_pad|>; Gemma 3: <start_of_image>
        if text.count(marker) != len(images) or text.count(_VIDEO_PAD) != len(videos):
            raise MediaError(f"the chat template placed {text.count(marker)} images and "
                             f"{text.count(_VIDEO_PAD)} videos, the request has {len(images)} and "
                             f"{len(videos)}", "messages")
        # Split first: an image's expansion may hold the marker again (Gemma's starts with it).
        pieces = text.split(marker)
        text = pieces[0] + "".join(self.model.expand_image(math.prod(m.grid_thw) // merge) + rest
                                   for m, rest in zip(images, pieces[1:]))
        wrapped = _VISION_START + _VIDEO_PAD + _VISION_END
        for m in videos:
            t, h, w = m.grid_thw
            per_frame = h * w // merge
            if self.model.family == "qwen3_vl" and wrapped in text:
                groups = "".join(f"<{s:.1f} seconds>{_VISION_START}{_PLACEHOLDER * per_frame}{_VISION_END}"
                                 for s in _group_times(m.timestamps, t, m.part.fps))
                text = text.replace(wrapped, groups, 1)
            else:
                text = text.replace(_VIDEO_PAD, _PLACEHOLDER * (t * per_frame), 1)
        return text.replace(_PLACEHOLDER, _VIDEO_PAD)

    def _items(self, ids: list[int], loaded: list[_Loaded]) -> tuple[MediaItem, ...]:
        """Placeholder runs in the ids, handed to the media in order (a video may take several)."""
        runs = _runs(ids, {self.model.image_token_id, self.model.video_token_id})
        merge = self.model.merge_size**2
        items, r = [], 0
        for m in loaded:
            token = self.model.image_token_id if m.part.kind == "image" else self.model.video_token_id
            t, h, w = m.grid_thw
            need, spans = t * h * w // merge, []
            while need > 0 and r < len(runs):
                start, length, run_token = runs[r]
                if run_token != token or length > need:
                    break
                spans.append((start, length))
                need -= length
                r += 1
            if need:
                raise MediaError("the prompt's image/video placeholders do not line up with the media "
                                 "(a placeholder token typed in the text?)", "messages")
            items.append(MediaItem(m.content_hash, m.part.kind, tuple(spans), m.grid_thw, m.pixel_values,
                                   encoded=m.encoded, sampling=m.sampling))
        if r != len(runs):
            raise MediaError("the prompt contains image/video placeholder tokens without media", "messages")
        return tuple(items)


def _runs(ids: list[int], tokens: set[int]) -> list[tuple[int, int, int]]:
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] in tokens:
            j = i
            while j < n and ids[j] == ids[i]:
                j += 1
            runs.append((i, j - i, ids[i]))
            i = j
        else:
            i += 1
    return runs


def _group_times(timestamps: tuple[float, ...], grid_t: int, fps: float | None, temporal: int = 2) -> list[float]:
    """Seconds of each temporal patch group: the mean of its first and last frame (the reference
    Qwen3-VL processor's rule); the processor repeats the last frame to fill the final group."""
    times = list(timestamps) or [i / (fps or 2.0) for i in range(grid_t * temporal)]
    times += times[-1:] * (grid_t * temporal - len(times))
    return [(times[g * temporal] + times[g * temporal + temporal - 1]) / 2 for g in range(grid_t)]
