"""The field rule: how a sample's values are named as shard fields, and read back by name.

A sample is a classification pair, a tuple, or a dict of named fields (docs/FORMAT.md,
"Samples"). A pair ``(image, target)`` whose target is None, an int, a str or a flat dict of
scalars keeps WebDataset's field names (``jpg``, ``cls``, ``txt``, ``json``). Any other sample
is *structured*: each top-level value ``v`` has a *stem* (its position in the tuple, or its
key in the dict) and is stored as

- ``<stem>.<ext>`` when it is one member (an image, an int ``cls``, a str ``txt``, a numpy
  array ``npy``, bytes ``bin``, or a JSON value ``json``);
- ``<stem>.json`` (its *skeleton*: lists and dicts with scalars, and at each array, tensor,
  image or bytes a placeholder string naming its type) plus one member
  ``<stem>.<step>...<step>.<ext>`` per placeholder, its path from the value's root (list
  positions in decimal, dict keys as they are) ahead of its extension.

Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from remote_loader.format.video import VIDEO_EXTENSIONS

PLACEHOLDERS = {"numpy": "npy", "torch": "npy", "image": None, "bytes": "bin"}
"""Skeleton placeholders and the extension of the member each stands for (an image's is its format)."""

TV_TENSORS = ("Image", "Video", "Mask", "BoundingBoxes", "KeyPoints")
"""torchvision's tv_tensors, stored as ``npy`` members under a placeholder that names the
class and its metadata: ``tv_tensors.BoundingBoxes{"format": "XYXY", "canvas_size": [48, 64]}``."""

TV_PREFIX = "tv_tensors."


def tv_placeholder(kind: str, meta: dict[str, object]) -> str:
    """The skeleton placeholder of a tv_tensor of class ``kind`` with ``meta`` (JSON values)."""
    return TV_PREFIX + kind + (json.dumps(meta, sort_keys=True, separators=(",", ":")) if meta else "")


def tv_tensor(node: object) -> tuple[str, dict[str, object]] | None:
    """``(class, metadata)`` of a tv_tensor placeholder, None for anything else."""
    if not isinstance(node, str) or not node.startswith(TV_PREFIX):
        return None
    kind, brace, rest = node[len(TV_PREFIX):].partition("{")
    if kind not in TV_TENSORS:
        return None
    try:
        meta = json.loads(brace + rest) if brace else {}
    except ValueError:
        return None
    return (kind, meta) if isinstance(meta, dict) else None


FRAMES_PREFIX = "frames"
"""The placeholder of frames stored as a video (``upload_cv_dataset(frames_as_video=...)``):
``frames{"layout": "THWC", "channels": 3, "shape": [...], "of": "numpy"}``, the member an
``mp4``; ``of`` is ``numpy``, ``torch`` or a tv_tensor's placeholder."""


def frames_placeholder(meta: dict[str, object]) -> str:
    """The skeleton placeholder of frames stored as a video, with what they were (``meta``)."""
    return FRAMES_PREFIX + json.dumps(meta, sort_keys=True, separators=(",", ":"))


def frames_meta(node: object) -> dict[str, object] | None:
    """What frames stored as a video were (their placeholder's ``meta``), None for anything else."""
    if not isinstance(node, str) or not node.startswith(FRAMES_PREFIX + "{"):
        return None
    try:
        meta = json.loads(node[len(FRAMES_PREFIX):])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def is_placeholder(node: object) -> bool:
    return (isinstance(node, str) and node in PLACEHOLDERS) or tv_tensor(node) is not None or \
        frames_meta(node) is not None


def placeholders(skeleton: object, steps: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Every placeholder string of a skeleton by its path (list positions in decimal)."""
    found: dict[tuple[str, ...], str] = {}
    stack = [(skeleton, steps)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, (*at, str(k))) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*at, str(i))) for i, v in enumerate(node))
        elif is_placeholder(node):
            found[at] = str(node)
    return found

STEP = re.compile(r"^[A-Za-z0-9_-]+$")
"""A stem or a path step: a dict key or a list position (no '.', which separates steps)."""

NAMED = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
"""A dict sample's key: starts with a letter or '_', so that a reader tells it from a tuple's position."""

CLASSIC_TARGETS = ("cls", "txt", "json")

INPUT_MODES = frozenset({"RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV"})
"""Image modes of a structured sample stored in the upload's ``image_format`` (and decoded to
RGB); any other (masks, depth: ``1``, ``L``, ``LA``, ``P``, ``I;16``, ``I``, ``F``) is stored
lossless, PNG or TIFF (``I``, ``F``), and read back in its mode with its palette."""

DEEP_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})
"""Image modes of more than 8 bits a value, which 8-bit RGB would clip: decoded in their own
mode wherever they stand, an input image too."""


@dataclass(frozen=True)
class FieldName:
    """A field's parts: ``stem`` (None for a classic field), the path ``steps`` inside the
    stem's value, and the extension ``ext``."""

    stem: str | None
    steps: tuple[str, ...]
    ext: str


def parse(field: str) -> FieldName:
    """``"1.objects.0.bbox.npy"`` -> stem ``"1"``, steps ``("objects", "0", "bbox")``, ext ``"npy"``."""
    parts = field.split(".")
    if len(parts) == 1:
        return FieldName(None, (), parts[0])
    return FieldName(parts[0], tuple(parts[1:-1]), parts[-1])


def render(stem: str, steps: tuple[str, ...], ext: str) -> str:
    return ".".join((stem, *steps, ext))


def kind(fields: list[str]) -> str:
    """``"pair"``, ``"tuple"`` or ``"dict"``: what a sample of these fields was uploaded as;
    ValueError where they follow none of the rules."""
    names = [parse(f) for f in fields if not f.startswith("__")]
    stems = {n.stem for n in names}
    if stems == {None}:
        return "pair"
    if None in stems:
        raise ValueError(f"fields {sorted(fields)} mix classic names and stems")
    if all(s is not None and s.isdigit() for s in stems):
        return "tuple"
    if all(s is not None and NAMED.match(s) for s in stems):
        return "dict"
    raise ValueError(f"fields {sorted(fields)} mix tuple positions and dict keys")


_TYPES = {"cls": "int", "txt": "str", "json": "JSON", "npy": "array", "bin": "bytes"}
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tiff", "ppm", "pgm"})


def describe(field: str) -> str:
    """A field's type in words: ``image``, ``video``, ``int``, ``str``, ``JSON``, ``array``, ``bytes``;
    a member inside a stem's skeleton says so (``array in 1``)."""
    name = parse(field)
    if name.ext in IMAGE_EXTENSIONS:
        kind = "image"
    elif name.ext in VIDEO_EXTENSIONS:
        kind = "video"
    else:
        kind = _TYPES.get(name.ext, name.ext)
    return f"{kind} in {name.stem}" if name.steps else kind
