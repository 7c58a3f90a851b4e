"""The manifest: one msgpack object, written last, that lists every shard of a dataset.

Its size grows with the number of shards, not of samples: one GET of it plus one ranged
GET of a shard's index locate any sample.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from remote_loader.format.checksum import crc32
from remote_loader.errors import CorruptShard, IndexOutOfBounds
from remote_loader.format.index import check_version, require, unpack
from remote_loader.format.shard import ShardSummary

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.msgpack"
FORMAT_NAME = "remote_loader"

_SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")
_ENTRY_FIELDS = ("name", "samples", "size", "index_offset", "index_size", "index_crc", "crc32", "index_name")
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


@dataclass(frozen=True)
class Manifest:
    """A dataset's table of contents.

    Attributes:
        shards: Every shard, in upload order.
        fields: Field names present in the dataset (``cls``, ``jpg``...).
        params: The upload parameters (seed, limits, image format...).
        skipped: How many source samples were skipped by ``on_error="skip"``.
        skipped_indices: Their indices in the source dataset (the first 10,000).
        version: Format version.
    """

    shards: tuple[ShardEntry, ...]
    fields: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    skipped: int = 0
    skipped_indices: tuple[int, ...] = ()
    version: int = MANIFEST_VERSION

    @property
    def num_samples(self) -> int:
        """Total number of samples."""
        return sum(s.samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        """Total bytes of all shards."""
        return sum(s.size for s in self.shards)

    def encode(self) -> bytes:
        """Serialise: a msgpack map followed by the crc32 of those bytes (4 bytes, little-endian)."""
        body = msgpack.packb(
            {
                "format": FORMAT_NAME,
                "version": self.version,
                "fields": list(self.fields),
                "columns": list(_ENTRY_FIELDS),
                "shards": [s.as_row() for s in self.shards],
                "params": dict(self.params),
                "skipped": self.skipped,
                "skipped_indices": list(self.skipped_indices[:_MAX_SKIPPED_LISTED]),
            },
            use_bin_type=True,
        )
        return body + struct.pack("<I", crc32(body))

    @classmethod
    def decode(cls, data: bytes | memoryview, *, name: str | None = None) -> Manifest:
        """Parse and validate manifest bytes.

        Raises:
            UnsupportedVersion: Written by a newer format version.
            CorruptShard: Truncated or malformed.
            IndexOutOfBounds: A shard entry's index lies outside its object.
        """
        what = "manifest"
        if len(data) < 5 or struct.unpack("<I", data[-4:])[0] != crc32(data[:-4]):
            raise CorruptShard(f"manifest {name} is truncated or fails its crc32 check", name=name)
        raw = unpack(data[:-4], what=what, name=name)
        if require(raw, "format", str, what=what, name=name) != FORMAT_NAME:
            raise CorruptShard(f"{name} is not a {FORMAT_NAME} manifest", name=name)
        version = require(raw, "version", int, what=what, name=name)
        check_version(version, known=MANIFEST_VERSION, what=what, name=name)
        fields = require(raw, "fields", list, what=what, name=name)
        columns = require(raw, "columns", list, what=what, name=name)
        rows = require(raw, "shards", list, what=what, name=name)
        params = require(raw, "params", dict, what=what, name=name)
        skipped = require(raw, "skipped", int, what=what, name=name)
        skipped_indices = require(raw, "skipped_indices", list, what=what, name=name)
        if columns != list(_ENTRY_FIELDS):
            raise CorruptShard(f"manifest {name}: unexpected shard columns {columns!r}", name=name)
        if not all(isinstance(f, str) for f in fields) or not all(isinstance(i, int) for i in skipped_indices):
            raise CorruptShard(f"manifest {name}: fields or skipped indices malformed", name=name)
        shards = tuple(_entry(row, position, name) for position, row in enumerate(rows))
        if len({s.name for s in shards}) != len(shards):
            raise CorruptShard(f"manifest {name}: a shard is listed twice", name=name)
        return cls(
            shards=shards,
            fields=tuple(fields),
            params=params,
            skipped=skipped,
            skipped_indices=tuple(skipped_indices),
            version=version,
        )


def _entry(row: Any, position: int, name: str | None) -> ShardEntry:
    if (
        not isinstance(row, list)
        or len(row) != len(_ENTRY_FIELDS)
        or not isinstance(row[0], str)
        or not isinstance(row[7], str)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row[1:7])
    ):
        raise CorruptShard(f"manifest {name}: shard entry {position} is malformed", name=name)
    entry = ShardEntry(*row)
    for object_name in filter(None, (entry.name, entry.index_name)):
        if not _SHARD_NAME.match(object_name) or ".." in object_name.split("/"):
            raise CorruptShard(f"manifest {name}: shard entry {position} has an unsafe name {object_name!r}", name=name)
    if entry.samples < 1:
        raise CorruptShard(f"manifest {name}: shard {entry.name} has no samples", name=name)
    if not entry.index_name and (entry.index_offset < 1024 or entry.index_offset + entry.index_size > entry.size):
        raise IndexOutOfBounds(
            f"manifest {name}: shard {entry.name} says its index lies at "
            f"{entry.index_offset}+{entry.index_size}, outside its {entry.size} bytes",
            name=entry.name,
        )
    return entry

