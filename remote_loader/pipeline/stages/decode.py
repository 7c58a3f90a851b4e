"""Decoding fields: images to PIL / uint8 arrays / tensors, labels to Python values."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format.fields import DEEP_MODES, IMAGE_EXTENSIONS, INPUT_MODES
from remote_loader.format.video import VIDEO_EXTENSIONS

IMAGE_FIELDS = IMAGE_EXTENSIONS
MODES = ("pil", "rgb8", "torchrgb", "raw")


def load_npy(data: bytes) -> np.ndarray:
    """A ``.npy`` member's array; ValueError where it is not one, or where its header claims
    other than the values its bytes hold (a 150-byte member claiming 2**40 values would
    otherwise allocate them)."""
    fp = io.BytesIO(data)
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
    else:
        raise ValueError(f"a .npy of version {version}, which is not read")
    count = 1
    for side in shape:
        count *= int(side)
    if dtype.hasobject or count * dtype.itemsize != len(data) - fp.tell():
        raise ValueError(f"a .npy header claiming {shape} of {dtype} over {len(data) - fp.tell()} bytes")
    fp.seek(0)
    return np.load(fp, allow_pickle=False)


def _draft(image: Image.Image, min_size: int) -> None:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale while the shorter side stays >= ``min_size``."""
    width, height = image.size
    shorter = min(width, height)
    if image.format == "JPEG" and shorter > min_size:
        image.draft("RGB", (-(-width * min_size // shorter), -(-height * min_size // shorter)))


def _image(data: Any, mode: str, where: str, min_size: int | None, facts: dict[str, Any], target: bool) -> Any:
    """An image field as ``mode`` says, in RGB; a ``target`` (a structured sample's image
    stored in a mode that is not an input image's: a mask, a depth map) keeps its mode, and
    so does an image of more than 8 bits a value (``DEEP_MODES``: 16-bit, 32-bit, float),
    which RGB would clip."""
    try:
        opened: Image.Image = Image.open(io.BytesIO(data))
        if (target and opened.mode not in INPUT_MODES) or opened.mode in DEEP_MODES:
            opened.load()
            image = opened
        else:
            if min_size:
                _draft(opened, min_size)
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DecodeError(f"{where} is not a decodable image ({type(exc).__name__})", **facts) from None
    if mode == "pil":
        return image
    array = np.asarray(image)
    if mode == "rgb8":  # Pillow's is read-only: torch's collate warns of it, a user's in-place op fails
        return array.copy()
    wide = array.dtype.kind == "u" and array.dtype.itemsize == 2  # torch has no uint16 ops: int32 holds it
    tensor = torch.from_numpy(array.astype(np.int32) if wide or not array.dtype.isnative else array.copy())
    return tensor.permute(2, 0, 1) if tensor.ndim == 3 else tensor


class VideoFields(Protocol):
    """What decodes a video field (``VideoClip``): the fields it becomes."""

    def fields(self, field: str, data: Any, rng: Any, key: str = "", shard: str = "") -> dict[str, Any]: ...


def decode_sample(
    sample: dict[str, Any], mode: str | Callable[..., Any], min_size: int | None = None, rng: Any = None,
    video: VideoFields | None = None,
) -> dict[str, Any]:
    """Decode every field of ``sample``: images by ``mode``, ``cls`` to int, ``txt`` to str,
    ``json`` to its value, ``npy`` to a numpy array. A structured sample's masks and depth maps
    (images stored in another mode than an input image's) keep their mode: ``"pil"`` gives
    them as they were, ``"rgb8"`` their ``H x W`` values, ``"torchrgb"`` a tensor of them.

    A callable ``mode`` is called as ``mode(field, data)`` for image fields (``mode(field,
    data, rng=rng)`` when a generator is given, for seeded decoders); other fields are
    decoded as above.

    ``min_size`` lets JPEGs decode at a reduced scale whose shorter side is still at least
    that many pixels (Pillow's draft mode: libjpeg's DCT scaling, slightly softer than a
    full decode followed by a resize).

    ``video`` (a ``VideoClip``) makes the fields of each video field (mp4, mov, mkv, webm,
    avi): ``video.fields(field, data, rng)``, its clip and, where asked, its sound; without
    it they stay bytes. A field some stage already decoded (not
    bytes) is kept as it is.
    """
    if not callable(mode) and mode not in MODES:
        raise ConfigError(f"decode mode must be one of {', '.join(MODES)} or a callable, got {mode!r}")
    out: dict[str, Any] = {}
    for name, value in sample.items():
        if name.startswith("__"):
            out[name] = value
            continue
        where = f"field {name!r} of sample {sample.get('__key__')!r} in {sample.get('__shard__')}"
        facts = {"key": sample.get("__key__"), "field": name}
        ext = name.rsplit(".", 1)[-1]
        if not isinstance(value, (bytes, bytearray, memoryview)):
            out[name] = value  # decoded already (a stage before, or decode() twice)
        elif ext in VIDEO_EXTENSIONS and video is not None:
            try:
                out.update(video.fields(name, value, rng, str(facts["key"] or ""), str(sample.get("__shard__") or "")))
            except DecodeError as exc:
                raise DecodeError(f"{where}: {exc}", **facts) from None
        elif ext in IMAGE_FIELDS:
            if callable(mode):
                try:
                    out[name] = mode(name, value) if rng is None else mode(name, value, rng=rng)
                except DecodeError as exc:  # a decoder's own, which knows no sample: named here
                    if exc.key is not None:
                        raise
                    raise DecodeError(f"{where}: {exc}", **facts) from None
            else:
                out[name] = bytes(value) if mode == "raw" else _image(value, mode, where, min_size, facts, "." in name)
        elif ext == "cls":
            try:
                out[name] = int(bytes(value))
            except ValueError:
                raise DecodeError(f"{where} is not an integer class", **facts) from None
        elif ext == "txt":
            try:
                out[name] = bytes(value).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DecodeError(f"{where} is not UTF-8 text (byte {exc.start})", **facts) from None
        elif ext == "json":
            try:
                out[name] = json.loads(bytes(value))
            except ValueError:
                raise DecodeError(f"{where} is not valid JSON", **facts) from None
            except RecursionError:
                raise DecodeError(f"{where} is JSON nested deeper than Python reads", **facts) from None
        elif ext == "npy":
            try:
                out[name] = load_npy(bytes(value))
            except (ValueError, EOFError, OSError) as exc:
                raise DecodeError(f"{where} is not a NumPy .npy array ({exc})", **facts) from None
        else:
            out[name] = bytes(value)
    return out
