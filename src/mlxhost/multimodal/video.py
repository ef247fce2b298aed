"""Videos for content parts: frames sampled uniformly in time with PyAV, as RGB PIL images.

Sampling: one frame every `interval` seconds from the first frame, where
    interval = max(1 / fps, 1 / video's own frame rate, duration / max_frames)
so a short clip is sampled at `fps`, a clip slower than `fps` gives each frame once, and a long clip
is spread over its whole length in `max_frames` frames instead of being cut after max_frames / fps
seconds. Each target time takes the decoded frame nearest to it; the timestamps returned are the
frames' own (seconds from the first frame), for models that put them in the prompt.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass

from PIL import Image

from mlxhost.config import MediaConfig
from mlxhost.multimodal.fetch import MediaError, read_media_bytes

# Demuxers ffmpeg may pick while probing client bytes. Without this list it would also try playlist
# and concat formats (hls, concat), which open further URLs or files on their own.
VIDEO_DEMUXERS = "mov,matroska,avi,mpegts,ogg"
# Decoding in order is cheaper than a seek (which restarts at a keyframe) only for short gaps.
_SEEK_GAP_S = 2.0


@dataclass(frozen=True)
class VideoFrames:
    frames: tuple[Image.Image, ...]  # RGB
    timestamps: tuple[float, ...]  # seconds since the first frame, one per frame
    fps: float  # requested sampling rate
    max_frames: int  # requested frame cap
    sample_fps: float  # rate actually used (lower when max_frames or the video's own rate limited it)
    duration: float | None  # seconds, None when the container does not say


def load_video(source: str, config: MediaConfig, fps: float | None = None, max_frames: int | None = None,
               *, param: str | None = "video_url") -> VideoFrames:
    """An http(s) URL, data:video/...;base64 URI, file:// URL or local path -> sampled RGB frames."""
    fps, max_frames = check_sampling(config, fps, max_frames, param)
    media = read_media_bytes(source, config, param)
    return decode_video(media.data, config, fps, max_frames, param=param)


def check_sampling(config: MediaConfig, fps: float | None, max_frames: int | None,
                   param: str | None = "video_url") -> tuple[float, int]:
    """Defaults filled in and limits enforced, before anything is downloaded."""
    fps = config.video_fps if fps is None else fps
    max_frames = config.video_max_frames if max_frames is None else max_frames
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise MediaError(f"video fps must be a positive number, got {fps!r}", param)
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise MediaError(f"video max_frames must be a positive integer, got {max_frames!r}", param)
    if max_frames > config.video_max_frames_cap:
        raise MediaError(f"too many frames requested: max_frames={max_frames}, "
                         f"this server allows at most {config.video_max_frames_cap}", param)
    return float(fps), max_frames


def decode_video(data: bytes, config: MediaConfig, fps: float, max_frames: int, *,
                 param: str | None = "video_url") -> VideoFrames:
    # PyAV comes with the `vision` extra: only vision-language models take videos.
    import av
    from av.error import FFmpegError

    try:
        container = av.open(io.BytesIO(data), mode="r", options={"format_whitelist": VIDEO_DEMUXERS})
    except FFmpegError as exc:
        raise MediaError(f"media is not a video in a supported container (mp4/mov, mkv/webm, avi, "
                         f"mpeg-ts, ogg): {exc}", param) from None
    with container:
        if not container.streams.video:
            raise MediaError("media has no video stream", param)
        stream = container.streams.video[0]
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, config, param)
        duration = _duration(stream, container)
        rate = float(stream.average_rate) if stream.average_rate else 0.0
        interval = max(1.0 / fps, 1.0 / rate if rate > 0 else 0.0, (duration or 0.0) / max_frames)
        n = max_frames if duration is None else max(1, min(max_frames, math.ceil(duration / interval - 1e-9)))
        targets = [i * interval for i in range(n)]
        stream.thread_type = "AUTO"
        try:
            picked = _pick_frames(container, stream, targets, rate, config, param)
        except FFmpegError as exc:
            raise MediaError(f"cannot decode video: {exc}", param) from None
    if not picked:
        raise MediaError("video has no decodable frames", param)
    return VideoFrames(
        frames=tuple(img for img, _ in picked),
        timestamps=tuple(t for _, t in picked),
        fps=fps, max_frames=max_frames, sample_fps=1.0 / interval, duration=duration)


def _pick_frames(container, stream, targets: list[float], rate: float, config: MediaConfig,
                 param: str | None) -> list[tuple[Image.Image, float]]:
    """Nearest decoded frame to each target time, in one forward pass that skips long gaps by seeking
    and stops once the last target is served."""
    from av.error import FFmpegError  # optional: the vision extra

    picked: list[tuple[Image.Image, float]] = []
    last_t: float | None = None  # time of the last picked frame, so one frame is never taken twice

    def take(frame, t: float) -> None:
        nonlocal last_t
        if last_t is not None and t <= last_t:
            return
        _check_frame_size(frame.width, frame.height, config, param)
        picked.append((frame.to_image(), t))  # to_image converts to RGB24
        last_t = t

    frames = container.decode(stream)
    k, index, prev, t0, seeked_for, seekable = 0, 0, None, None, -1, True
    seek_from: float | None = None  # where the last seek left from, to notice one that went backward
    deadline = time.monotonic() + config.video_decode_deadline_s
    while k < len(targets):
        frame = next(frames, None)
        if frame is None:
            break
        if time.monotonic() > deadline:
            raise MediaError(f"decoding the video took over {config.video_decode_deadline_s:g} s", param)
        if frame.time is not None:
            raw_t = frame.time
        else:  # no timestamps in the stream: count frames at the declared rate
            raw_t = index / rate if rate > 0 else float(index)
        index += 1
        t0 = raw_t if t0 is None else t0
        t = raw_t - t0
        if seek_from is not None:
            # A seek that landed at or behind where it left (sparse keyframes) would decode the same
            # frames again for every later target, quadratic in the video's length: stop seeking.
            seekable, seek_from = t > seek_from, None
        while k < len(targets) and t >= targets[k]:
            if prev is not None and targets[k] - prev[1] < t - targets[k]:
                take(*prev)
            else:
                take(frame, t)
            k += 1
        prev = (frame, t)
        # Far from the next target: jump to the keyframe before it instead of decoding every frame
        # in between. Once per target, so a seek landing behind us cannot loop.
        if (seekable and k < len(targets) and k != seeked_for and frame.time is not None
                and targets[k] - t > _SEEK_GAP_S):
            seeked_for, seek_from = k, t
            try:
                container.seek(int((targets[k] + t0) / stream.time_base), stream=stream, backward=True)
            except FFmpegError:
                continue  # not seekable: keep decoding in order
            frames, prev = container.decode(stream), None
    if prev is not None and k < len(targets):  # the stream ended first: its last frame is the nearest
        take(*prev)
    return picked


def _check_frame_size(width: int, height: int, config: MediaConfig, param: str | None) -> None:
    if width * height > config.max_image_pixels:
        raise MediaError(f"video frames have too many pixels: {width}x{height} = {width * height}, "
                         f"the limit is {config.max_image_pixels}", param)


def _duration(stream, container) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        import av  # optional: the vision extra

        return container.duration / av.time_base
    if stream.frames and stream.average_rate:
        return stream.frames / float(stream.average_rate)
    return None
