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
    typed = Typed(out, where)
    boxes = {**typed.boxes, **crop.boxes}
    per_box = typed.per_box(out, boxes)
    _refuse_unplaced(crop, out, where, (*boxes, *typed.masks, *per_box))
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
    for name in typed.masks:
        out[name] = _mask(out[name], box, crop.size, flip, (height, width), f"field {name!r} of {where}")
    kept = None
    for name, form in boxes.items():
        if name in out:
            out[name], keep = moved_boxes(out[name], form, box, crop.size, flip, f"field {name!r} of {where}")
            kept = keep if kept is None else kept & keep
    if kept is not None:
        for name in {*boxes, *crop.per_box, *per_box}:
            if name in out:
                out[name] = _rows(out[name], kept, f"field {name!r} of {where}")
    typed.resize_canvas(out, crop.size)
    return out


FORMS = {"XYXY": "xyxy", "XYWH": "xywh", "CXCYWH": "cxcywh"}
"""torchvision's box formats the crop moves, by its name for each."""


class Typed:
    """The fields a sample's skeletons say are torchvision ``BoundingBoxes`` (with their
    format) and ``Mask``s: the crop moves them for their type, with nothing to declare."""

    def __init__(self, decoded: dict[str, Any], where: str) -> None:
        self.boxes: dict[str, str] = {}
        self.masks: list[str] = []
        self.canvases: list[tuple[str, tuple[str, ...], str, dict[str, Any]]] = []  # skeleton, path, class, metadata
        for name, value in decoded.items():
            parsed = rule.parse(name)
            if name.startswith("__") or parsed.stem is None or parsed.steps or parsed.ext != "json":
                continue
            for steps, node in rule.placeholders(value).items():
                member = rule.render(parsed.stem, steps, "npy")
                kind, meta = rule.tv_tensor(node) or (None, {})
                if kind is not None and "canvas_size" in meta:
                    self.canvases.append((name, steps, kind, meta))
                if kind == "BoundingBoxes":
                    form = FORMS.get(str(meta.get("format")))
                    if form is None:
                        raise DecodeError(f"field {member!r} of {where} holds {meta.get('format')} boxes: the crop"
                                          f" moves {', '.join(FORMS)}; name it in not_spatial= to leave it")
                    self.boxes[member] = form
                elif kind == "Mask":
                    self.masks.append(member)

    def per_box(self, decoded: dict[str, Any], boxes: dict[str, str]) -> list[str]:
        """Arrays beside a box field, in the same dict, whose first dimension is its boxes' count
        (labels, flags, a Mask per box): their rows go with their boxes'."""
        rows = {}
        for name in boxes:
            parsed = rule.parse(name)
            if parsed.steps and name in decoded and isinstance(decoded[name], (np.ndarray, torch.Tensor)):
                rows[(parsed.stem, parsed.steps[:-1])] = len(decoded[name]) if decoded[name].ndim else -1
        found = []
        for name, value in decoded.items():
            parsed = rule.parse(name)
            if (name not in boxes and parsed.steps and isinstance(value, (np.ndarray, torch.Tensor))
                    and value.ndim >= 1 and rows.get((parsed.stem, parsed.steps[:-1])) == len(value)
                    and (name not in self.masks or value.ndim == 3)):
                found.append(name)
        return found

    def resize_canvas(self, decoded: dict[str, Any], size: int) -> None:
        """Say in each tv_tensor's placeholder that its canvas is now the crop's."""
        for name, steps, kind, meta in self.canvases:
            cropped = rule.tv_placeholder(kind, {**meta, "canvas_size": [size, size]})
            decoded[name] = _replaced(decoded[name], steps, cropped)


def _replaced(node: Any, steps: tuple[str, ...], value: Any) -> Any:
    if not steps:
        return value
    key: Any = int(steps[0]) if isinstance(node, list) else steps[0]
    node[key] = _replaced(node[key], steps[1:], value)
    return node


def _mask(value: Any, box: Box, size: int, flip: bool, image: tuple[int, int], where: str) -> Any:
    """A ``[... x] H x W`` mask cropped by nearest neighbour, as the image's masks are."""
    array = np.asarray(value)
    if array.ndim < 2 or array.shape[-2:] != image:
        raise DecodeError(f"{where} is a mask of shape {list(array.shape)} for an image of {image[1]} x {image[0]}"
                          " pixels (H x W last)")
    lead = array.shape[:-2]
    stacked = np.moveaxis(array.reshape(-1, *image), 0, -1)
    return np.moveaxis(nearest(stacked, box, size, flip), -1, 0).reshape(*lead, size, size)


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


def _refuse_unplaced(crop: RandomResizedCrop, decoded: dict[str, Any], where: str, placed: tuple[str, ...]) -> None:
    """ConfigError for the first field that may hold positions the crop does not move."""
    declared = (*placed, *crop.per_box)
    for name, value in decoded.items():
        if name.startswith("__") or name in declared or _named(name, crop.not_spatial):
            continue
        ext = _ext(name)
        if ext in ("cls", "txt", "bin") or (ext == "json" and not _holds_numbers(value)):
            continue
        if ext == "npy" and np.size(value) <= 1:  # one number (a label, an id) is no position
            continue
        raise ConfigError(f"RandomResizedCrop cannot tell where field {name!r} of {where} lies in the image: name it"
                          " in boxes= (with its format) or per_box=, or in not_spatial= to leave it as it is")


def _named(name: str, entries: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in entries)


def _holds_numbers(value: Any) -> bool:
    """Whether a JSON value holds a number that may be a position: in a list (a box, a polygon),
    or in a nested dict (a point); not a number alone, nor one under a key of the value's own
    dict (an image id, an area)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = json.loads(bytes(value))
    stack = [(value, 0, False)]
    while stack:
        node, depth, listed = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, depth + 1, False) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, True) for v in node)
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and (listed or depth > 1):
            return True
    return False
