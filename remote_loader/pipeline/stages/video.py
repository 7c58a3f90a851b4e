"""``VideoClip``: a clip decoded from a video member (mp4, mov, mkv, webm, avi) in the
workers, with PyAV (the ``video`` extra; its wheels carry FFmpeg).

Which frames: ``frames`` of them, ``step`` apart, starting at a frame drawn from (seed,
epoch, the sample's key), so a sample's clip is the same whatever the workers, ranks or
resume, and another in the next epoch. The decoder seeks to the key frame before the clip
and decodes from there, not the whole video. A video shorter than the clip repeats its last
frame. ``crop`` (a ``RandomResizedCrop``) cuts one box out of every frame of the clip and
resizes it, drawn as for an image (after the start frame), flip included.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.nn import functional

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format.video import VIDEO_EXTENSIONS
from remote_loader.frames import audio_between, decode_errors, frame_count, frames_at
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.prepared import EncodedClip

VIDEO_FIELDS = VIDEO_EXTENSIONS
LAYOUTS = ("TCHW", "THWC")
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _whole(value: object) -> int | None:
    """``value`` as an int where it is one (numpy's integers too), else None (a bool, a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


class VideoClip:
    """A clip of ``frames`` frames, ``step`` apart, of each video field: a uint8 tensor
    (float32, normalised, where ``crop`` has ``mean`` and ``std``), ``T x C x H x W``
    (``layout="TCHW"``, as torchvision's ``tv_tensors.Video``) or ``T x H x W x C``
    (``"THWC"``, as torchvision's video datasets hand clips over).

    Args:
        frames: Frames in a clip.
        step: Frames of the video from one of the clip's frames to the next (1: consecutive).
        crop: A ``RandomResizedCrop`` applied to the whole clip (one box, one flip); None keeps
            the frames whole.
        layout: ``"TCHW"`` or ``"THWC"``.
        device: ``"cuda"`` (``"cuda:N"``) decodes the clips with DALI in the training
            process (NVDEC), in whole batches: each worker only draws its clips' frames, box
            and flip, the same as on the CPU (``batched`` gathers them, ``loader()`` hands
            out batches decoded on the device); needs ``crop`` and the ``gpu`` extra.
            ``"cpu"`` runs the same on DALI's CPU operators (VP8, VP9 and MJPEG only). None
            (the default): PyAV in the workers.
        audio: A sample rate: the sound played through the clip (from its first frame to
            the end of its last) comes too, as a field of its own named as the video's with
            ``audio`` for its extension (``mp4`` -> ``audio``, ``0.mp4`` -> ``0.audio``):
            float32 ``1 x n``, mono at that rate, ``n`` samples for the clip's duration
            (silence where the video has no sound or it ends first). None: no sound.
    """

    seeded = True

    def __init__(self, frames: int = 16, step: int = 1, crop: RandomResizedCrop | None = None,
                 layout: str = "TCHW", audio: int | None = None, device: str | None = None) -> None:
        for name, value in (("frames", frames), ("step", step)):
            if _whole(value) is None or value < 1:
                raise ConfigError(f"VideoClip's {name} must be a positive integer, got {value!r}")
        frames, step = int(frames), int(step)
        if crop is not None and not isinstance(crop, RandomResizedCrop):
            raise ConfigError(f"VideoClip's crop must be a RandomResizedCrop or None, got {type(crop).__name__}")
        if layout not in LAYOUTS:
            raise ConfigError(f"VideoClip's layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if audio is not None and (_whole(audio) is None or not 1000 <= audio <= 384_000):
            raise ConfigError(f"VideoClip's audio must be a sample rate from 1000 to 384000 a second, or None, got"
                              f" {audio!r}")
        audio = None if audio is None else int(audio)
        if device is not None and (not isinstance(device, str) or not DEVICE.match(device)):
            raise ConfigError(f"VideoClip's device must be 'cuda', 'cuda:N', 'cpu' or None, got {device!r}")
        if device is not None and crop is None:
            raise ConfigError("VideoClip(device=...) needs a crop (a RandomResizedCrop): a batch decoded on a device is"
                              " one tensor of clips of one size")
        self.frames, self.step, self.crop, self.layout, self.audio = frames, step, crop, layout, audio
        self.device = device

    def __repr__(self) -> str:
        return (f"VideoClip(frames={self.frames}, step={self.step}, crop={self.crop!r}, layout={self.layout!r},"
                f" audio={self.audio!r}, device={self.device!r})")

    def fields(self, field: str, data: Any, rng: np.random.Generator, key: str = "",
               shard: str = "") -> dict[str, Any]:
        """What one video field becomes: its clip, under its name (with ``device``, the clip
        drawn for the training process to decode: an ``EncodedClip``), and with ``audio``
        the clip's sound under the name with ``audio`` for its extension; DecodeError where
        the bytes do not decode."""
        data = bytes(data)
        out: dict[str, Any] = {}
        if self.device is not None:
            out[field], seconds = self._encoded(data, rng, key, shard)
        else:
            frames, seconds = self._decode(data, rng)
            out[field] = self._clip(frames)
        if self.audio is not None:
            out[_sound_field(field)] = self._sound(data, *seconds)
        return out

    def added(self, names: frozenset[str]) -> frozenset[str]:
        """The fields ``fields`` adds to samples whose fields are ``names``: each video field's sound."""
        if self.audio is None:
            return frozenset()
        return frozenset(_sound_field(name) for name in names if name.rsplit(".", 1)[-1] in VIDEO_FIELDS)

    def __call__(self, field: str, data: Any, rng: np.random.Generator) -> torch.Tensor:
        """The clip of one video field's bytes; DecodeError where they do not decode."""
        return self._clip(self._decode(bytes(data), rng)[0])

    def _clip(self, frames: list[torch.Tensor]) -> torch.Tensor:
        clip = torch.stack(frames)  # T x C x H x W
        if self.crop is not None and self.crop.mean is not None and self.crop.std is not None:
            mean = torch.tensor(self.crop.mean).view(1, 3, 1, 1) * 255  # normalised floats, as an image's crop
            std = torch.tensor(self.crop.std).view(1, 3, 1, 1) * 255
            clip = (clip - mean) / std
        elif self.crop is not None:
            clip = clip.round_().clamp_(0, 255).to(torch.uint8)
        return clip.permute(0, 2, 3, 1).contiguous() if self.layout == "THWC" else clip

    def decode(self, data: bytes, rng: np.random.Generator) -> list[torch.Tensor]:
        """The clip's frames, ``C x H x W`` each (uint8; float crops resized where ``crop`` is
        given: each frame cropped as it is decoded, so a clip holds at most one frame whole),
        from a start drawn with ``rng``, then the crop's box and flip."""
        return self._decode(data, rng)[0]

    def _sound(self, data: bytes, start: float, stop: float) -> torch.Tensor:
        """The sound from ``start`` to ``stop`` seconds, mono at ``audio`` samples a second,
        exactly as many samples as that span holds (silence where there is none)."""
        assert self.audio is not None
        count = max(0, round((stop - start) * self.audio))
        with decode_errors("sound that does not decode") as av, av.open(io.BytesIO(data), mode="r") as container:
            sound = audio_between(container, start, stop, rate=self.audio)
        out = torch.zeros((1, count), dtype=torch.float32)
        if sound is not None:  # mono: the channels' mean (a downmix that keeps a sound's level)
            taken = min(count, sound.shape[1])
            out[:, :taken] = torch.from_numpy(sound[:, :taken].mean(axis=0, keepdims=True))
        return out

    def _decode(self, data: bytes, rng: np.random.Generator) -> tuple[list[torch.Tensor], tuple[float, float]]:
        """The clip's frames (``decode``), and the times its first frame starts and its last ends."""
        with decode_errors() as av, av.open(io.BytesIO(data), mode="r") as container:
            stream, width, height, rate, start, wanted, _ = self._draw(container, rng)
            span = wanted[-1] - wanted[0] + 1
            keep = self._keeper(width, height, rng)
            got = frames_at(container, stream, rate, wanted, keep)
            if not got and start:  # a header that claims more frames than there are: the clip from the start
                container.seek(stream.start_time or 0, stream=stream, backward=True, any_frame=False)
                start = 0
                got = frames_at(container, stream, rate, [k * self.step for k in range(self.frames)], keep)
        if not got:
            raise DecodeError("a video without a frame that decodes")
        seconds = (start / rate, (start + span) / rate) if rate else (0.0, 0.0)
        return got + [got[-1]] * (self.frames - len(got)), seconds  # a video shorter than the clip: its last again

    def _draw(self, container: Any, rng: np.random.Generator) -> tuple[Any, int, int, float, int, list[int], int]:
        """The video stream, its frames' width and height, its rate, the clip's first frame
        and frame numbers, drawn with ``rng``, and the video's frames as its header counts
        them (from the header: nothing decoded)."""
        if not container.streams.video:
            raise DecodeError("a video file without a video stream")
        stream = container.streams.video[0]
        if stream.codec_context is None:
            raise DecodeError("a video stream no decoder reads")
        stream.codec_context.thread_count = 1  # a worker's core: the DataLoader's workers fill the rest
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        bound = Image.MAX_IMAGE_PIXELS
        if bound is not None and width * height > bound:
            raise DecodeError(f"frames of {width}x{height} pixels, more than Pillow's bound of {bound}"
                              " an image (PIL.Image.MAX_IMAGE_PIXELS)")
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        count = frame_count(container, stream, rate)
        span = (self.frames - 1) * self.step + 1
        start = int(rng.integers(0, count - span + 1)) if count >= span else 0
        return stream, width, height, rate, start, [start + k * self.step for k in range(self.frames)], count

    def _encoded(self, data: bytes, rng: np.random.Generator, key: str, shard: str) -> tuple[EncodedClip, tuple]:
        """The clip drawn as ``_decode`` draws it (its frames, then its box and flip), for
        the training process to decode (``device``), and the times it spans."""
        assert self.crop is not None
        with decode_errors() as av, av.open(io.BytesIO(data), mode="r") as container:
            _, width, height, rate, start, wanted, count = self._draw(container, rng)
        left, top, right, bottom = self.crop.box(width, height, rng)
        flip = bool(self.crop.flip and rng.random() < 0.5)
        seconds = (start / rate, (wanted[-1] + 1) / rate) if rate else (0.0, 0.0)
        within = [n for n in wanted if n < count] or [0] if count else wanted
        wanted = within + [within[-1]] * (len(wanted) - len(within))  # a short video: the clip's last frame again
        box = (float(left), float(top), float(right), float(bottom))
        return EncodedClip(data, tuple(wanted), box, flip, key, shard), seconds

    def _keeper(self, width: int, height: int, rng: np.random.Generator) -> Callable[[np.ndarray], torch.Tensor]:
        """What is kept of each decoded ``H x W x 3`` frame: all of it (``C x H x W``), or the
        crop's box, drawn now for the whole clip, resized (and flipped) to ``size x size``."""
        if self.crop is None:
            return lambda pixels: torch.from_numpy(pixels).permute(2, 0, 1)
        left, top, right, bottom = self.crop.box(width, height, rng)
        flip, size = bool(self.crop.flip and rng.random() < 0.5), self.crop.size

        def cropped(pixels: np.ndarray) -> torch.Tensor:
            region = torch.from_numpy(pixels[top:bottom, left:right]).permute(2, 0, 1)[None].float()
            out = functional.interpolate(region, size=(size, size), mode="bilinear", align_corners=False,
                                         antialias=True)[0]
            return out.flip(-1) if flip else out

        return cropped


def _sound_field(field: str) -> str:
    """The name of a video field's sound: its extension ``audio`` (``mp4`` -> ``audio``, ``0.mp4`` -> ``0.audio``)."""
    return f"{field.rsplit('.', 1)[0]}.audio" if "." in field else "audio"
