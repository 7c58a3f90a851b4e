"""A video's frames decoded with PyAV (the ``video`` extra; its wheels carry FFmpeg): how many
a stream has, the frames of given numbers (decoded from the key frame before the first), and
the audio played between two times. Frames are numbered from 0 in presentation order: a
frame's number is its time since the stream's start times the frame rate."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from remote_loader.errors import ConfigError, DecodeError

_INHERITED: list[Any] = []
"""PyAV's frame converters a forked process found in place, kept and never used or freed."""


def _forget_inherited_converter() -> None:
    """In a forked child: PyAV (18.1.1 on) keeps one frame converter a thread, whose swscale
    context drives slice threads; the thread that forked keeps it in the child, where those
    threads do not exist, so its first frame converted there waits for them for ever (a
    DataLoader worker forked after the parent decoded a frame). The child makes its own; the
    inherited one is kept, not freed: freeing it would join the threads that are not there."""
    frame = sys.modules.get("av.video.frame")
    local = getattr(frame, "_thread_local", None)
    inherited = getattr(local, "reformatter", None)
    if inherited is not None:
        _INHERITED.append(inherited)
        with contextlib.suppress(AttributeError):
            delattr(local, "reformatter")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_converter)

EXTRA = "install the video extra (pip install '.[video]' in remote_loader's checkout: PyAV)"


class RangedFile(io.RawIOBase):
    """A file of ``size`` bytes read through ``fetch(start, end)`` in blocks of ``block``
    bytes as they are read, the last ``keep`` bytes of them kept: what a decoder opens to read only
    the parts of a long video it needs (its index, then the key frame before a clip and the
    clip). ``fetched`` counts the bytes fetched."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, block: int = 1 << 20,
                 keep: int = 8 << 20) -> None:
        super().__init__()
        self._fetch, self.size, self.block, self.keep = fetch, size, block, max(1, keep // block)
        self._position, self.fetched = 0, 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}
        if whence not in bases:
            raise ValueError(f"whence {whence} is not SEEK_SET, SEEK_CUR or SEEK_END")
        self._position = max(0, bases[whence] + offset)
        return self._position

    def readinto(self, out: Any) -> int:
        view = memoryview(out).cast("B")
        wanted, done = min(len(view), max(0, self.size - self._position)), 0
        while done < wanted:
            number = self._position // self.block
            data = self._block(number)
            inner = self._position - number * self.block
            take = min(wanted - done, len(data) - inner)
            if take <= 0:  # a block shorter than asked for: never a loop that waits for bytes that do not come
                raise OSError(f"bytes {number * self.block}-{number * self.block + self.block} of the file came"
                              f" {len(data)} bytes long")
            view[done : done + take] = data[inner : inner + take]
            done += take
            self._position += take
        return done

    def _block(self, number: int) -> bytes:
        if number in self._blocks:
            self._blocks.move_to_end(number)
            return self._blocks[number]
        start = number * self.block
        data = self._fetch(start, min(self.size, start + self.block))
        self.fetched += len(data)
        self._blocks[number] = data
        while len(self._blocks) > self.keep:
            self._blocks.popitem(last=False)
        return data


@contextlib.contextmanager
def decode_errors(what: str = "not a decodable video") -> Iterator[Any]:
    """PyAV, imported, for the block; what FFmpeg (or a malformed file) raises in it is a
    DecodeError saying ``what`` and why; a DecodeError raised in it passes as it is."""
    av = open_av()
    try:
        yield av
    except DecodeError:
        raise
    except (av.error.FFmpegError, ValueError, OSError, IndexError, RuntimeError) as exc:
        raise DecodeError(f"{what} ({type(exc).__name__}: {str(exc)[:120]})") from None


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


def audio_between(container: Any, start: float, stop: float, rate: int | None = None) -> np.ndarray | None:
    """The audio of the container's first audio stream played from ``start`` to before
    ``stop``, seconds from the start of its first video stream (the clip's frames are
    numbered from there; of the audio stream where there is no video), ``channels x
    samples`` float32 at the stream's own rate (or ``rate``); None where it has no audio
    stream. The decoder starts a quarter second early: an AAC decoder's first frame after a
    seek is not yet the sound."""
    if not container.streams.audio:
        return None
    av = open_av()
    stream = container.streams.audio[0]
    origin = _start_seconds(container.streams.video[0] if container.streams.video else stream)
    start, stop = origin + start, origin + stop  # from here on, the file's own time
    if start - _WARM_UP > _start_seconds(stream) and stream.time_base is not None:
        container.seek(int((start - _WARM_UP) / stream.time_base), stream=stream, backward=True, any_frame=False)
    resampler: Any = None
    parts: list[np.ndarray] = []
    clock: float | None = None  # the time of the next sample out of the resampler

    filled = 0  # samples from ``start`` handed out so far

    def take(out: Any) -> None:
        nonlocal clock, filled
        pcm = out.to_ndarray().astype(np.float32, copy=False)
        per_second, at = out.sample_rate, clock or 0.0
        first = max(0, int(np.ceil((start - at) * per_second - 1e-9)))
        last = min(pcm.shape[1], max(0, int(np.ceil((stop - at) * per_second - 1e-9))))
        if last > first:
            at_sample = round((at + first / per_second - start) * per_second)  # where it lies in the span
            if at_sample > filled:  # sound that starts late (or a gap in it): silence until it does
                parts.append(np.zeros((pcm.shape[0], at_sample - filled), np.float32))
                filled = at_sample
            parts.append(pcm[:, first:last])
            filled += last - first
        clock = at + pcm.shape[1] / per_second

    for frame in container.decode(stream):
        if resampler is None:
            resampler = av.AudioResampler(format="fltp", layout=frame.layout, rate=rate or frame.sample_rate)
        if clock is None:
            clock = float(frame.pts * frame.time_base) if frame.pts is not None else _start_seconds(stream)
        for out in resampler.resample(frame):
            take(out)
        if clock >= stop:
            break
    if resampler is not None and clock is not None and clock < stop:
        for out in resampler.resample(None):  # what the resampler still holds, at the stream's end
            take(out)
    return np.concatenate(parts, axis=1) if parts else np.zeros((stream.codec_context.channels or 1, 0), np.float32)


_WARM_UP = 0.25


def _start_seconds(stream: Any) -> float:
    """When ``stream`` starts, in the file's seconds."""
    if stream.start_time is None or stream.time_base is None:
        return 0.0
    return float(stream.start_time * stream.time_base)


def encode_frames(frames: np.ndarray, lossless: bool, fps: int = 25) -> bytes:
    """``frames`` (``T x H x W x 3`` uint8) as an H.264 video in an mp4: lossless (RGB at
    ``qp=0``, which decodes to exactly these frames) or at CRF 23 in 4:2:0 (about a tenth
    of their size or less; an odd side padded by repeating its last row or column).
    ValueError where the encoder refuses them."""
    av = open_av()
    count, height, width = frames.shape[:3]
    if not lossless and (height % 2 or width % 2):
        frames = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    out = io.BytesIO()
    try:
        with av.open(out, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264rgb" if lossless else "libx264", rate=fps)
            stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
            stream.pix_fmt = "rgb24" if lossless else "yuv420p"
            # no B-frames: each frame's time stamp is its number, in decoding order too
            stream.codec_context.options = {"qp": "0", "bf": "0"} if lossless else {"crf": "23", "bf": "0"}
            for pixels in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    except av.error.FFmpegError as exc:
        raise ValueError(f"H.264 refuses {width}x{height} frames ({type(exc).__name__}: {str(exc)[:100]})") from None
    return out.getvalue()


def decode_frames(data: bytes, count: int, height: int, width: int) -> np.ndarray:
    """The ``count`` frames of a video's bytes, ``T x H x W x 3`` uint8, each at least
    ``height x width`` (an H.264 frame may have a row or column more); ValueError where it
    holds frames of another size, or another number of them (checked from its header before
    a frame is decoded, then as they come)."""
    av = open_av()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("a video file without a video stream")
            stream = container.streams.video[0]
            if stream.codec_context is None:
                raise ValueError("a video stream no decoder reads")
            there = (int(stream.codec_context.height), int(stream.codec_context.width))
            if not (height <= there[0] <= height + 1 and width <= there[1] <= width + 1):
                raise ValueError(f"frames of {there[1]}x{there[0]} where {width}x{height} were stored")
            frames: list[np.ndarray] = []
            for frame in container.decode(stream):
                if len(frames) == count:
                    raise ValueError(f"more than the {count} frames stored")
                frames.append(frame.to_ndarray(format="rgb24"))
    except av.error.FFmpegError as exc:
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:100]}") from None
    if len(frames) != count:
        raise ValueError(f"{len(frames)} frames where {count} were stored")
    return np.stack(frames)
