"""One image or video inside a prompt, as the engine gets it: plain data, made by prompt.py, read by the
engine's multimodal prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MediaItem:
    """One image or video inside a prompt: where its placeholder tokens sit and what encodes it.

    `spans` are (first position, number of tokens) of its placeholder runs in the prompt, in order (a
    Qwen3-VL video has one run per frame group, timestamps between them). The vision features fill
    those positions row by row. `pixel_values` is None when the HTTP side knew the image already (a
    repeated image): the engine then takes the features from its vision cache, or decodes `encoded`
    and runs the processor if the cache dropped them meanwhile."""

    content_hash: str
    kind: str  # "image" | "video"
    spans: tuple[tuple[int, int], ...]
    grid_thw: tuple[int, int, int]
    pixel_values: Any = None  # numpy array from the model's processor
    image: Any = None  # the decoded picture (PIL), when the HTTP side decoded it
    encoded: bytes | None = None  # the bytes as sent, when it did not
    sampling: tuple[float, int] | None = None  # videos: (fps, max_frames) the frames were taken with

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.spans)
