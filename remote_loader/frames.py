"""A video's frames decoded with PyAV (the ``video`` extra; its wheels carry FFmpeg): how many
a stream has, the frames of given numbers (decoded from the key frame before the first), and
the audio played between two times. Frames are numbered from 0 in presentation order: a
frame's number is its time since the stream's start times the frame rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from remote_loader.errors import ConfigError

EXTRA = "install the video extra (pip install '.[video]' in remote_loader's checkout: PyAV)"


def open_av() -> Any:
    """PyAV, imported; ConfigError naming the extra where it is not installed."""
    try:
        import av
    except ImportError:
        raise ConfigError(f"decoding video needs PyAV: {EXTRA}") from None
    return av


def frame_count(container: Any, stream: Any, rate: float) -> int:
    """Frames of the stream: as its header says, else from its duration and rate (0 where
    neither is known: the clip then starts at the first frame)."""
    if stream.frames:
        return int(stream.frames)
    if stream.duration is not None and stream.time_base is not None and rate:
        return int(float(stream.duration * stream.time_base) * rate)
    if container.duration is not None and rate:
        return int(container.duration / 1_000_000 * rate)
    return 0


def frames_at(container: Any, stream: Any, rate: float, wanted: list[int],
               keep: Callable[[np.ndarray], Any] = lambda pixels: pixels) -> list[Any]:
    """What ``keep`` makes of the frames of numbers ``wanted`` (increasing), decoded from the
    key frame before the first: a frame's number is its time times the rate, counted from the
    stream's start."""
    base = stream.start_time or 0
    if wanted[0] > 0 and rate and stream.time_base is not None:
        container.seek(base + int(wanted[0] / rate / stream.time_base), stream=stream, backward=True, any_frame=False)
    got: list[Any] = []
    number = -1
    for frame in container.decode(stream):
        if frame.pts is not None and rate and stream.time_base is not None:
            number = round(float((frame.pts - base) * stream.time_base) * rate)
        else:  # no time stamps: count frames from where decoding began
            number += 1
        if len(got) < len(wanted) and number >= wanted[len(got)]:
            kept = keep(frame.to_ndarray(format="rgb24"))
            while len(got) < len(wanted) and number >= wanted[len(got)]:  # a frame missing: the next in its place
                got.append(kept)
        if len(got) == len(wanted):
            break
    return got


def audio_between(container: Any, start: float, stop: float) -> np.ndarray | None:
    """The audio of the container's first audio stream played from ``start`` to before
    ``stop`` (seconds from the stream's start), ``channels x samples`` float32 at the
    stream's own rate; None where it has no audio stream."""
    if not container.streams.audio:
        return None
    av = open_av()
    stream = container.streams.audio[0]
    base = float((stream.start_time or 0) * stream.time_base) if stream.time_base is not None else 0.0
    if start > 0 and stream.time_base is not None:
        container.seek(int((base + start) / stream.time_base), stream=stream, backward=True, any_frame=False)
    resampler: Any = None
    parts: list[np.ndarray] = []
    for frame in container.decode(stream):
        if resampler is None:
            resampler = av.AudioResampler(format="fltp", layout=frame.layout, rate=frame.sample_rate)
        at = float(frame.pts * frame.time_base) - base if frame.pts is not None else None
        for out in resampler.resample(frame):
            pcm = out.to_ndarray().astype(np.float32, copy=False)
            rate = out.sample_rate
            first = 0 if at is None else max(0, int(np.ceil((start - at) * rate - 1e-9)))
            last = pcm.shape[1] if at is None else min(pcm.shape[1], max(0, int(np.ceil((stop - at) * rate - 1e-9))))
            if last > first:
                parts.append(pcm[:, first:last])
            if at is not None:
                at += pcm.shape[1] / rate
        if at is not None and at >= stop:
            break
    channels = stream.codec_context.channels or 1
    return np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), dtype=np.float32)
