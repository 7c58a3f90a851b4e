"""What an upload records of its items so that running it again over other data, with the
same length and settings, is told from resuming or repeating it.

The fingerprint hashes the content of up to ``SAMPLES`` items spread evenly over the
dataset's indices, as ``ds[i]`` returns them: an image's mode, size and pixels (not an
encoder's output, which another Pillow may write otherwise), a file's bytes (for a path),
arrays' and tensors' dtype, shape and values, and every other value by its type and content.
Another dataset of the same length differs in practically every item; a change to a few
items is seen only where one of them is sampled (1% of the items changed: 72% of the time).
So every sample's index also records its item's digest (``item_digest``), the same content
hashed as the upload read it, and what a read restores beside pixels and values (a palette,
transparency, an ICC profile, a comment, a tv_tensor's metadata), which a later run compares
item by item (``matches``: a digest recorded before those were hashed matches without them).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from PIL import Image

from remote_loader.checks import one_line
from remote_loader.errors import UploadError
from remote_loader.format.index import DIGEST_SIZE
from remote_loader.upload.encode import tv_placeholder

SAMPLES = 128
_DEEPEST = 64
KEPT_INFO = ("transparency", "icc_profile", "comment")
"""The entries of a PIL image's ``info`` that the formats an upload writes store (PNG and TIFF
an ICC profile, PNG transparency, JPEG a comment) and a read gives back."""


def indices(num: int) -> list[int]:
    """The source indices whose items make the fingerprint of a dataset of ``num`` items."""
    return sorted({int(i) for i in np.linspace(0, num - 1, min(num, SAMPLES)).round()}) if SAMPLES else []


def items(read: Any, encodes: Any, num: int) -> list[str | None]:
    """The fingerprint of a dataset of ``num`` items: a digest per item of ``indices(num)``,
    each read by ``read(index)``, or None for one that cannot be read or encoded
    (``encodes(item, index)`` raising UploadError), which a later run may have fixed."""
    out: list[str | None] = []
    for index in indices(num):
        try:
            item = read(index)
            encodes(item, index)
        except UploadError:
            out.append(None)
            continue
        digest = hashlib.sha256()
        _feed(digest, item, 0)
        out.append(digest.hexdigest()[:16])
    return out


def first_difference(there: Any, here: list[str | None], num: int) -> int | None:
    """The first source index whose item differs between two fingerprints of a dataset of
    ``num`` items (an item that could not be encoded in either matches any); -1 where
    ``there`` is no fingerprint; None where they agree."""
    if not isinstance(there, list) or len(there) != len(here):
        return -1
    for index, a, b in zip(indices(num), there, here, strict=True):
        if a is not None and b is not None and a != b:
            return index
    return None


def item_digest(item: Any, files: Callable[[Image.Image], tuple[str, bytes] | None], index: int,
                beside: bool = True) -> bytes:
    """The digest of ``ds[index]`` as a shard's index records it (``DIGEST_SIZE`` bytes): its
    content as the fingerprint hashes it, but an image stored as its file's bytes (``files``
    of it: ``Originals.match``) by those bytes, so an image handed over undecoded is never
    decoded for it, and with what a read restores beside pixels and values (a palette, a
    tv_tensor's metadata). ``beside=False``: without those, as uploads recorded digests
    before (``matches``). UploadError where the item's content cannot be read (a truncated file)."""
    digest = hashlib.sha256()
    try:
        _feed(digest, item, 0, files, beside)
    except (OSError, ValueError, SyntaxError) as exc:  # what Pillow raises for a file it cannot decode
        raise UploadError(f"sample {index}: its content cannot be read ({type(exc).__name__}: {one_line(exc)})",
                          index=index) from None
    return digest.digest()[:DIGEST_SIZE]


def matches(recorded: bytes | None, item: Any, files: Callable[[Image.Image], tuple[str, bytes] | None],
            index: int) -> bool:
    """Whether ``item`` has the digest a shard's index recorded for it: by this rule, or by
    the rule of uploads made before digests held what a read restores beside pixels and values
    (their items' palettes and metadata are then not told apart, as they were not before)."""
    return (item_digest(item, files, index) == recorded
            or item_digest(item, files, index, beside=False) == recorded)


def _feed(digest: Any, value: Any, depth: int, files: Callable[[Image.Image], Any] | None = None,
          beside: bool = False) -> None:
    """Add ``value``'s type and content to ``digest``. With ``files`` (an item's digest), an
    image is an image whatever class opened it, and one ``files`` finds a file for is that
    file: the same content gives the same digest, decoded or not."""
    if files is not None and isinstance(value, Image.Image):
        found = files(value)
        if found is not None:
            digest.update(b"file:" + found[0].encode() + hashlib.sha256(found[1]).digest())
            return
        digest.update(b"image:")
    else:  # the fingerprint's way, as uploads have recorded it
        digest.update(type(value).__name__.encode() + b":")
    if depth > _DEEPEST:
        return
    if isinstance(value, Image.Image):
        digest.update(f"{value.mode}{value.size}".encode())
        digest.update(value.tobytes())
        if beside:
            digest.update(_beside_pixels(value))
    elif isinstance(value, (str, os.PathLike)) and depth <= 1 and os.path.isfile(value):
        with open(value, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    elif isinstance(value, (bytes, bytearray, memoryview)):
        digest.update(hashlib.sha256(bytes(value)).digest())
    elif isinstance(value, np.ndarray) or (type(value).__module__.startswith("torch") and hasattr(value, "detach")):
        try:
            array = np.asarray(value.detach().cpu()) if hasattr(value, "detach") else value
        except (TypeError, RuntimeError):  # a dtype or layout NumPy does not hold (bfloat16, sparse)
            array = np.asarray(value.detach().cpu().to_dense().double())
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes() if array.dtype.kind != "O" else repr(array).encode())
        metadata = tv_placeholder(value) if beside and hasattr(value, "detach") else None
        if metadata is not None:  # a tv_tensor's format, canvas size...: a plain tensor's digest is as it was
            digest.update(metadata.encode())
    elif isinstance(value, Mapping):
        for key in value:
            _feed(digest, key, depth + 1, files, beside)
            _feed(digest, value[key], depth + 1, files, beside)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{len(value)}".encode())
        for item in value:
            _feed(digest, item, depth + 1, files, beside)
    elif value is None or isinstance(value, (bool, int, float, str, np.generic)):
        digest.update(repr(value).encode())
    # any other object: its type alone (its repr may hold an address)


def _beside_pixels(image: Image.Image) -> bytes:
    """What a read gives back of ``image`` beside its pixels: the palette of a P or PA image and
    the ``KEPT_INFO`` it holds; nothing for an image without them (its digest is as it was
    before they were hashed)."""
    out = b""
    if image.mode in ("P", "PA") and image.palette is not None:
        out += b"palette:" + image.palette.mode.encode() + bytes(image.getpalette(image.palette.mode) or [])
    for key in KEPT_INFO:
        if key in image.info:
            out += f"{key}:{image.info[key]!r}".encode()
    return out
