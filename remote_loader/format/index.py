"""The per-shard index: for each sample its key and, per field, (offset, size, crc32).

It is stored as the last tar member of its shard, as one msgpack map of columnar arrays, so
a reader decodes 10k samples' metadata with a few ``numpy.frombuffer`` calls and slices
sample bytes without ever parsing a tar header.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from remote_loader.errors import CorruptShard, IndexOutOfBounds, UnsupportedVersion

INDEX_VERSION = 1
INDEX_MEMBER = "__index__"
"""Name of the index member; WebDataset's readers skip ``__*__`` members."""

BLOCK = 512
"""Size of a tar block: a member's data never starts before the first header."""

MAX_FIELDS = 64

MAX_FIELD_NAME = 64
"""A field name's length at most."""

_FIELD = re.compile(rf"^[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_FIELD_NAME - 1}}}$")
_OFFSETS = np.dtype("<u8")
_CRCS = np.dtype("<u4")

DIGEST_SIZE = 8
"""Bytes of a sample's digest: what the upload read to make the sample, hashed (see
``remote_loader.upload.fingerprint.item_digest``), so that a later run can tell the same items."""


def check_field_name(field: str) -> str:
    """Return ``field`` if it is a valid field name (``jpg``, ``cls``, ``seg.png``), else raise."""
    if not isinstance(field, str) or not _FIELD.match(field) or field.startswith("__"):
        raise ValueError(f"invalid field name {field!r}: use letters, digits, '_', '.', '-'")
    return field


MAX_KEY = 255
_BAD_PART = re.compile(r"(?m)(^|/)(\.\.)?(/|$)")  # an empty path component, or ".."
KEY_RULE = ("a key is printable text of at most 255 characters; split at '/', no part is empty or '..'"
            " (so no leading '/')")


def bad_key(keys: Sequence[str]) -> str | None:
    """The first of ``keys`` a reader refuses, or None: keys are what uploads write (letters,
    digits, ``_`` and ``-``) or a tar member's path less its extension, and may become file
    names downstream, so none climbs out of a folder, starts at the root or holds control
    characters (see ``KEY_RULE``). Checked on the joined text: one pass in C, not one per key."""
    if ("".join(keys).isprintable() and not _BAD_PART.search("\n".join(keys))  # no key holds a newline here
            and (not keys or max(map(len, keys)) <= MAX_KEY)):
        return None
    for key in keys:
        if not key.isprintable() or len(key) > MAX_KEY or _BAD_PART.search(key):
            return key
    return None  # unreachable: the joined text held a bad key


def _check_ranges(offsets: np.ndarray, sizes: np.ndarray, keys: Sequence[str], fields: Sequence[str],
                  name: str | None) -> None:
    """Refuse two members whose bytes overlap or start at one offset: in a tar every member's
    data has bytes of its own, so an index pointing two fields at the same bytes was rewritten."""
    rows, columns = np.nonzero(offsets)
    starts = offsets[rows, columns]
    order = np.arange(len(starts)) if bool(np.all(starts[1:] > starts[:-1])) else np.argsort(starts, kind="stable")
    starts, ends = starts[order], starts[order] + sizes[rows, columns][order]
    clash = (starts[1:] < ends[:-1]) | (starts[1:] == starts[:-1])
    if clash.any():
        k = int(np.argmax(clash))
        (i, a), (j, b) = [(int(rows[order[m]]), int(columns[order[m]])) for m in (k, k + 1)]
        raise IndexOutOfBounds(f"index of {name}: sample {keys[j]!r} field {fields[b]!r} at {int(starts[k + 1])}"
                               f" overlaps sample {keys[i]!r} field {fields[a]!r} at {int(starts[k])}+"
                               f"{int(ends[k] - starts[k])}: two members cannot share bytes", name=name)


def unpack(data: bytes | memoryview, *, what: str, name: str | None) -> Any:
    """Decode msgpack ``data`` or raise CorruptShard naming ``what`` and the object."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises ValueError, TypeError and its own types alike
        raise CorruptShard(
            f"{what} of {name or '<unnamed>'} is not valid msgpack ({type(exc).__name__})", name=name
        ) from None


def require(mapping: Any, key: str, kind: type | tuple[type, ...], *, what: str, name: str | None) -> Any:
    """Return ``mapping[key]`` if present and of type ``kind``, else raise CorruptShard."""
    if not isinstance(mapping, dict):
        raise CorruptShard(f"{what} of {name or '<unnamed>'} is not a map", name=name)
    value = mapping.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise CorruptShard(f"{what} of {name or '<unnamed>'}: field {key!r} is missing or malformed", name=name)
    return value


def check_version(version: int, *, known: int, what: str, name: str | None) -> None:
    """Refuse a format version this reader does not know."""
    if version < 1 or version > known:
        raise UnsupportedVersion(
            f"{what} of {name or '<unnamed>'} has format version {version}; this reader knows 1..{known}"
            " (upgrade remote-loader)",
            name=name,
        )


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """Where each sample's fields lie inside one shard.

    Attributes:
        keys: Sample keys, in shard order.
        fields: Field names; column ``j`` of the arrays describes ``fields[j]``.
        offsets: ``(n, len(fields))`` uint64 offsets of member data; 0 marks an absent field.
        sizes: ``(n, len(fields))`` uint64 sizes of member data.
        crcs: ``(n, len(fields))`` uint32 crc32 of member data.
        digests: ``n * DIGEST_SIZE`` bytes, each sample's digest of the item it was made from,
            in shard order; None in shards written before uploads recorded them, or by other
            tools.
    """

    keys: Sequence[str]
    fields: tuple[str, ...]
    offsets: np.ndarray
    sizes: np.ndarray
    crcs: np.ndarray
    digests: bytes | None = None

    def digest(self, i: int) -> bytes | None:
        """Sample ``i``'s digest, or None where the index records none."""
        return None if self.digests is None else self.digests[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]

    def __len__(self) -> int:
        return len(self.keys)

    def members(self, i: int) -> list[tuple[str, int, int, int]]:
        """Return ``(field, offset, size, crc32)`` for each field present in sample ``i``."""
        offsets, sizes, crcs = self.offsets[i], self.sizes[i], self.crcs[i]
        return [
            (field, int(offsets[j]), int(sizes[j]), int(crcs[j])) for j, field in enumerate(self.fields) if offsets[j]
        ]

    def byte_range(self, i: int) -> tuple[int, int]:
        """Return ``(start, end)`` covering every member of sample ``i``'s data."""
        present = self.offsets[i] != 0
        starts = self.offsets[i][present]
        return int(starts.min()), int((starts + self.sizes[i][present]).max())

    def extent(self, first: int = 0, stop: int | None = None) -> int:
        """Return the offset just past the last data byte of samples ``[first, stop)``."""
        ends = self.offsets[first:stop] + self.sizes[first:stop]
        return int(ends.max()) if ends.size else 0

    def start(self, first: int = 0, stop: int | None = None) -> int:
        """Return the offset of the first data byte of samples ``[first, stop)``."""
        offsets = self.offsets[first:stop]
        present = offsets[offsets != 0]
        return int(present.min()) if present.size else 0

    def cuts(self, first: int, stop: int, limit: int) -> list[int]:
        """Boundaries ``[first, ..., stop]`` cutting samples ``[first, stop)`` into runs of
        consecutive samples whose bytes, from a run's first data byte to its last, are at most
        ``limit``; a sample larger than ``limit`` is a run of its own. Exact for members
        written in sample order (ours, WebDataset's); for any other layout no run is larger."""
        if first >= stop:
            return [first]
        offsets, sizes = self.offsets[first:stop], self.sizes[first:stop]
        starts = np.where(offsets != 0, offsets, np.iinfo(np.uint64).max).min(axis=1)
        reach = np.maximum.accumulate((offsets + sizes).max(axis=1))  # the furthest end so far
        lowest = np.minimum.accumulate(starts[::-1])[::-1]  # the lowest start from each sample on
        bounds, a, n = [first], 0, stop - first
        while a < n:
            b = int(np.searchsorted(reach, lowest[a] + np.uint64(limit), side="right"))
            a = min(max(b, a + 1), n)
            bounds.append(first + a)
        return bounds

    def encode(self) -> bytes:
        """Serialise to the msgpack bytes stored as the shard's index member."""
        raw = {
            "version": INDEX_VERSION,
            "fields": list(self.fields),
            "keys": list(self.keys),
            "offsets": self.offsets.astype(_OFFSETS, copy=False).tobytes(),
            "sizes": self.sizes.astype(_OFFSETS, copy=False).tobytes(),
            "crcs": self.crcs.astype(_CRCS, copy=False).tobytes(),
        }
        if self.digests is not None:
            raw["digests"] = bytes(self.digests)
        return msgpack.packb(raw, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes | memoryview, *, data_end: int, name: str | None = None) -> ShardIndex:
        """Parse and validate index bytes.

        Args:
            data: The index member's bytes.
            data_end: Offset where the index member's header starts: no sample byte lies at or
                after it.
            name: The shard's object name, for messages.

        Raises:
            UnsupportedVersion: The index is from an unknown format version.
            CorruptShard: The bytes are not a well-formed index.
            IndexOutOfBounds: An offset or size points outside the shard's sample data.
        """
        what = "index"
        raw = unpack(data, what=what, name=name)
        check_version(require(raw, "version", int, what=what, name=name), known=INDEX_VERSION, what=what, name=name)
        fields = require(raw, "fields", list, what=what, name=name)
        keys = require(raw, "keys", list, what=what, name=name)
        if not fields or len(fields) > MAX_FIELDS or len(set(fields)) != len(fields):
            raise CorruptShard(f"index of {name}: field list is empty, too long or repeated", name=name)
        if not all(isinstance(f, str) for f in fields) or not all(isinstance(k, str) for k in keys):
            raise CorruptShard(f"index of {name}: field names and keys must be strings", name=name)
        for field in fields:
            if not _FIELD.match(field) or field.startswith("__"):
                raise CorruptShard(f"index of {name}: invalid field name {field!r}", name=name)
        key = bad_key(keys)
        if key is not None:
            raise CorruptShard(f"index of {name}: invalid sample key {key!r}: {KEY_RULE}", name=name)
        n, width = len(keys), len(fields)
        arrays: list[Any] = []
        for column, dtype in (("offsets", _OFFSETS), ("sizes", _OFFSETS), ("crcs", _CRCS)):
            buf = require(raw, column, bytes, what=what, name=name)
            if len(buf) != n * width * dtype.itemsize:
                raise CorruptShard(
                    f"index of {name}: {column} holds {len(buf)} bytes, expected {n * width * dtype.itemsize}",
                    name=name,
                )
            arrays.append(np.frombuffer(buf, dtype=dtype).reshape(n, width))
        offsets, sizes, crcs = arrays
        present = offsets != 0
        if n and not present.any(axis=1).all():
            bad = int(np.flatnonzero(~present.any(axis=1))[0])
            raise CorruptShard(f"index of {name}: sample {keys[bad]!r} has no field", name=name)
        # Compare in a form that cannot overflow: size <= data_end - offset.
        outside = present & (
            (offsets < BLOCK) | (offsets > data_end) | (sizes > data_end - np.minimum(offsets, data_end))
        )
        if outside.any():
            i, j = (int(v) for v in np.argwhere(outside)[0])
            raise IndexOutOfBounds(
                f"index of {name}: sample {keys[i]!r} field {fields[j]!r} lies at "
                f"{int(offsets[i, j])}+{int(sizes[i, j])}, outside the shard's data (0..{data_end})",
                name=name,
            )
        _check_ranges(offsets, sizes, keys, fields, name)
        digests = raw.get("digests")
        if digests is not None and (not isinstance(digests, bytes) or len(digests) != n * DIGEST_SIZE):
            raise CorruptShard(f"index of {name}: digests are not {n * DIGEST_SIZE} bytes", name=name)
        return cls(keys=keys, fields=tuple(fields), offsets=offsets, sizes=sizes, crcs=crcs, digests=digests)
