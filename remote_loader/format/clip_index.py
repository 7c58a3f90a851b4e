"""The clips of a torchvision video dataset (``UCF101``, ``HMDB51``, ``Kinetics``: anything
built on ``torchvision.datasets.video_utils.VideoClips``), recorded with its videos so that
clip ``i`` is found again without the class: which video, and which of its frames.

A video's clips follow from its number of frames and frame rate and from the class's
``frames_per_clip``, ``step_between_clips`` and ``frame_rate``, as ``VideoClips`` computes
them: the video's frames resampled to ``frame_rate`` (every ``fps / frame_rate``-th frame),
then windows of ``frames_per_clip`` of them, ``step`` apart, the last ones dropped where they
do not fill a window. Frames are numbered from 0 in presentation order.

Pure: no I/O.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remote_loader.errors import FormatError

LAYOUTS = ("THWC", "TCHW")
MAX_FRAMES = 100_000_000
"""The most frames a video of a clip index may have (a month at 30 a second): a larger
count is a damaged record, whose clips would not fit in memory."""
MAX_RATE = 100_000.0


def _rate(value: object) -> bool:
    """Whether ``value`` is a frame rate: a finite number of frames a second, above 0."""
    return (not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
            and 0 < value <= MAX_RATE)


@dataclass(frozen=True)
class ClipIndex:
    """Every clip of every video: video ``v`` has ``video_frames[v]`` frames at
    ``video_fps[v]`` a second (None where its file had no video stream)."""

    frames_per_clip: int
    step: int
    frame_rate: float | None
    output_format: str
    video_frames: tuple[int, ...]
    video_fps: tuple[float | None, ...]
    _ends: list[int] = field(init=False, repr=False, compare=False)  # clips up to each video's last, cumulated

    def __post_init__(self) -> None:
        counts = [self._count(v) for v in range(len(self.video_frames))]
        object.__setattr__(self, "_ends", np.cumsum(counts, dtype=np.int64).tolist())

    def _rates(self, video: int) -> tuple[int, float, float]:
        """Video ``video``'s frames, its rate, and the rate its clips are counted at."""
        frames, fps = self.video_frames[video], self.video_fps[video] or 1.0
        return frames, fps, self.frame_rate if self.frame_rate is not None else fps

    def _count(self, video: int) -> int:
        """How many clips video ``video`` has (``len(clips_of(video))``, counted, not made)."""
        frames, fps, rate = self._rates(video)
        ratio = fps / rate
        kept = -(-frames // int(ratio)) if float(ratio).is_integer() else int(math.floor(frames * rate / fps))
        return (kept - self.frames_per_clip) // self.step + 1 if kept >= self.frames_per_clip else 0

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def clips_of(self, video: int) -> np.ndarray:
        """The frame numbers of each clip of ``video``: ``clips x frames_per_clip``, int64."""
        frames, fps, rate = self._rates(video)
        numbers = np.arange(frames, dtype=np.int64)
        ratio = fps / rate
        if float(ratio).is_integer():
            numbers = numbers[:: int(ratio)]
        else:
            total = int(math.floor(frames * rate / fps))
            numbers = numbers[np.floor(np.arange(total, dtype=np.float32) * np.float32(ratio)).astype(np.int64)]
        count = (len(numbers) - self.frames_per_clip) // self.step + 1 if len(numbers) >= self.frames_per_clip else 0
        starts = np.arange(count, dtype=np.int64)[:, None] * self.step
        return numbers[starts + np.arange(self.frames_per_clip, dtype=np.int64)[None, :]]

    def locate(self, i: int) -> tuple[int, int]:
        """Clip ``i`` as ``(video, clip of that video)``."""
        ends = self._ends
        if not 0 <= i < len(self):
            raise IndexError(f"clip {i} out of range for {len(self)} clips")
        video = bisect.bisect_right(ends, i)
        return video, i - (ends[video - 1] if video else 0)

    def as_params(self) -> dict[str, Any]:
        """What a manifest records (lists and scalars, as msgpack gives them back)."""
        return {"frames_per_clip": self.frames_per_clip, "step": self.step, "frame_rate": self.frame_rate,
                "output_format": self.output_format, "video_frames": list(self.video_frames),
                "video_fps": list(self.video_fps)}

    @classmethod
    def of_params(cls, raw: Any, name: str) -> ClipIndex:
        """The index a manifest recorded; FormatError naming the field where it is not one."""

        def bad(what: str, value: Any) -> FormatError:
            return FormatError(f"{name}: the clip index's {what} is not valid: {str(value)[:80]!r}", name=name)

        if not isinstance(raw, dict):
            raise bad("record", raw)
        for number in ("frames_per_clip", "step"):
            if type(raw.get(number)) is not int or raw[number] < 1:
                raise bad(number, raw.get(number))
        rate = raw.get("frame_rate")
        if rate is not None and not _rate(rate):
            raise bad("frame_rate", rate)
        if raw.get("output_format") not in LAYOUTS:
            raise bad("output_format", raw.get("output_format"))
        frames, fps = raw.get("video_frames"), raw.get("video_fps")
        if not isinstance(frames, list) or any(type(n) is not int or not 0 <= n <= MAX_FRAMES for n in frames):
            raise bad("video_frames", frames)
        if not isinstance(fps, list) or len(fps) != len(frames) or any(f is not None and not _rate(f) for f in fps):
            raise bad("video_fps", fps)
        return cls(raw["frames_per_clip"], raw["step"], None if rate is None else float(rate), raw["output_format"],
                   tuple(frames), tuple(None if f is None else float(f) for f in fps))
