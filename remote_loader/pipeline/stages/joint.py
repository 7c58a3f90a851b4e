"""A structured sample cropped together (``RandomResizedCrop`` on detection, segmentation,
depth, flow and stereo samples): one box and one flip, drawn from the first input image,
applied to every image of the sample, to its masks and depth maps by nearest neighbour (no
value invented), and to its targets as ``targets.plan`` says (boxes and keypoints by the same
affine map, each box field's rows with its own boxes). A field the crop cannot place is
refused unless the crop names it ``not_spatial``: cropping an image while leaving its
spatial targets as they were would silently train on wrong labels."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format import fields as rule
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.decode import IMAGE_FIELDS
from remote_loader.pipeline.stages.targets import Box, Plan, moved_boxes, moved_points, named, plan, rows


def structured_fields(names: Iterable[str]) -> list[str]:
    """The fields among ``names`` that make a sample structured (``0.jpg``, ``1.boxes.npy``:
    a position or key first), sorted; none for a classification pair's (``jpg``, ``cls``)."""
    return sorted(name for name in names if "." in name and not name.startswith("__"))


def is_structured(sample: dict[str, Any]) -> bool:
    return bool(structured_fields(sample))


def crop_together(crop: RandomResizedCrop, sample: dict[str, Any], rng: np.random.Generator,
                  decode_rest: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """``sample`` with its images cropped by one box and flip, its targets moved with them
    (``targets.plan``), and its other fields decoded by ``decode_rest``."""
    key = sample.get("__key__")
    where = f"sample {key!r} of {sample.get('__shard__')}"
    images = {name: _open(value, f"field {name!r} of {where}", key, name)
              for name, value in sample.items() if not name.startswith("__") and _ext(name) in IMAGE_FIELDS}
    out = decode_rest({name: value for name, value in sample.items() if name not in images})
    found = plan(crop, out, where)
    _refuse_unplaced(crop, out, where, found.placed())
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
    _move(found, out, box, crop.size, flip, (height, width), where)
    return out


def _move(found: Plan, out: dict[str, Any], box: Box, size: int, flip: bool, image: tuple[int, int],
          where: str) -> None:
    """The sample's targets moved by the crop's box and flip, as ``found`` says."""
    for name in found.masks:
        out[name] = _mask(out[name], box, size, flip, image, f"field {name!r} of {where}")
    for name, visibility in found.points.items():
        out[name] = moved_points(out[name], box, size, flip, visibility, f"field {name!r} of {where}")
    kept = {}
    for name, form in found.boxes.items():
        moved, kept[name] = moved_boxes(out[name], form, box, size, flip, f"field {name!r} of {where}")
        out[name] = rows(moved, kept[name], f"field {name!r} of {where}")
    for name, boxes in found.rows.items():
        out[name] = rows(out[name], kept[boxes], f"field {name!r} of {where} (one row for each box of {boxes!r})")
    for name, steps, kind, meta in found.canvases:  # each moved tv_tensor's placeholder: its canvas is the crop's
        out[name] = _replaced(out[name], steps, rule.tv_placeholder(kind, {**meta, "canvas_size": [size, size]}))


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


def _refuse_unplaced(crop: RandomResizedCrop, decoded: dict[str, Any], where: str, placed: set[str]) -> None:
    """ConfigError for the first field that may hold positions the crop does not move."""
    for name, value in decoded.items():
        if name.startswith("__") or name in placed or named(name, crop.not_spatial):
            continue
        ext = _ext(name)
        filled = {rule.parse(n).steps for n in decoded if n.startswith(name.rpartition(".")[0] + ".")}
        if ext in ("cls", "txt", "bin") or (ext == "json" and not _holds_numbers(value, filled)):
            continue
        if ext == "npy" and np.size(value) <= 1:  # one number (a label, an id) is no position
            continue
        raise ConfigError(f"RandomResizedCrop cannot tell where field {name!r} of {where} lies in the image: name it"
                          " in boxes= (with its format), keypoints= (points: x, y[, visibility] in its last"
                          " dimension) or per_box=, or in not_spatial= to leave it as it is")


def _holds_numbers(value: Any, filled: set[tuple[str, ...]]) -> bool:
    """Whether a JSON value holds a number that may be a position: in a list (a box, a polygon),
    or in a nested dict (a point); not a number alone, nor one under a key of the value's own
    dict (an image id, an area), nor one beside a member in its dict (an object's label beside
    its box: ``filled`` holds the paths of the value's members)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = json.loads(bytes(value))
    stack: list[tuple[Any, tuple[str, ...], bool]] = [(value, (), True)]
    while stack:
        node, path, attribute = stack.pop()
        if isinstance(node, dict):
            record = not path or any((*path, str(k)) in filled for k in node)
            stack.extend((v, (*path, str(k)), record) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, str(i)), False) for i, v in enumerate(node))
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and not attribute:
            return True
    return False
