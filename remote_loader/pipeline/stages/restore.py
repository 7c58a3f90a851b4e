"""``restore(sample)``: a sample dict back as the item ``ds[i]`` gave at upload, by the field
rule (``remote_loader.format.fields``): a classification pair, a tuple, or a dict of fields.
Takes raw fields (bytes) and decoded ones (``decode()``'s output) alike."""

from __future__ import annotations

import functools
import io
import json
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from remote_loader.errors import DecodeError
from remote_loader.format import fields as rule
from remote_loader.format.fields import FieldName
from remote_loader.format.video import VIDEO_EXTENSIONS
from remote_loader.frames import decode_frames
from remote_loader.pipeline.stages.decode import IMAGE_FIELDS, load_npy

_RAW = (bytes, bytearray, memoryview)


def restore(sample: Mapping[str, Any]) -> Any:
    """The item ``ds[i]`` returned at upload: ``(image, target)`` for a classification pair,
    the tuple, or the dict of fields. Images come back as PIL images in their stored mode
    (unless ``decode()`` made them something else), videos as their files' bytes (or the clip
    ``decode(video=...)`` made of them), arrays with their dtype and shape, tensors
    as tensors; lists and tuples inside a target come back as lists; the sound
    ``decode(video=VideoClip(audio=...))`` adds is left out (it is in the sample). DecodeError
    where the sample's fields follow none of the rules."""
    if not isinstance(sample, Mapping):  # a tuple after to_tuple, or a batch, raised AttributeError
        raise TypeError(f"restore takes a sample as the dataset gives it, a dict of fields (map(restore) before"
                        f" to_tuple and batched), got {type(sample).__name__}")
    where = f"sample {sample.get('__key__')!r} of {sample.get('__shard__')}"
    names = [name for name in sample if not name.startswith("__") and not _made_by_decode(name)]
    try:
        kind = rule.kind(names)
    except ValueError as exc:
        raise DecodeError(f"{where} cannot be restored: {exc}", key=sample.get("__key__")) from None
    if kind == "pair":
        return _pair(sample, names, where)
    stems: dict[str, dict[FieldName, Any]] = {}
    for name in names:
        parsed = rule.parse(name)
        stems.setdefault(str(parsed.stem), {})[parsed] = sample[name]
    values = {stem: _value(members, f"{where}, field {stem!r}") for stem, members in stems.items()}
    if kind == "dict":
        return values
    missing = [i for i in range(len(values)) if str(i) not in values]
    if missing:
        raise DecodeError(f"{where} cannot be restored: its tuple has no field for position {missing[0]}",
                          key=sample.get("__key__"))
    return tuple(values[str(i)] for i in range(len(values)))


def _made_by_decode(name: str) -> bool:
    """A field ``decode()`` added beside the stored ones (a clip's sound: ``audio``,
    ``0.audio``), not part of the item uploaded."""
    return name.rsplit(".", 1)[-1] == "audio"


def _pair(sample: Mapping[str, Any], names: list[str], where: str) -> tuple[Any, Any]:
    images = [n for n in names if n in IMAGE_FIELDS or n in VIDEO_EXTENSIONS]
    targets = [n for n in names if n in rule.CLASSIC_TARGETS]
    if len(images) != 1 or len(targets) > 1 or len(images) + len(targets) != len(names):
        raise DecodeError(f"{where} cannot be restored: fields {sorted(names)} are not an image (or a video) and at"
                          " most one target", key=sample.get("__key__"))
    target = _leaf(targets[0], sample[targets[0]], where) if targets else None
    return _leaf(images[0], sample[images[0]], where), target


def _value(members: dict[FieldName, Any], where: str) -> Any:
    skeleton = next((n for n in members if not n.steps and n.ext == "json"), None)
    if skeleton is None:
        if len(members) != 1:
            raise DecodeError(f"{where} has {len(members)} members and no skeleton (.json)")
        ((name, value),) = members.items()
        return _leaf(name.ext, value, where)
    root = _leaf("json", members.pop(skeleton), where)
    for name, value in members.items():
        root = _fill(root, name.steps, _leaf(name.ext, value, where), f"{where}, member {'.'.join(name.steps)!r}")
    return root


def _fill(node: Any, steps: tuple[str, ...], value: Any, where: str) -> Any:
    """``node`` with the placeholder at ``steps`` replaced by ``value`` (converted by the placeholder)."""
    if not steps:
        frames = rule.frames_meta(node)
        if frames is not None:
            return _frames(value, frames, where)
        tv = rule.tv_tensor(node)
        if node == "torch" or tv is not None:
            tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
            return tensor if tv is None else _as_tv_tensor(tensor, *tv, where)
        if not rule.is_placeholder(node):
            raise DecodeError(f"{where} lands on {_brief(node)}, not a placeholder")
        return value
    step, rest = steps[0], steps[1:]
    if isinstance(node, list) and step.isdigit() and int(step) < len(node):
        node[int(step)] = _fill(node[int(step)], rest, value, where)
    elif isinstance(node, dict) and step in node:
        node[step] = _fill(node[step], rest, value, where)
    else:
        raise DecodeError(f"{where} has no place in the field's skeleton")
    return node


def _frames(value: Any, meta: dict[str, Any], where: str) -> Any:
    """Frames stored as a video, back as what they were (``meta``: their layout, channels,
    shape and type); a value ``decode()`` already made something else is left as it is."""
    if not isinstance(value, _RAW):
        return value
    shape, layout, channels, was = meta.get("shape"), meta.get("layout"), meta.get("channels"), meta.get("of")
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(n) is int and n > 0 for n in shape)
            and layout in ("THWC", "TCHW") and isinstance(was, str)
            and channels in (1, 3) and channels == shape[3 if layout == "THWC" else 1]):
        raise DecodeError(f"{where}: frames whose record {str(meta)[:80]} is not valid")
    count, height, width = (shape[0], shape[1], shape[2]) if layout == "THWC" else (shape[0], shape[2], shape[3])
    try:
        pixels = decode_frames(bytes(value), count, height, width)
    except ValueError as exc:
        raise DecodeError(f"{where}: frames stored as a video that does not decode as stored ({exc})") from None
    frames = np.ascontiguousarray(pixels[:, :height, :width, :channels])
    if layout == "TCHW":
        frames = np.ascontiguousarray(frames.transpose(0, 3, 1, 2))
    if was == "numpy":
        return frames
    tensor = torch.from_numpy(frames)
    tv = rule.tv_tensor(was)
    return tensor if tv is None else _as_tv_tensor(tensor, *tv, where)


@functools.cache
def tv_tensors() -> Any:
    """torchvision's ``tv_tensors`` module, None where torchvision cannot be imported."""
    try:
        from torchvision import tv_tensors as module
    except Exception:  # not installed, or a build that does not import beside this torch
        return None
    return module


_warned: list[str] = []


def _as_tv_tensor(tensor: torch.Tensor, kind: str, meta: dict[str, Any], where: str) -> torch.Tensor:
    """``tensor`` as the tv_tensor it was uploaded as; a plain tensor (with one warning)
    where torchvision cannot be imported."""
    module = tv_tensors()
    if module is None:
        if not _warned:
            _warned.append(kind)
            warnings.warn(f"{where} was a torchvision {kind} ({meta}); torchvision cannot be imported here, so it"
                          " and every tv_tensor after it come back as plain tensors", RuntimeWarning, stacklevel=2)
        return tensor
    kwargs: dict[str, Any] = {}
    if "format" in meta:
        kwargs["format"] = meta["format"]
    if "canvas_size" in meta:
        kwargs["canvas_size"] = tuple(meta["canvas_size"]) if isinstance(meta["canvas_size"], list) else None
    try:
        if "clamping_mode" in meta:
            try:
                return getattr(module, kind)(tensor, **kwargs, clamping_mode=meta["clamping_mode"])
            except TypeError:  # a torchvision before clamping modes
                pass
        return getattr(module, kind)(tensor, **kwargs)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
        raise DecodeError(f"{where}: a {kind} whose metadata {meta} torchvision refuses ({exc})") from None


def _brief(node: Any) -> str:
    return f"a {type(node).__name__}" if isinstance(node, (list, dict)) else repr(node)[:40]


def _leaf(ext: str, value: Any, where: str) -> Any:
    """One member's value: decoded from its bytes by its extension, or as ``decode()`` left it."""
    if not isinstance(value, _RAW) or ext == "bin":
        return bytes(value) if isinstance(value, _RAW) else value
    data = bytes(value)
    try:
        if ext in IMAGE_FIELDS:
            image = Image.open(io.BytesIO(data))
            image.load()
            return image
        if ext == "cls":
            return int(data)
        if ext == "txt":
            return data.decode("utf-8")
        if ext == "json":
            return json.loads(data)
        if ext == "npy":
            return load_npy(data)
    except (UnidentifiedImageError, OSError, ValueError, EOFError, RecursionError) as exc:
        raise DecodeError(f"{where}: a {ext} member that does not decode ({type(exc).__name__})") from None
    return data
