"""Where a structured sample's targets lie in its image, and how the fused crop moves them.

``plan`` reads a decoded sample (its skeletons' placeholders, where a member fills them, and
the crop's options) and says, field by field, what the crop does: boxes moved, masks cropped,
keypoints moved, rows of a box field dropped with its boxes, or left as they are. The rules
are docs/targets.md's "What the crop does with each field":

- a box field is a torchvision ``BoundingBoxes`` (XYXY, XYWH or CXCYWH) or a field named in
  ``boxes=``; its rows are its own: boxes left empty are dropped from it alone;
- the fields per box of a box field are in the same dict (or the same tuple) and have one row
  per box: a 1-D array (labels, flags), a ``Mask`` of one plane per box, keypoints of one
  group per box; or are named in ``per_box=``;
- ``KeyPoints`` (and arrays named in ``keypoints=``) are moved as torchvision's v2 moves them;
- a field named in ``not_spatial=`` (by its name, a prefix of it, or its stem) is left as it
  is, canvas and all.

Pure: numpy and torch only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.format import fields as rule

Box = tuple[int, int, int, int]

FORMS = {"XYXY": "xyxy", "XYWH": "xywh", "CXCYWH": "cxcywh"}
"""torchvision's box formats the crop moves, by its name for each."""


@dataclass
class Plan:
    """What the crop does with each target field of one sample."""

    boxes: dict[str, str] = field(default_factory=dict)  # field -> its form
    masks: list[str] = field(default_factory=list)  # tv_tensors.Mask fields
    points: dict[str, bool] = field(default_factory=dict)  # field -> whether a third column says visibility
    rows: dict[str, str] = field(default_factory=dict)  # field -> the box field whose rows it keeps
    canvases: list[tuple[str, tuple[str, ...], str, dict[str, Any]]] = field(default_factory=list)

    def placed(self) -> set[str]:
        return {*self.boxes, *self.masks, *self.points, *self.rows}


def named(name: str, entries: tuple[str, ...]) -> bool:
    """Whether ``name`` is one of ``entries``, or below one (``"1"``, ``"1.boxes"`` name ``"1.boxes.npy"``)."""
    return any(name == e or name.startswith(e + ".") for e in entries)


def plan(crop: Any, decoded: dict[str, Any], where: str) -> Plan:
    """The crop's plan for a decoded sample: its typed fields, then the ones ``crop`` names."""
    found = Plan()
    _typed(found, decoded, crop.not_spatial, where)
    for entry, form in crop.boxes.items():
        for name in _fields(entry, decoded, crop.not_spatial):
            found.boxes[name] = form
    for entry in crop.keypoints:
        for name in _fields(entry, decoded, crop.not_spatial):
            found.points[name] = True
    _rows(found, crop, decoded, where)
    return found


def _fields(entry: str, decoded: dict[str, Any], left: tuple[str, ...]) -> list[str]:
    """The field an option names, by its name or its name without the extension
    (``"1.boxes"`` names ``"1.boxes.npy"``); none where the sample has none or it is left."""
    return [name for name in decoded if (name == entry or name.rpartition(".")[0] == entry)
            and not name.startswith("__") and not named(name, left)]


def _typed(found: Plan, decoded: dict[str, Any], left: tuple[str, ...], where: str) -> None:
    """The tv_tensors of the sample, from its skeletons: a placeholder counts where a member
    fills it (a string of the same text, where none does, is a string)."""
    for name in decoded:
        parsed = rule.parse(name)
        if name.startswith("__") or parsed.stem is None or (not parsed.steps and parsed.ext == "json") \
                or named(name, left):
            continue
        skeleton = decoded.get(rule.render(parsed.stem, (), "json"))
        kind, meta = rule.tv_tensor(_node(skeleton, parsed.steps)) or (None, {})
        if kind == "BoundingBoxes":
            form = FORMS.get(str(meta.get("format")))
            if form is None:
                raise ConfigError(f"field {name!r} of {where} holds {meta.get('format')} boxes, which the crop cannot"
                                  f" move (it moves {', '.join(FORMS)}): name {name!r} in not_spatial= to leave"
                                  " them as they are")
            found.boxes[name] = form
        elif kind == "Mask":
            found.masks.append(name)
        elif kind == "KeyPoints":
            found.points[name] = False
        if kind in ("BoundingBoxes", "KeyPoints") and "canvas_size" in meta:
            found.canvases.append((rule.render(parsed.stem, (), "json"), parsed.steps, kind, meta))


def _node(skeleton: Any, steps: tuple[str, ...]) -> Any:
    """The skeleton's node at ``steps``, None where there is none."""
    node = skeleton
    for step in steps:
        if isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        elif isinstance(node, dict) and step in node:
            node = node[step]
        else:
            return None
    return node


def parent(name: str) -> tuple[str | None, tuple[str, ...]]:
    """The dict or list a field is in: its stem and path, or ``(None, ())`` for the sample's own
    fields (a tuple's positions, a dict sample's keys)."""
    parsed = rule.parse(name)
    return (parsed.stem, parsed.steps[:-1]) if parsed.steps else (None, ())


def _rows(found: Plan, crop: Any, decoded: dict[str, Any], where: str) -> None:
    """Which box field each per-box field follows: the one ``per_box=`` names, else the only
    box field in its dict, where its count of rows is that field's count of boxes."""
    for entry, box in crop.per_box.items():
        for name in _fields(entry, decoded, crop.not_spatial):
            found.rows[name] = _tied(name, box, found, where)
    unsaid: dict[str, str] = {}  # field -> a box field of as many rows, beside others
    for name, value in decoded.items():
        if (name.startswith("__") or name in found.boxes or name in found.rows or named(name, crop.not_spatial)
                or not _per_box_shape(name, value, found)):
            continue
        mates = [box for box in found.boxes if parent(box) == parent(name)]
        counted = [box for box in mates if _count(decoded[box]) == len(value)]  # none: no box field's rows
        if len(mates) > 1 and counted:
            unsaid[name] = counted[0]
        elif counted:
            found.rows[name] = counted[0]
    if unsaid:
        names = ", ".join(repr(name) for name in unsaid)
        boxes = ", ".join(dict.fromkeys(box for name in unsaid for box in found.boxes if parent(box) == parent(name)))
        several = len(unsaid) > 1
        raise ConfigError(f"field{'s' if several else ''} {names} of {where} {'are' if several else 'is'} beside the"
                          f" box fields {boxes}:"
                          f" say whose rows {'each' if several else 'it'} keeps in per_box={unsaid!r},"
                          f" or name {'them' if several else 'it'} in not_spatial=")


def _per_box_shape(name: str, value: Any, found: Plan) -> bool:
    """Whether a field's shape makes it one row per box: a 1-D array, a ``Mask`` of planes,
    keypoints in groups."""
    if not isinstance(value, (np.ndarray, torch.Tensor)):
        return False
    if name in found.masks:
        return value.ndim == 3
    if name in found.points:
        return value.ndim >= 3
    return value.ndim == 1


def _tied(name: str, box: str | None, found: Plan, where: str) -> str:
    """The box field of a field named in ``per_box=``: the one named with it, else the one in
    its dict, else the sample's only one."""
    if box is not None:
        named_box = [b for b in found.boxes if b == box or b.rpartition(".")[0] == box]
        if not named_box:
            raise ConfigError(f"per_box= says field {name!r} of {where} keeps the rows of {box!r}, which is not one"
                              f" of its box fields ({', '.join(found.boxes) or 'it has none'})")
        return named_box[0]
    mates = [b for b in found.boxes if parent(b) == parent(name)] or list(found.boxes)
    if len(mates) != 1:
        raise ConfigError(f"field {name!r} of {where} is named in per_box= and the sample has "
                          f"{len(mates) or 'no'} box fields{': ' + ', '.join(mates) if mates else ''}: say whose rows"
                          f" it keeps in per_box={{{name!r}: <box field>}}")
    return mates[0]


def _count(value: Any) -> int:
    return len(value) if getattr(value, "ndim", 1) else -1


def moved_boxes(value: Any, form: str, box: Box, size: int, flip: bool, where: str) -> tuple[Any, np.ndarray]:
    """Boxes in ``form`` moved into the crop: shifted by its corner, scaled to ``size``,
    clipped to the crop, flipped; with the mask of those not left empty. An array or tensor
    keeps its dtype (integer corners are truncated before the flip, as torchvision's v2 does)."""
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
    corners = [np.clip(v, 0, size) for v in ((x0 - left) * sx, (y0 - top) * sy, (a - left) * sx, (b - top) * sy)]
    if _integral(value):
        corners = [np.trunc(v) for v in corners]
    x0, y0, a, b = corners
    if flip:
        x0, a = size - a, size - x0
    keep = (a > x0) & (b > y0)
    if form == "xywh":
        a, b = a - x0, b - y0
    elif form == "cxcywh":
        x0, y0, a, b = (x0 + a) / 2, (y0 + b) / 2, a - x0, b - y0
    return _like(value, np.stack([x0, y0, a, b], axis=1)), keep


def moved_points(value: Any, box: Box, size: int, flip: bool, visibility: bool, where: str) -> Any:
    """Points ``[..., x, y (, v, ...)]`` moved into the crop as torchvision's v2 moves
    ``KeyPoints`` (shifted, scaled, flipped about ``size - 1``; those outside the crop kept
    outside it); with ``visibility``, a third column set to 0 where a point left the crop."""
    array = np.array(value, dtype=np.float64)
    if array.ndim < 1 or array.shape[-1] < 2:
        raise DecodeError(f"{where} holds points of shape {list(array.shape)}, not [..., x, y]")
    left, top, right, bottom = box
    x = (array[..., 0] - left) * (size / (right - left))
    y = (array[..., 1] - top) * (size / (bottom - top))
    if _integral(value):
        x, y = np.trunc(x), np.trunc(y)
    if flip:
        x = size - 1 - x
    array[..., 0], array[..., 1] = x, y
    if visibility and array.shape[-1] >= 3:
        array[..., 2] = np.where((x >= 0) & (x < size) & (y >= 0) & (y < size), array[..., 2], 0)
    return _like(value, array)


def _integral(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex())
    return isinstance(value, np.ndarray) and value.dtype.kind in "iu"


def _like(value: Any, array: np.ndarray) -> Any:
    """``array`` as ``value`` was: a tensor or array of its dtype, or lists."""
    if isinstance(value, torch.Tensor):
        return torch.from_numpy(array).to(value.dtype)
    if isinstance(value, np.ndarray):
        return array.astype(value.dtype)
    return array.tolist()


def rows(value: Any, keep: np.ndarray, where: str) -> Any:
    """The rows of ``value`` whose boxes ``keep`` keeps."""
    if len(value) != len(keep):
        raise DecodeError(f"{where} has {len(value)} rows for {len(keep)} boxes")
    if isinstance(value, torch.Tensor):
        return value[torch.from_numpy(keep)]
    if isinstance(value, np.ndarray):
        return value[keep]
    return [v for v, k in zip(value, keep, strict=True) if k]


def per_box_option(per_box: Any) -> dict[str, str | None]:
    """``per_box=`` as a mapping from each field to its box field (None: found by ``_tied``);
    ConfigError for anything else."""
    if isinstance(per_box, Mapping):
        entries = dict(per_box)
    else:
        names = tuple(per_box) if isinstance(per_box, Iterable) and not isinstance(per_box, (str, bytes)) else None
        if names is None or not all(isinstance(n, str) for n in names):  # read once: a generator is emptied by it
            raise ConfigError(f"RandomResizedCrop per_box is a list of field names, or a dict from each to its box"
                              f" field; got {per_box!r}")
        entries = dict.fromkeys(names)
    if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in entries.items()):
        raise ConfigError(f"RandomResizedCrop per_box maps field names to box field names; got {per_box!r}")
    return entries
