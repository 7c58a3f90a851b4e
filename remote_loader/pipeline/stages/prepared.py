"""The worker side of decoding on a device: each JPEG's crop box and flip drawn exactly as
the CPU path draws them, the bytes checked for a whole JPEG's structure, and a batch's
JPEGs gathered into one tensor (``EncodedBatch``) that DataLoader shares and pins; each
video's clip (its frames, box and flip) drawn as the CPU path draws it, and a batch's videos
gathered the same way (``EncodedClips``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format.images import structure_problem
from remote_loader.pipeline.stages.augment import JPEG_MAGIC, RandomResizedCrop, jpeg_size
from remote_loader.pipeline.stages.containers import holds

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Encoded:
    """A JPEG whose crop was drawn in a worker, to decode in the main process."""

    data: bytes
    box: Box  # left, top, right, bottom, in the image's own pixels (fractions where the CPU path's are)
    flip: bool
    key: str
    shard: str
    problem: str | None = None  # why the bytes are not a whole JPEG: left out of the decode, or DecodeError


def prepare(crop: RandomResizedCrop, data: Any, rng: np.random.Generator, key: str, shard: str) -> Any:
    """What a worker makes of an image field: a JPEG's ``Encoded`` (its box and flip drawn as
    ``RandomResizedCrop.decode`` draws them: the box, then the flip), or the crop itself,
    decoded on the CPU, for another format."""
    if bytes(data[:2]) != JPEG_MAGIC:
        return Ready(crop.decode(data, rng))
    try:
        width, height = jpeg_size(data)
    except (ValueError, Image.DecompressionBombError) as exc:
        raise DecodeError(f"sample {key!r} of {shard} is not a decodable image ({exc})"[:300], key=key) from None
    box = crop.source_box(width, height, crop.box(width, height, rng))
    flip = bool(crop.flip and rng.random() < 0.5)
    return Encoded(bytes(data), box, flip, key, shard, structure_problem(data))


class Ready:
    """An image a worker decoded itself (not a JPEG), to move to the device with the batch."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Packed:
    """Files' bytes in one uint8 tensor (``offsets`` into it), one copy of each: what
    DataLoader shares with this process and pins, as a batch for the device."""

    def _pack(self, files: Sequence[bytes]) -> None:
        lengths = [len(data) for data in files]
        self.offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()
        self.data = torch.empty(self.offsets[-1], dtype=torch.uint8)
        packed = self.data.numpy()
        for k, data in enumerate(files):
            packed[self.offsets[k] : self.offsets[k + 1]] = np.frombuffer(data, dtype=np.uint8)

    def files(self) -> list[np.ndarray]:
        """Each file's bytes, a view into the tensor."""
        data = self.data.numpy()
        return [data[a:b] for a, b in zip(self.offsets, self.offsets[1:], strict=False)]

    def pin_memory(self) -> Packed:
        """DataLoader's ``pin_memory`` calls this: the bytes in page-locked memory."""
        self.data = self.data.pin_memory()
        return self


class EncodedBatch(Packed):
    """A batch's images: the JPEGs' bytes in one uint8 tensor (``offsets`` into it), their
    boxes and flips, and images already decoded (``Ready``: other formats), by position."""

    def __init__(self, items: Sequence[Any]) -> None:
        strays = [item for item in items if not isinstance(item, Encoded | Ready)]
        if strays:  # a column mixing images with something else: decoding would lose its samples
            raise ConfigError(f"a batch to decode on the device mixes images with a {type(strays[0]).__name__}:"
                              " decode(device=...) puts images in the image fields alone")
        jpegs = [(i, item) for i, item in enumerate(items) if isinstance(item, Encoded)]
        self.size = len(items)
        self.positions = [i for i, _ in jpegs]
        self._pack([item.data for _, item in jpegs])
        self.boxes = [item.box for _, item in jpegs]
        self.flips = [item.flip for _, item in jpegs]
        self.names = [(item.key, item.shard) for _, item in jpegs]
        self.problems = [item.problem for _, item in jpegs]
        self.decoded = {i: item.tensor for i, item in enumerate(items) if isinstance(item, Ready)}

    def __len__(self) -> int:
        return self.size

    def jpegs(self) -> list[np.ndarray]:
        """Each JPEG's bytes, a view into the batch's tensor."""
        return self.files()


@dataclass(frozen=True)
class EncodedClip:
    """A video whose clip was drawn in a worker, to decode in the training process: the
    numbers of its frames, and its crop's box (in the video's pixels) and flip."""

    data: bytes
    frames: tuple[int, ...]
    box: Box
    flip: bool
    key: str
    shard: str


class EncodedClips(Packed):
    """A batch's videos: their bytes in one uint8 tensor (``offsets`` into it), each clip's
    frame numbers (``n x T``), boxes and flips, and the samples they belong to."""

    def __init__(self, items: Sequence[EncodedClip]) -> None:
        strays = [item for item in items if not isinstance(item, EncodedClip)]
        if strays:
            raise ConfigError("a batch of clips to decode on the device mixes videos with a"
                              f" {type(strays[0]).__name__}: VideoClip(device=...) puts clips in video fields alone")
        self._pack([item.data for item in items])
        self.frames = np.asarray([item.frames for item in items], dtype=np.int32).reshape(len(items), -1)
        self.boxes = [item.box for item in items]
        self.flips = [item.flip for item in items]
        self.names = [(item.key, item.shard) for item in items]

    def __len__(self) -> int:
        return len(self.names)

    def videos(self) -> list[np.ndarray]:
        """Each video's bytes, a view into the batch's tensor."""
        return self.files()


IMAGES = (Encoded, Ready)
"""What a device stage makes of an image field: gathered into an ``EncodedBatch`` by ``collate``."""

GATHERED = (*IMAGES, EncodedClip)
"""What ``collate`` gathers into a batch for the device: images and clips."""


def gather(items: Sequence[Any]) -> EncodedBatch | EncodedClips:
    """Images (``Encoded``, ``Ready``) into an ``EncodedBatch``, clips into ``EncodedClips``."""
    return EncodedClips(items) if isinstance(items[0], EncodedClip) else EncodedBatch(items)


def collate(batch: Sequence[Any]) -> Any:
    """``default_collate``, with a batch's images (``Encoded`` and ``Ready``) gathered into an
    ``EncodedBatch``, its clips into ``EncodedClips`` (position by position in tuples, key by
    key in dicts)."""
    first = batch[0]
    if isinstance(first, GATHERED):
        return gather(batch)
    if isinstance(first, tuple | list) and any(holds(b, GATHERED) for b in batch):
        columns = [collate(list(column)) for column in zip(*batch, strict=True)]
        return tuple(columns) if isinstance(first, tuple) else columns
    if isinstance(first, dict) and any(holds(b, GATHERED) for b in batch):
        return {k: collate([b[k] for b in batch]) for k in first}
    return default_collate(list(batch))
