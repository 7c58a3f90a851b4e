"""Every shard of a dataset: one ``ShardEntry`` per shard for writers, and the columnar
``ShardTable`` readers use (numbers as arrays, names rendered on demand)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, overload

import numpy as np

from remote_loader.errors import IndexOutOfBounds
from remote_loader.format.columns import LIMIT, array, manifest_error, narrow
from remote_loader.format.index import require
from remote_loader.format.names import BlobNames, Names, TemplateNames, check_name, decode_names
from remote_loader.format.shard import ShardSummary
from remote_loader.format.shard_counts import ArrayCounts

ENTRY_FIELDS = ("name", "samples", "size", "index_offset", "index_size", "index_crc", "crc32", "index_name")
COLUMNS = ("samples", "size", "index_offset", "index_size", "index_crc", "crc32")
CRC_COLUMNS = ("index_crc", "crc32")


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
        return cls(name=name, **asdict(summary))

    @property
    def data_end(self) -> int:
        """Every sample byte lies before this offset: the index member's header, or the object's end."""
        return self.size if self.index_name else self.index_offset - 512

    def as_row(self) -> list[Any]:
        return [getattr(self, f) for f in ENTRY_FIELDS]


class Shards(Sequence[ShardEntry]):
    """Every shard of a manifest, shard ``i``'s ShardEntry built on demand by ``entry(i)``."""

    def entry(self, i: int) -> ShardEntry:
        """Shard ``i`` (``0 <= i < len``)."""
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> ShardEntry: ...

    @overload
    def __getitem__(self, i: slice) -> list[ShardEntry]: ...

    def __getitem__(self, i: int | slice) -> ShardEntry | list[ShardEntry]:
        if isinstance(i, slice):
            return [self.entry(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {i} out of range: the manifest lists {n}")
        return self.entry(i % n)

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self.entry(i) for i in range(len(self)))


class ShardTable(Shards):
    """Every shard of a manifest as columns: ``table[i]`` builds shard ``i``'s ShardEntry on demand.

    ``samples``, ``size``, ``index_offset``, ``index_size``, ``index_crc`` and ``crc32`` are
    read-only numpy arrays (views of the manifest's bytes for version 2), so totals, the epoch
    split and lookups are array operations and a forked worker shares them with its parent.
    """

    def __init__(self, columns: Mapping[str, np.ndarray], names: Names, index_names: Names | None = None) -> None:
        self.columns = dict(columns)
        self.names = names
        self.index_names = index_names
        self._counts: ArrayCounts | None = None

    @classmethod
    def from_entries(cls, entries: Sequence[ShardEntry]) -> ShardTable:
        """Build the table of ``entries`` (what a writer has)."""
        columns = {c: narrow(np.array([getattr(e, c) for e in entries], dtype=np.uint64)) for c in COLUMNS}
        names = [e.name for e in entries]
        index_names = [e.index_name for e in entries]
        return cls(columns, TemplateNames.infer(names) or BlobNames.of(names),
                   BlobNames.of(index_names) if any(index_names) else None)

    @classmethod
    def from_template(cls, columns: Mapping[str, np.ndarray], parts: Sequence[str], widths: Sequence[int],
                      numbers: Sequence[np.ndarray]) -> ShardTable:
        """A table whose names follow a template (see docs/FORMAT.md), built from arrays:
        ``parts[0] + numbers[0][i] zero-padded to widths[0] + parts[1] + ...``."""
        count = len(numbers[0]) if numbers else len(columns["samples"])
        return cls({c: narrow(_unsigned(columns[c])) for c in COLUMNS},
                   TemplateNames(tuple(parts), tuple(widths), tuple(narrow(np.asarray(a)) for a in numbers), count))

    @property
    def samples(self) -> np.ndarray:
        """Samples per shard."""
        return self.columns["samples"]

    @property
    def counts(self) -> ArrayCounts:
        """Samples per shard, as the split and lookups ask for them (made once)."""
        if self._counts is None:
            self._counts = ArrayCounts(self.samples)
        return self._counts

    @property
    def total_bytes(self) -> int:
        """Bytes of all shards."""
        return int(self.size.sum(dtype=np.uint64))

    rows = None
    """Shards per block of the epoch's order: None, one block of every shard (versions 1 and 2)."""

    @property
    def size(self) -> np.ndarray:
        """Object size per shard, in bytes."""
        return self.columns["size"]

    def __len__(self) -> int:
        return len(self.names)

    def entry(self, i: int) -> ShardEntry:
        c = self.columns
        return ShardEntry(self.names[i], int(c["samples"][i]), int(c["size"][i]), int(c["index_offset"][i]),
                          int(c["index_size"][i]), int(c["index_crc"][i]), int(c["crc32"][i]),
                          self.index_names[i] if self.index_names else "")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTable):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards)"


def _unsigned(values: np.ndarray) -> np.ndarray:
    """``values`` as unsigned integers: as they are if they are already."""
    values = np.asarray(values)
    return values if values.dtype.kind == "u" else values.astype(np.uint64)


def decode_rows(raw: dict[str, Any], name: str | None) -> ShardTable:
    """Version 1: one msgpack row per shard."""
    columns = require(raw, "columns", list, what="manifest", name=name)
    rows = require(raw, "shards", list, what="manifest", name=name)
    if columns != list(ENTRY_FIELDS):
        raise manifest_error(name, f"unexpected shard columns {columns!r}")
    for position, row in enumerate(rows):
        if (
            not isinstance(row, list)
            or len(row) != len(ENTRY_FIELDS)
            or not isinstance(row[0], str)
            or not isinstance(row[7], str)
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < LIMIT for v in row[1:7])
        ):
            raise manifest_error(name, f"shard entry {position} is malformed")
    entries = [ShardEntry(*row) for row in rows]
    for entry in entries:
        check_name(entry.name, name)
        if entry.index_name:
            check_name(entry.index_name, name)
    if len({e.name for e in entries}) != len(entries):
        raise manifest_error(name, "a shard is listed twice")
    table = ShardTable.from_entries(entries)
    check_table(table, name)
    return table


def decode_columns(raw: dict[str, Any], name: str | None) -> ShardTable:
    """Version 2: column arrays, checked for length before use and for values as arrays."""
    count = require(raw, "shards", int, what="manifest", name=name)
    if count < 0:
        raise manifest_error(name, f"negative shard count {count}")
    given = require(raw, "columns", dict, what="manifest", name=name)
    if sorted(given) != sorted(COLUMNS):
        raise manifest_error(name, f"columns are {sorted(given)!r}, expected {sorted(COLUMNS)!r}")
    columns = {c: array(given[c], count, f"column {c!r}", name) for c in COLUMNS}
    for c in CRC_COLUMNS:
        if columns[c].dtype.itemsize > 4 and len(columns[c]) and int(columns[c].max()) >= 2**32:
            raise manifest_error(name, f"column {c!r} holds a value over 32 bits")
    names = decode_names(require(raw, "names", dict, what="manifest", name=name), count, name, allow_empty=False)
    index_names = None
    if "index_names" in raw:
        index_names = decode_names(require(raw, "index_names", dict, what="manifest", name=name), count, name,
                                    allow_empty=True)
    table = ShardTable(columns, names, index_names)
    check_table(table, name)
    return table


def check_table(table: ShardTable, name: str | None) -> None:
    """The value checks every version gets, as array operations."""
    count = len(table)
    if not count:
        return
    c = table.columns
    samples = c["samples"]
    if int(samples.min()) < 1:
        raise manifest_error(name, f"shard {table.names[int(np.argmin(samples))]} has no samples")
    if int(samples.max()) * count >= LIMIT:  # n * max(samples) < 2**63: the total fits a signed 64-bit integer
        raise manifest_error(name, "its sample counts overflow 64 bits")
    for column in ("size", "index_offset", "index_size"):
        if int(c[column].max()) >= LIMIT:
            raise manifest_error(name, f"column {column!r} holds a value over 63 bits")
    # Each sample is at least one tar member, a 512-byte header: no shard holds more samples
    # than its size allows. (The size itself is checked against the object when its index is read.)
    crowded = samples.astype(np.uint64) * np.uint64(512) > c["size"].astype(np.uint64)
    if crowded.any():
        entry = table[int(np.argmax(crowded))]
        raise manifest_error(name, f"shard {entry.name} claims {entry.samples:,d} samples in {entry.size:,d} bytes;"
                                   " each sample takes at least 512")
    offset, size = c["index_offset"].astype(np.uint64), c["size"].astype(np.uint64)
    outside = (offset < 1024) | (offset + c["index_size"] > size)
    if isinstance(table.index_names, BlobNames):
        apart = np.diff(table.index_names.offsets) > 0
        if (apart & (offset != 0)).any():  # an index kept apart is its own object, from byte 0
            entry = table[int(np.argmax(apart & (offset != 0)))]
            raise manifest_error(name, f"shard {entry.name} keeps its index in {entry.index_name} at offset"
                                       f" {entry.index_offset}; an index kept apart starts at offset 0")
        outside &= ~apart
    if outside.any():
        entry = table[int(np.argmax(outside))]
        raise IndexOutOfBounds(
            f"manifest {name}: shard {entry.name} says its index lies at "
            f"{entry.index_offset}+{entry.index_size}, outside its {entry.size} bytes",
            name=entry.name,
        )
