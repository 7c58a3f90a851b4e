"""Turn one ``(image, target)`` item of a torchvision-style dataset into shard fields.

Encoded files (bytes or a path) keep their bytes; in-memory images (PIL, uint8 arrays,
CxHxW tensors) are encoded once, in the chosen format. Targets follow WebDataset's
conventions: ``cls`` (ASCII digits), ``txt`` (UTF-8), ``json`` (a dict).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from remote_loader.errors import ConfigError, UploadError

# Pillow's format name -> the field (file extension) it is stored under.
EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}
ENCODINGS = {"jpeg": "JPEG", "jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


@dataclass(frozen=True)
class EncodeOptions:
    """How in-memory images are encoded.

    Attributes:
        image_format: ``"jpeg"``, ``"png"`` or ``"webp"``.
        quality: 1..100, for JPEG and WebP.
    """

    image_format: str = "jpeg"
    quality: int = 90

    def __post_init__(self) -> None:
        if self.image_format.lower() not in ENCODINGS:
            raise ConfigError(f"image_format must be one of jpeg, png, webp; got {self.image_format!r}")
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"quality must be in 1..100, got {self.quality}")


def _fail(index: int, message: str) -> UploadError:
    return UploadError(f"sample {index}: {message}", index=index)


def _sniff(data: bytes, index: int, what: str) -> str:
    """Return the field name for encoded image ``data`` by reading its header."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format
    except (UnidentifiedImageError, OSError, ValueError):
        raise _fail(index, f"{what} is not an image Pillow can read") from None
    if fmt not in EXTENSIONS:
        raise _fail(index, f"{what} is a {fmt} image; supported: {', '.join(sorted(set(EXTENSIONS)))}")
    return EXTENSIONS[fmt]


def _to_pil(array: np.ndarray, index: int) -> Image.Image:
    if array.dtype != np.uint8:
        raise _fail(index, f"image array has dtype {array.dtype}; convert to uint8 (0..255) first")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4)):
        return Image.fromarray(np.ascontiguousarray(array))
    raise _fail(index, f"image array has shape {array.shape}; expected HxW or HxWxC with C in 1, 3, 4")


def _from_tensor(tensor: Any, index: int) -> Image.Image:
    array = np.asarray(tensor.detach().cpu())
    if array.ndim == 3 and array.shape[0] in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # CxHxW -> HxWxC
    return _to_pil(array, index)


def _encode_pil(image: Image.Image, options: EncodeOptions, index: int) -> tuple[str, bytes]:
    fmt = ENCODINGS[options.image_format.lower()]
    if image.mode == "P" and fmt == "JPEG" and "transparency" not in image.info:
        image = image.convert("RGB")  # a palette holds RGB colours: no information is lost
    out = io.BytesIO()
    try:
        image.save(out, format=fmt, quality=options.quality)
    except (OSError, ValueError, KeyError) as exc:
        raise _fail(
            index, f"cannot encode a {image.mode} image as {fmt} ({exc}); convert it or pick another image_format"
        ) from None
    return EXTENSIONS[fmt], out.getvalue()


def encode_image(image: Any, options: EncodeOptions, index: int) -> tuple[str, bytes]:
    """Return ``(field, bytes)`` for an image given as bytes, a path, PIL, array or tensor."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        return _sniff(data, index, "image bytes"), data
    if isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise _fail(index, f"cannot read {os.fspath(image)!r}: {exc.strerror}") from None
        return _sniff(data, index, repr(os.fspath(image))), data
    if isinstance(image, Image.Image):
        return _encode_pil(image, options, index)
    if isinstance(image, np.ndarray):
        return _encode_pil(_to_pil(image, index), options, index)
    if type(image).__module__.startswith("torch") and hasattr(image, "detach"):
        return _encode_pil(_from_tensor(image, index), options, index)
    raise _fail(index, f"image is a {type(image).__name__}; expected PIL image, uint8 array, tensor, bytes or path")


def _plain(value: Any, index: int, where: str) -> int | float | str:
    if isinstance(value, (np.integer, np.floating)) or (
        type(value).__module__.startswith("torch") and hasattr(value, "item")
    ):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(index, f"{where} is a {type(value).__name__}; expected int, float or str")
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(index, f"{where} is {value}; JSON targets must be finite")
    return value


def encode_target(target: Any, index: int) -> dict[str, bytes]:
    """Return the label fields for ``target``: ``cls``, ``txt`` or ``json`` (none for None)."""
    if target is None:
        return {}
    if isinstance(target, Mapping):
        plain = {}
        for name, value in target.items():
            if not isinstance(name, str):
                raise _fail(index, f"target dict key {name!r} is not a str")
            plain[name] = _plain(value, index, f"target[{name!r}]")
        return {"json": json.dumps(plain, sort_keys=True, ensure_ascii=False).encode()}
    value = _plain(target, index, "target")
    if isinstance(value, float):
        raise _fail(index, "target is a float; use an int class index, a str or a dict")
    if isinstance(value, int):
        return {"cls": str(value).encode("ascii")}
    return {"txt": value.encode("utf-8")}


def encode_item(item: Any, options: EncodeOptions, index: int) -> dict[str, bytes]:
    """Return the fields of ``ds[index]``, which must be an ``(image, target)`` pair."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise _fail(index, f"ds[{index}] returned a {type(item).__name__}; expected an (image, target) pair")
    field, data = encode_image(item[0], options, index)
    return {field: data, **encode_target(item[1], index)}
