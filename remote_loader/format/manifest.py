"""The manifest: one msgpack object, written last, that lists every shard of a dataset.

Its size grows with the number of shards, not of samples: one GET of it plus one ranged
GET of a shard's index locate any sample. Version 2 stores the per-shard numbers as
little-endian column arrays that load with ``numpy.frombuffer``, so a manifest of a million
shards opens without building a Python object per shard; version 1 (one msgpack row per
shard) is still read.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgpack
import numpy as np

from remote_loader.errors import CorruptShard, IndexOutOfBounds
from remote_loader.format.checksum import crc32
from remote_loader.format.index import check_version, require, unpack
from remote_loader.format.shard import ShardSummary

MANIFEST_VERSION = 2
MANIFEST_NAME = "manifest.msgpack"
UPLOAD_STATE = "_upload/state.msgpack"
"""An unfinished upload's state, beside its shards until the manifest is written."""
FORMAT_NAME = "remote_loader"

_SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_./-]*$")
_ENTRY_FIELDS = ("name", "samples", "size", "index_offset", "index_size", "index_crc", "crc32", "index_name")
_COLUMNS = ("samples", "size", "index_offset", "index_size", "index_crc", "crc32")
_CRC_COLUMNS = ("index_crc", "crc32")
_DTYPES: dict[str, np.dtype[Any]] = {"<u1": np.dtype("<u1"), "<u2": np.dtype("<u2"), "<u4": np.dtype("<u4"), "<u8": np.dtype("<u8")}
_LIMIT = 2**63  # every size, offset and the sum of sample counts fit a signed 64-bit integer
_MAX_SKIPPED_LISTED = 10_000


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest lists it.

    Attributes:
        name: Object name relative to the dataset's prefix (``shard-000000-000.tar``).
        samples: Number of samples.
        size: Object size in bytes.
        index_offset: Offset of the index member's data.
        index_size: Size of the index member's data.
        index_crc: crc32 of the index member's data.
        crc32: crc32 of the whole object.
        index_name: Object holding the index when it is not the shard's last member (an
            existing WebDataset tar indexed in place); empty for our own shards.
    """

    name: str
    samples: int
    size: int
    index_offset: int
    index_size: int
    index_crc: int
    crc32: int
    index_name: str = ""

    @classmethod
    def from_summary(cls, name: str, summary: ShardSummary) -> ShardEntry:
        """Build the entry of a shard just written under ``name``."""
        return cls(
            name=name,
            samples=summary.samples,
            size=summary.size,
            index_offset=summary.index_offset,
            index_size=summary.index_size,
            index_crc=summary.index_crc,
            crc32=summary.crc32,
        )

    @property
    def data_end(self) -> int:
        """Every sample byte lies before this offset: the index member's header, or the object's end."""
        return self.size if self.index_name else self.index_offset - 512

    def as_row(self) -> list[Any]:
        return [getattr(self, f) for f in _ENTRY_FIELDS]


# ---------------------------------------------------------------------------- names


class _Names:
    """The shards' object names, rendered one at a time on demand."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:
        raise NotImplementedError

    def encode(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class _TemplateNames(_Names):
    """``parts[0] + number(0) + parts[1] + ... + parts[k]``, each number zero-padded to its width."""

    parts: tuple[str, ...]
    widths: tuple[int, ...]
    numbers: tuple[np.ndarray, ...]
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> str:
        out = [self.parts[0]]
        for numbers, width, part in zip(self.numbers, self.widths, self.parts[1:]):
            out.append(str(int(numbers[i])).zfill(width))
            out.append(part)
        return "".join(out)

    def encode(self) -> dict[str, Any]:
        return {"parts": list(self.parts), "widths": list(self.widths), "numbers": [_column(a) for a in self.numbers]}

    @classmethod
    def infer(cls, names: Sequence[str]) -> _TemplateNames | None:
        """The template all ``names`` follow with their numbers in strictly increasing order, if any."""
        if not names:
            return None
        tokens = [re.split(r"(\d+)", n) for n in names]
        first = tokens[0]
        if any(len(t) != len(first) or t[0::2] != first[0::2] for t in tokens):
            return None
        parts, widths, numbers = [first[0]], [], []
        for j in range(1, len(first), 2):
            runs = [t[j] for t in tokens]
            if all(r == runs[0] for r in runs):
                parts[-1] += runs[0] + first[j + 1]
                continue
            width = min(len(r) for r in runs)
            values = [int(r) for r in runs]
            if any(str(v).zfill(width) != r for v, r in zip(values, runs)) or max(values) >= 2**64:
                return None
            widths.append(width)
            numbers.append(np.array(values, dtype=np.uint64))
            parts.append(first[j + 1])
        template = cls(tuple(parts), tuple(widths), tuple(_narrow(a) for a in numbers), len(names))
        if not all(template.parts[1:-1]) or not _increasing(template.numbers):
            return None
        return template


@dataclass(frozen=True, eq=False)
class _BlobNames(_Names):
    """Every name's UTF-8 bytes in one blob; name ``i`` is ``blob[offsets[i]:offsets[i + 1]]``."""

    blob: bytes
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].decode()

    def encode(self) -> dict[str, Any]:
        return {"blob": self.blob, "offsets": _column(self.offsets)}

    @classmethod
    def of(cls, names: Sequence[str]) -> _BlobNames:
        encoded = [n.encode() for n in names]
        offsets = np.zeros(len(encoded) + 1, dtype=np.uint64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(b"".join(encoded), _narrow(offsets))


def _narrow(values: np.ndarray) -> np.ndarray:
    """The values in the narrowest little-endian unsigned type that holds them."""
    top = int(values.max()) if len(values) else 0
    for dtype in _DTYPES.values():
        if top < 1 << (8 * dtype.itemsize):
            return values.astype(dtype)
    raise ValueError(f"value {top} does not fit 64 bits")


def _column(values: np.ndarray) -> dict[str, Any]:
    return {"dtype": f"<u{values.dtype.itemsize}", "data": values.astype(_DTYPES[f"<u{values.dtype.itemsize}"]).tobytes()}


def _increasing(columns: Sequence[np.ndarray]) -> bool:
    """Whether the rows ``(columns[0][i], columns[1][i], ...)`` are strictly increasing."""
    if not columns or len(columns[0]) < 2:
        return True
    later = np.zeros(len(columns[0]) - 1, dtype=bool)
    for values in reversed(columns):
        a, b = values[:-1], values[1:]
        later = (b > a) | ((b == a) & later)
    return bool(later.all())


# ---------------------------------------------------------------------------- the shard table


class ShardTable(Sequence[ShardEntry]):
    """Every shard of a manifest as columns: ``table[i]`` builds shard ``i``'s ShardEntry on demand.

    ``samples``, ``size``, ``index_offset``, ``index_size``, ``index_crc`` and ``crc32`` are
    read-only numpy arrays (views of the manifest's bytes for version 2), so totals, the epoch
    split and lookups are array operations and a forked worker shares them with its parent.
    """

    def __init__(self, columns: Mapping[str, np.ndarray], names: _Names, index_names: _Names | None = None) -> None:
        self.columns = dict(columns)
        self.names = names
        self.index_names = index_names

    @classmethod
    def from_entries(cls, entries: Sequence[ShardEntry]) -> ShardTable:
        """Build the table of ``entries`` (what a writer has)."""
        columns = {c: _narrow(np.array([getattr(e, c) for e in entries], dtype=np.uint64)) for c in _COLUMNS}
        names = [e.name for e in entries]
        index_names = [e.index_name for e in entries]
        return cls(columns, _TemplateNames.infer(names) or _BlobNames.of(names),
                   _BlobNames.of(index_names) if any(index_names) else None)

    @classmethod
    def from_template(cls, columns: Mapping[str, np.ndarray], parts: Sequence[str], widths: Sequence[int],
                      numbers: Sequence[np.ndarray]) -> ShardTable:
        """A table whose names follow a template (see docs/FORMAT.md), built from arrays:
        ``parts[0] + numbers[0][i] zero-padded to widths[0] + parts[1] + ...``."""
        count = len(numbers[0]) if numbers else len(columns["samples"])
        return cls({c: _narrow(np.asarray(columns[c], dtype=np.uint64)) for c in _COLUMNS},
                   _TemplateNames(tuple(parts), tuple(widths), tuple(_narrow(np.asarray(a)) for a in numbers), count))

    @property
    def samples(self) -> np.ndarray:
        """Samples per shard."""
        return self.columns["samples"]

    @property
    def size(self) -> np.ndarray:
        """Object size per shard, in bytes."""
        return self.columns["size"]

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> ShardEntry: ...

    @overload
    def __getitem__(self, i: slice) -> list[ShardEntry]: ...

    def __getitem__(self, i: int | slice) -> ShardEntry | list[ShardEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {i} out of range: the manifest lists {n}")
        i %= n
        c = self.columns
        return ShardEntry(self.names[i], int(c["samples"][i]), int(c["size"][i]), int(c["index_offset"][i]),
                          int(c["index_size"][i]), int(c["index_crc"][i]), int(c["crc32"][i]),
                          self.index_names[i] if self.index_names else "")

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTable):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards)"


# ---------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class Manifest:
    """A dataset's table of contents.

    Attributes:
        shards: Every shard, in upload order: a ShardTable (a sequence of ShardEntry backed
            by arrays); a writer may pass any sequence of ShardEntry.
        fields: Field names present in the dataset (``cls``, ``jpg``...).
        params: The upload parameters (seed, limits, image format...).
        skipped: How many source samples were skipped by ``on_error="skip"``.
        skipped_indices: Their indices in the source dataset (the first 10,000).
        version: Format version to encode (1 or 2), or the version decoded.
    """

    shards: ShardTable
    fields: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    skipped: int = 0
    skipped_indices: tuple[int, ...] = ()
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.from_entries(tuple(self.shards)))

    @property
    def num_samples(self) -> int:
        """Total number of samples."""
        return int(self.shards.samples.sum(dtype=np.int64))

    @property
    def num_bytes(self) -> int:
        """Total bytes of all shards."""
        return int(self.shards.size.sum(dtype=np.uint64))

    def encode(self) -> bytes:
        """Serialise: a msgpack map followed by the crc32 of those bytes (4 bytes, little-endian)."""
        body: dict[str, Any] = {"format": FORMAT_NAME, "version": self.version, "fields": list(self.fields)}
        if self.version == 1:
            body["columns"] = list(_ENTRY_FIELDS)
            body["shards"] = [s.as_row() for s in self.shards]
        else:
            body["shards"] = len(self.shards)
            body["columns"] = {c: _column(self.shards.columns[c]) for c in _COLUMNS}
            body["names"] = self.shards.names.encode()
            if self.shards.index_names is not None:
                body["index_names"] = self.shards.index_names.encode()
        body.update(params=dict(self.params), skipped=self.skipped,
                    skipped_indices=list(self.skipped_indices[:_MAX_SKIPPED_LISTED]))
        data = msgpack.packb(body, use_bin_type=True)
        return data + struct.pack("<I", crc32(data))

    @classmethod
    def decode(cls, data: bytes | memoryview, *, name: str | None = None, trailer_checked: bool = False) -> Manifest:
        """Parse and validate manifest bytes (version 1 or 2); ``trailer_checked`` skips the
        crc32 check that the caller has just made.

        Raises:
            UnsupportedVersion: Written by a newer format version.
            CorruptShard: Truncated or malformed.
            IndexOutOfBounds: A shard entry's index lies outside its object.
        """
        what = "manifest"
        if len(data) < 5 or not trailer_checked and struct.unpack("<I", data[-4:])[0] != crc32(data[:-4]):
            raise CorruptShard(f"manifest {name} is truncated or fails its crc32 check", name=name)
        raw = unpack(data[:-4], what=what, name=name)
        if require(raw, "format", str, what=what, name=name) != FORMAT_NAME:
            raise CorruptShard(f"{name} is not a {FORMAT_NAME} manifest", name=name)
        version = require(raw, "version", int, what=what, name=name)
        check_version(version, known=MANIFEST_VERSION, what=what, name=name)
        fields = require(raw, "fields", list, what=what, name=name)
        params = require(raw, "params", dict, what=what, name=name)
        skipped = require(raw, "skipped", int, what=what, name=name)
        skipped_indices = require(raw, "skipped_indices", list, what=what, name=name)
        if not all(isinstance(f, str) for f in fields) or not all(isinstance(i, int) for i in skipped_indices):
            raise CorruptShard(f"manifest {name}: fields or skipped indices malformed", name=name)
        shards = _decode_rows(raw, name) if version == 1 else _decode_columns(raw, name)
        return cls(shards=shards, fields=tuple(fields), params=params, skipped=skipped,
                   skipped_indices=tuple(skipped_indices), version=version)


def _bad(name: str | None, what: str) -> CorruptShard:
    return CorruptShard(f"manifest {name}: {what}", name=name)


def _decode_rows(raw: dict[str, Any], name: str | None) -> ShardTable:
    """Version 1: one msgpack row per shard."""
    columns = require(raw, "columns", list, what="manifest", name=name)
    rows = require(raw, "shards", list, what="manifest", name=name)
    if columns != list(_ENTRY_FIELDS):
        raise _bad(name, f"unexpected shard columns {columns!r}")
    for position, row in enumerate(rows):
        if (
            not isinstance(row, list)
            or len(row) != len(_ENTRY_FIELDS)
            or not isinstance(row[0], str)
            or not isinstance(row[7], str)
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _LIMIT for v in row[1:7])
        ):
            raise _bad(name, f"shard entry {position} is malformed")
    entries = [ShardEntry(*row) for row in rows]
    for entry in entries:
        _check_name(entry.name, name)
        if entry.index_name:
            _check_name(entry.index_name, name)
    if len({e.name for e in entries}) != len(entries):
        raise _bad(name, "a shard is listed twice")
    table = ShardTable.from_entries(entries)
    _check_table(table, name)
    return table


def _decode_columns(raw: dict[str, Any], name: str | None) -> ShardTable:
    """Version 2: column arrays, checked for length before use and for values as arrays."""
    count = require(raw, "shards", int, what="manifest", name=name)
    if count < 0:
        raise _bad(name, f"negative shard count {count}")
    given = require(raw, "columns", dict, what="manifest", name=name)
    if sorted(given) != sorted(_COLUMNS):
        raise _bad(name, f"columns are {sorted(given)!r}, expected {sorted(_COLUMNS)!r}")
    columns = {c: _array(given[c], count, f"column {c!r}", name) for c in _COLUMNS}
    for c in _CRC_COLUMNS:
        if columns[c].dtype.itemsize > 4 and len(columns[c]) and int(columns[c].max()) >= 2**32:
            raise _bad(name, f"column {c!r} holds a value over 32 bits")
    names = _decode_names(require(raw, "names", dict, what="manifest", name=name), count, name, allow_empty=False)
    index_names = None
    if "index_names" in raw:
        index_names = _decode_names(require(raw, "index_names", dict, what="manifest", name=name), count, name,
                                    allow_empty=True)
    table = ShardTable(columns, names, index_names)
    _check_table(table, name)
    return table


def _array(column: Any, count: int, what: str, name: str | None) -> np.ndarray:
    """A column's array, after checking its dtype and that its bytes hold exactly ``count`` values."""
    if not isinstance(column, dict) or column.get("dtype") not in _DTYPES or not isinstance(column.get("data"), bytes):
        raise _bad(name, f"{what} is not a map of a dtype ({', '.join(_DTYPES)}) and bytes")
    dtype = _DTYPES[column["dtype"]]
    if len(column["data"]) != count * dtype.itemsize:
        raise _bad(name, f"{what} holds {len(column['data'])} bytes; {count} values of {dtype.str} need {count * dtype.itemsize}")
    return np.frombuffer(column["data"], dtype=dtype)


def _decode_names(raw: dict[str, Any], count: int, name: str | None, *, allow_empty: bool) -> _Names:
    if "blob" in raw:
        blob = raw["blob"]
        if not isinstance(blob, bytes):
            raise _bad(name, "names blob is not bytes")
        offsets = _array(raw.get("offsets"), count + 1, "names offsets", name)
        if offsets[0] != 0 or offsets[-1] != len(blob) or not bool(np.all(offsets[1:] >= offsets[:-1])):
            raise _bad(name, "names offsets do not run from 0 to the blob's end in order")
        names = _BlobNames(blob, offsets)
        seen: set[str] = set()
        for i in range(count):
            try:
                text = names[i]
            except UnicodeDecodeError:
                raise _bad(name, f"name of shard {i} is not UTF-8") from None
            if text or not allow_empty:
                _check_name(text, name)
            seen.add(text)
        if not allow_empty and len(seen) != count:
            raise _bad(name, "a shard is listed twice")
        return names
    parts, widths, numbers = raw.get("parts"), raw.get("widths"), raw.get("numbers")
    if (
        allow_empty
        or not isinstance(parts, list) or not all(isinstance(p, str) and _NAME_CHARS.match(p) for p in parts)
        or not isinstance(widths, list) or not all(isinstance(w, int) and 1 <= w <= 20 for w in widths)
        or not isinstance(numbers, list) or not len(parts) == len(widths) + 1 == len(numbers) + 1
        or not all(parts[1:-1])
    ):
        raise _bad(name, "names are neither a blob with offsets nor a template of parts, widths and numbers")
    arrays = tuple(_array(column, count, f"names number column {j}", name) for j, column in enumerate(numbers))
    template = _TemplateNames(tuple(parts), tuple(widths), arrays, count)
    if not _increasing(arrays):
        raise _bad(name, "template name numbers are not in strictly increasing order")
    if count:
        _check_name(template[0], name)  # digits never make a '.' or '/', so one name shows all names' shape
    return template


def valid_shard_name(object_name: str) -> bool:
    """Whether a manifest may name this shard object (relative to the dataset's prefix):
    ASCII letters, digits and ``_ . - /``, no part starting with ``.`` or ``-``."""
    return bool(_SHARD_NAME.match(object_name)) and ".." not in object_name.split("/")


def _check_name(object_name: str, name: str | None) -> None:
    if not valid_shard_name(object_name):
        raise _bad(name, f"shard name {object_name!r} is unsafe")


def _check_table(table: ShardTable, name: str | None) -> None:
    """The value checks every version gets, as array operations."""
    count = len(table)
    if not count:
        return
    c = table.columns
    samples = c["samples"]
    if int(samples.min()) < 1:
        raise _bad(name, f"shard {table.names[int(np.argmin(samples))]} has no samples")
    if int(samples.max()) >= _LIMIT // count:
        raise _bad(name, "its sample counts overflow 64 bits")
    for column in ("size", "index_offset", "index_size"):
        if int(c[column].max()) >= _LIMIT:
            raise _bad(name, f"column {column!r} holds a value over 63 bits")
    offset, size = c["index_offset"].astype(np.uint64), c["size"].astype(np.uint64)
    outside = (offset < 1024) | (offset + c["index_size"] > size)
    if isinstance(table.index_names, _BlobNames):
        outside &= np.diff(table.index_names.offsets) == 0  # an index kept apart starts its own object
    if outside.any():
        entry = table[int(np.argmax(outside))]
        raise IndexOutOfBounds(
            f"manifest {name}: shard {entry.name} says its index lies at "
            f"{entry.index_offset}+{entry.index_size}, outside its {entry.size} bytes",
            name=entry.name,
        )
