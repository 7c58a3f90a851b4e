"""Random-resized-crop for image bytes, fused with decoding.

``RandomResizedCrop(224)`` picks the crop box on the image's full-size coordinates (read
from the JPEG header alone), decodes with libjpeg-turbo (through simplejpeg) straight into
an array, and resizes only the box with torch's antialiased bilinear kernel, which gives
Pillow's result (PSNR ~70 dB) in about half its time. Two options trade exactness for
speed, both on by default:

- ``reduced``: when the box is at least twice ``size`` on both sides, decode at 1/2, 1/4
  or 1/8 scale (libjpeg's DCT scaling) so the box still covers ``size`` pixels;
- ``fast``: libjpeg-turbo's fast integer IDCT and fast chroma upsampling.

``RandomResizedCrop(224, reduced=False, fast=False)`` is the exact path. Images that are
not JPEG (PNG, WebP...) go through Pillow.
"""

from __future__ import annotations

import io
import math
import numbers
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torch.nn import functional

from remote_loader.checks import require_bool, require_int
from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format.fields import DEEP_MODES
from remote_loader.pipeline.stages.decode import IMAGE_FIELDS
from remote_loader.pipeline.stages.targets import per_box_option

JPEG_MAGIC = b"\xff\xd8"


BOX_FORMATS = ("xyxy", "xywh", "cxcywh")


def _numbers(values: Any, count: int) -> tuple[float, ...] | None:
    """``values`` as ``count`` finite floats (numpy's numbers and arrays too), else None
    (a bool, a string, inf or nan among them, or another count)."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        return None
    items = list(values)
    if len(items) != count or not all(isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
                                      and math.isfinite(v) for v in items):
        return None
    return tuple(float(v) for v in items)


def _normalisation(mean: Any, std: Any) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """``mean`` and ``std`` checked: three finite numbers each (std's positive), or both None."""
    if (mean is None) != (std is None):
        raise ConfigError("RandomResizedCrop takes mean and std together, or neither")
    if mean is None:
        return None, None
    checked = {name: _numbers(values, 3) for name, values in (("mean", mean), ("std", std))}
    for name, values in (("mean", mean), ("std", std)):
        if checked[name] is None:
            raise ConfigError(f"RandomResizedCrop {name} must be three finite numbers (one per channel), got"
                              f" {values!r}")
    if not all(v > 0 for v in checked["std"] or ()):
        raise ConfigError(f"RandomResizedCrop std must be positive, got {std!r}")
    return checked["mean"], checked["std"]


def _field_names(name: str, names: Any) -> tuple[str, ...]:
    """``names`` as a tuple of field names, read once (a generator was emptied by its check)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise ConfigError(f"RandomResizedCrop {name} is a list of field names, got {names!r}")
    listed = tuple(names)
    if not all(isinstance(n, str) for n in listed):
        raise ConfigError(f"RandomResizedCrop {name} is a list of field names, got {listed!r}")
    return listed


class RandomResizedCrop:
    """Decode an image field straight to a ``size`` x ``size`` random crop (a uint8 CxHxW tensor).

    Use it as a decoder: ``RemoteDataset(...).decode(RandomResizedCrop(224))``; labels are
    decoded as usual. Same box distribution as torchvision's RandomResizedCrop.

    In a pipeline, every sample's box and flip are drawn from (the dataset's seed, the
    epoch, the sample's key): the same crops whatever the number of threads, DataLoader
    workers or ranks, and after a resume. Called directly, it draws from its own
    generator (``seed``).

    Args:
        size: Output side in pixels.
        scale: Range of the box's area as a fraction of the image.
        ratio: Range of the box's aspect ratio.
        flip: Flip horizontally with probability 1/2.
        reduced: Decode JPEGs at 1/2, 1/4 or 1/8 scale when the box is that much larger
            than ``size``.
        fast: Use libjpeg-turbo's fast IDCT and upsampling for JPEGs.
        seed: Seed of the boxes when called outside a pipeline (None: fresh randomness).
        mean: Per-channel means on a 0-1 scale (ImageNet's: ``(0.485, 0.456, 0.406)``):
            with ``std``, the crop comes out as normalised float32 instead of uint8.
        std: Per-channel standard deviations on a 0-1 scale, with ``mean``.
        boxes: For structured samples (detection, segmentation, flow: docs/targets.md), the
            fields holding boxes, each with its format (``"xyxy"``, ``"xywh"``, ``"cxcywh"``,
            in the image's pixels): moved with the crop, clipped, and those left empty dropped.
        per_box: Fields with one row per box (labels, flags), whose rows are dropped with
            their boxes: a list (each keeps the rows of the box field in its dict, or of the
            sample's only one), or a dict from each field to its box field.
        keypoints: Fields holding points, ``x, y`` first in their last dimension (Keypoint
            R-CNN's ``N x K x 3``): moved as ``tv_tensors.KeyPoints`` are, a third column
            (visibility) set to 0 where a point leaves the crop.
        not_spatial: Fields (or stems: ``"1"`` names every field of position 1, ``"1.boxes"``
            the field ``"1.boxes.npy"``) left as they are. A structured sample with a field
            the crop cannot place (an array, a JSON value holding numbers) that is named
            nowhere is refused.
    """

    seeded = True
    """Ask the pipeline for a generator per sample (see ``remote_loader.pipeline.stages.chain.sample_rng``)."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        *,
        flip: bool = True,
        reduced: bool = True,
        fast: bool = True,
        seed: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        boxes: Mapping[str, str] | None = None,
        per_box: Sequence[str] | Mapping[str, str] = (),
        keypoints: Sequence[str] = (),
        not_spatial: Sequence[str] = (),
    ) -> None:
        size = require_int("RandomResizedCrop size", size, 1)
        bound = Image.MAX_IMAGE_PIXELS  # an output no image may be: each sample failed to allocate it
        if bound and size * size > bound:
            raise ConfigError(f"RandomResizedCrop size {size} makes {size * size:,d} pixels an output, past"
                              f" PIL.Image.MAX_IMAGE_PIXELS ({bound:,d}): raise that first for outputs so large")
        if boxes is not None and not isinstance(boxes, Mapping):
            raise ConfigError(f"RandomResizedCrop boxes maps field names to one of {', '.join(BOX_FORMATS)};"
                              f" got {type(boxes).__name__} {boxes!r}")
        boxes = dict(boxes or {})
        bad = {k: v for k, v in boxes.items() if not isinstance(k, str) or v not in BOX_FORMATS}
        if bad:
            raise ConfigError(f"RandomResizedCrop boxes maps field names to one of {', '.join(BOX_FORMATS)};"
                              f" got {bad!r}")
        self.keypoints = _field_names("keypoints", keypoints)
        self.not_spatial = _field_names("not_spatial", not_spatial)
        self.boxes, self.per_box = boxes, per_box_option(per_box)
        low_high: dict[str, tuple[float, float]] = {}
        for name, given in (("scale", scale), ("ratio", ratio)):
            pair = _numbers(given, 2)
            if pair is None or not 0 < pair[0] <= pair[1]:
                raise ConfigError(f"RandomResizedCrop {name} must be (low, high) with 0 < low <= high, got {given!r}")
            low_high[name] = (pair[0], pair[1])
        if seed is not None:
            require_int("RandomResizedCrop seed", seed, 0, 2**63 - 1)
        for name, flag in (("flip", flip), ("reduced", reduced), ("fast", fast)):
            require_bool(f"RandomResizedCrop {name}", flag)  # "no" was taken for True
        self.size = size
        self.scale, self.ratio = low_high["scale"], low_high["ratio"]
        self.flip, self.reduced, self.fast, self.seed = bool(flip), bool(reduced), bool(fast), seed
        self.mean, self.std = _normalisation(mean, std)
        self._rng: np.random.Generator | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rng": None}  # each worker process draws its own boxes

    def _generator(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        return self._rng

    def box(self, width: int, height: int, rng: np.random.Generator | None = None) -> tuple[int, int, int, int]:
        """Draw a crop box ``(left, top, right, bottom)`` for an image of this size."""
        rng = rng or self._generator()
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
                return left, top, left + w, top + h
        w, h = min(width, height), min(width, height)  # fallback: a centred square
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def decode(self, data: Any, rng: np.random.Generator | None = None) -> torch.Tensor:
        """Decode image bytes to a random crop: a ``3 x size x size`` uint8 tensor (float32,
        normalised, with ``mean`` and ``std``)."""
        rng = rng or self._generator()
        try:
            if bytes(data[:2]) == JPEG_MAGIC:
                pixels, box = self._jpeg(data, rng)
            else:
                pixels, box = self._other(data, rng)
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise DecodeError(f"not a decodable image ({type(exc).__name__})") from None
        return self.resized(pixels, box, self.flip and rng.random() < 0.5)

    def resized(self, pixels: np.ndarray, box: tuple[int, int, int, int], flip: bool) -> torch.Tensor:
        """``box`` of ``H x W x 3`` uint8 ``pixels``, resized to the crop (antialiased bilinear),
        flipped if ``flip``, normalised if the crop has ``mean`` and ``std``."""
        left, top, right, bottom = box
        region = torch.from_numpy(pixels)[top:bottom, left:right].permute(2, 0, 1).unsqueeze(0)
        crop = functional.interpolate(region, size=(self.size, self.size), mode="bilinear", antialias=True,
                                      align_corners=False)[0]
        if flip:
            crop = crop.flip(-1)
        if self.mean is not None and self.std is not None:
            mean = torch.tensor(self.mean).view(3, 1, 1) * 255
            return (crop.float() - mean) / (torch.tensor(self.std).view(3, 1, 1) * 255)
        return crop.contiguous()

    def _jpeg(self, data: Any, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        width, height = jpeg_size(data)
        shrink, box = self._reduced(width, height, self.box(width, height, rng))
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=self.fast, fastupsample=self.fast,
                                        min_width=math.ceil(width / shrink), min_height=math.ceil(height / shrink),
                                        buffer=_pixel_buffer(width * height * 3))
        return pixels, box

    def _reduced(self, width: int, height: int,
                 box: tuple[int, int, int, int]) -> tuple[int, tuple[int, int, int, int]]:
        """The DCT scale a JPEG is decoded at (1, 2, 4 or 8: ``reduced``) and the box on the
        image so decoded, whose sides are ``ceil(side / shrink)`` pixels."""
        left, top, right, bottom = box
        shrink = 1
        if self.reduced:
            factor = min(right - left, bottom - top) / self.size
            while shrink < 8 and shrink * 2 <= factor:
                shrink *= 2
        if shrink == 1:
            return 1, box
        sx, sy = math.ceil(width / shrink) / width, math.ceil(height / shrink) / height
        return shrink, (int(left * sx), int(top * sy), max(int(left * sx) + 1, round(right * sx)),
                        max(int(top * sy) + 1, round(bottom * sy)))

    def source_box(self, width: int, height: int, box: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
        """The part of a ``width x height`` JPEG that ``decode`` resizes for ``box``, in the
        image's own pixels: the box itself, or where ``reduced`` decoding moved its edges to
        the reduced image's pixels, those edges (a decoder at full scale, the GPU's, resizes
        this to give the same crop)."""
        shrink, (left, top, right, bottom) = self._reduced(width, height, box)
        if shrink == 1:
            return float(box[0]), float(box[1]), float(box[2]), float(box[3])
        return (float(left * shrink), float(top * shrink), float(min(width, right * shrink)),
                float(min(height, bottom * shrink)))

    def _other(self, data: Any, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        image: Image.Image = Image.open(io.BytesIO(data))
        if image.mode in DEEP_MODES:
            raise DecodeError(f"a {image.mode} image, whose values 8-bit RGB would clip: crop it after decode('pil'),"
                              " which keeps its mode")
        if image.mode != "RGB":
            image = image.convert("RGB")
        return np.array(image), self.box(*image.size, rng)

    def __call__(self, field: str, data: Any, rng: np.random.Generator | None = None) -> Any:
        """Decoder protocol of ``RemoteDataset.decode``: called for image fields."""
        if field.rsplit(".", 1)[-1] in IMAGE_FIELDS:
            return self.decode(data, rng)
        return data


def jpeg_size(data: Any) -> tuple[int, int]:
    """A JPEG's ``(width, height)`` from its header; ``Image.DecompressionBombError`` for one
    that Pillow would refuse to open, past twice ``PIL.Image.MAX_IMAGE_PIXELS`` (a 14 MB JPEG
    of 30000 x 30000 decodes to 2.7 GB), before any pixel is decoded. ValueError where the
    header is not a JPEG's."""
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    bound = Image.MAX_IMAGE_PIXELS
    if bound is not None and width * height > 2 * bound:
        raise Image.DecompressionBombError(f"a JPEG of {width} x {height} pixels, past twice Pillow's"
                                           f" MAX_IMAGE_PIXELS ({bound})")
    return width, height


_REUSED = 16 << 20
"""The largest decoded image (bytes) a thread decodes into its buffer: 5.5 MP of RGB."""
_buffers = threading.local()


def _pixel_buffer(size: int) -> np.ndarray | None:
    """This thread's buffer for a decoded JPEG of up to ``size`` bytes, kept for the next: a
    crop is resized out of it before the thread decodes again. A fresh array per image would
    leave a hole in the heap each time, between the shuffle buffer's samples. None for an
    image larger than ``_REUSED`` (it gets an array of its own)."""
    if size > _REUSED:
        return None
    buffer: np.ndarray | None = getattr(_buffers, "pixels", None)
    if buffer is None or buffer.size < size:
        buffer = _buffers.pixels = np.empty(max(size, 1 << 20), np.uint8)
    return buffer
