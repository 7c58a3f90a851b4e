"""A structured sample cropped together (``RandomResizedCrop`` on detection, segmentation,
depth, flow and stereo samples): one box and one flip, drawn from the first input image,
applied to every image of the sample, to its masks and depth maps by nearest neighbour (no
value invented), and to its declared boxes by the same affine map. A field the crop cannot
place is refused unless the crop names it ``not_spatial``: cropping an image while leaving
its spatial targets as they were would silently train on wrong labels."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format import fields as rule
from remote_loader.pipeline.augment import RandomResizedCrop
from remote_loader.pipeline.decode import IMAGE_FIELDS

Box = tuple[int, int, int, int]


def is_structured(sample: dict[str, Any]) -> bool:
    return any("." in name for name in sample if not name.startswith("__"))


def crop_together(crop: RandomResizedCrop, sample: dict[str, Any], rng: np.random.Generator,
                  decode_rest: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """``sample`` with its images cropped by one box and flip, its masks and boxes with
    them, and its other fields decoded by ``decode_rest``."""
    key = sample.get("__key__")
    where = f"sample {key!r} of {sample.get('__shard__')}"
    images = {name: _open(value, f"field {name!r} of {where}", key, name)
              for name, value in sample.items() if not name.startswith("__") and _ext(name) in IMAGE_FIELDS}
    out = decode_rest({name: value for name, value in sample.items() if name not in images})
    _refuse_unplaced(crop, out, where)
    if not images:
        return out
    inputs = [n for n, image in images.items() if image.mode in rule.INPUT_MODES]
    primary = (inputs or list(images))[0]
    width, height = images[primary].size
    for name, image in images.items():
        if image.size != (width, height):
            raise DecodeError(f"field {name!r} of {where} is {image.size[0]} x {image.size[1]} pixels and"
                              f" {primary!r} {width} x {height}: a crop takes images of one size", key=key, field=name)
    box = crop.box(width, height, rng)
    flip = crop.flip and bool(rng.random() < 0.5)
    for name, image in images.items():
        if name in inputs:
            out[name] = crop.resized(np.array(image.convert("RGB")), box, flip)
        else:  # H x W, or C x H x W for a mask of several channels (LA), as decode("torchrgb") gives them
            values = torch.from_numpy(nearest(_pixels(image), box, crop.size, flip))
            out[name] = values.permute(2, 0, 1) if values.ndim == 3 else values
    kept = None
    for name, form in crop.boxes.items():
        if name in out:
            out[name], keep = moved_boxes(out[name], form, box, crop.size, flip, f"field {name!r} of {where}")
            kept = keep if kept is None else kept & keep
    if kept is not None:
        for name in (*crop.boxes, *crop.per_box):
            if name in out:
                out[name] = _rows(out[name], kept, f"field {name!r} of {where}")
    return out


def _ext(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _open(value: Any, where: str, key: Any, name: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(bytes(value)))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DecodeError(f"{where} is not a decodable image ({type(exc).__name__})", key=key, field=name) from None
    return image


def _pixels(image: Image.Image) -> np.ndarray:
    """A target image's values: palette indices for ``P``, 16-bit values as int32."""
    array = np.asarray(image)
    return array.astype(np.int32) if array.dtype == np.uint16 else array


def nearest(array: np.ndarray, box: Box, size: int, flip: bool) -> np.ndarray:
    """``box`` of an ``H x W [x C]`` array resized to ``size x size`` by nearest neighbour
    (each output pixel takes the source pixel under its centre), flipped if ``flip``."""
    left, top, right, bottom = box
    rows = top + np.minimum(((np.arange(size) + 0.5) * (bottom - top) / size).astype(np.int64), bottom - top - 1)
    cols = left + np.minimum(((np.arange(size) + 0.5) * (right - left) / size).astype(np.int64), right - left - 1)
    if flip:
        cols = cols[::-1]
    return np.ascontiguousarray(array[rows][:, cols])


def moved_boxes(value: Any, form: str, box: Box, size: int, flip: bool, where: str) -> tuple[Any, np.ndarray]:
    """Boxes in ``form`` moved into the crop: shifted by its corner, scaled to ``size``,
    flipped, clipped to the crop; with the mask of those not left empty."""
    array = np.asarray(value, dtype=np.float64)
    if array.size == 0:
        array = array.reshape(0, 4)
    if array.ndim != 2 or array.shape[1] != 4:
        raise DecodeError(f"{where} holds boxes of shape {list(array.shape)}, not N x 4")
    x0, y0, a, b = array.T
    if form == "xywh":
        a, b = x0 + a, y0 + b
    elif form == "cxcywh":
        x0, y0, a, b = x0 - a / 2, y0 - b / 2, x0 + a / 2, y0 + b / 2
    left, top, right, bottom = box
    sx, sy = size / (right - left), size / (bottom - top)
    x0, a = (x0 - left) * sx, (a - left) * sx
    y0, b = (y0 - top) * sy, (b - top) * sy
    if flip:
        x0, a = size - a, size - x0
    x0, a, y0, b = (np.clip(v, 0, size) for v in (x0, a, y0, b))
    keep = (a > x0) & (b > y0)
    if form == "xywh":
        a, b = a - x0, b - y0
    elif form == "cxcywh":
        x0, y0, a, b = (x0 + a) / 2, (y0 + b) / 2, a - x0, b - y0
    moved = np.stack([x0, y0, a, b], axis=1)
    if isinstance(value, torch.Tensor):
        return torch.from_numpy(moved.astype(np.float32)), keep
    if isinstance(value, np.ndarray):
        return moved.astype(value.dtype if value.dtype.kind == "f" else np.float32), keep
    return moved.tolist(), keep


def _rows(value: Any, keep: np.ndarray, where: str) -> Any:
    if len(value) != len(keep):
        raise DecodeError(f"{where} has {len(value)} rows for {len(keep)} boxes")
    if isinstance(value, torch.Tensor):
        return value[torch.from_numpy(keep)]
    if isinstance(value, np.ndarray):
        return value[keep]
    return [v for v, k in zip(value, keep, strict=True) if k]


def _refuse_unplaced(crop: RandomResizedCrop, decoded: dict[str, Any], where: str) -> None:
    """ConfigError for the first field that may hold positions the crop does not move."""
    declared = (*crop.boxes, *crop.per_box)
    for name, value in decoded.items():
        if name.startswith("__") or name in declared or _named(name, crop.not_spatial):
            continue
        ext = _ext(name)
        if ext in ("cls", "txt", "bin") or (ext == "json" and not _holds_numbers(value)):
            continue
        raise ConfigError(f"RandomResizedCrop cannot tell where field {name!r} of {where} lies in the image: name it"
                          " in boxes= (with its format) or per_box=, or in not_spatial= to leave it as it is")


def _named(name: str, entries: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in entries)


def _holds_numbers(value: Any) -> bool:
    """Whether a JSON value holds a number inside a list or dict (a box, a polygon, a point)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = json.loads(bytes(value))
    stack, top = [value], True
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and not top:
            return True
        top = False
    return False
