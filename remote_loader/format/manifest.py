"""The manifest: one msgpack object, written last, that lists every shard of a dataset.

Its size grows with the number of shards, not of samples: one GET of it plus one ranged
GET of a shard's index locate any sample. Version 3 is read by parts: a head of kilobytes
(sample counts as runs, the name template, a directory of pages) and pages of per-shard
numbers read when a shard of them is asked for (``pages.py``), so a manifest of ten million
shards opens in one small GET. Version 2 stores the per-shard numbers as little-endian column
arrays that load with ``numpy.frombuffer``; version 1 (one msgpack row per shard) is still read.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from remote_loader.checksum import crc32
from remote_loader.errors import CorruptShard
from remote_loader.format import pages as paging
from remote_loader.format.columns import column
from remote_loader.format.index import check_version, require, unpack
from remote_loader.format.pages import Load, PagedTable, decode_paged, encode_pages
from remote_loader.format.table import COLUMNS, ENTRY_FIELDS, ShardEntry, ShardTable, decode_columns, decode_rows

__all__ = ["FORMAT_NAME", "MANIFEST_NAME", "MANIFEST_VERSION", "UPLOAD_STATE", "Manifest", "ShardEntry", "ShardTable"]

MANIFEST_VERSION = 3
MANIFEST_NAME = "manifest.msgpack"
UPLOAD_STATE = "_upload/state.msgpack"
"""An unfinished upload's state, beside its shards until the manifest is written."""
FORMAT_NAME = "remote_loader"
_MAX_SKIPPED_LISTED = 10_000


def datasets_inside(keys: Iterable[str], prefix: str) -> list[str]:
    """The folders below ``prefix`` that hold a dataset (a manifest, or an unfinished upload's
    state), from a listing of ``keys``: tars inside them are those datasets' own, never tars
    to index as one dataset at ``prefix``."""
    found = set()
    for key in keys:
        for marker in (f"/{MANIFEST_NAME}", f"/{UPLOAD_STATE}"):
            if key.endswith(marker) and key.startswith(prefix) and len(key) > len(prefix) + len(marker):
                found.add(key[: -len(marker)])
    return sorted(found)


@dataclass(frozen=True)
class Manifest:
    """A dataset's table of contents.

    Attributes:
        shards: Every shard, in upload order: a ShardTable (a sequence of ShardEntry backed
            by arrays), or a PagedTable (version 3, read by pages); a writer may pass any
            sequence of ShardEntry.
        fields: Field names present in the dataset (``cls``, ``jpg``...).
        params: The upload parameters (seed, limits, image format...).
        skipped: How many source samples were skipped by ``on_error="skip"``.
        skipped_indices: Their indices in the source dataset (the first 10,000).
        version: Format version to encode (1, 2 or 3), or the version decoded.
    """

    shards: ShardTable | PagedTable
    fields: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    skipped: int = 0
    skipped_indices: tuple[int, ...] = ()
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.shards, (ShardTable, PagedTable)):
            object.__setattr__(self, "shards", ShardTable.from_entries(tuple(self.shards)))

    @property
    def num_samples(self) -> int:
        """Total number of samples."""
        return self.shards.counts.total

    @property
    def num_bytes(self) -> int:
        """Total bytes of all shards."""
        return self.shards.total_bytes

    def encode(self) -> bytes:
        """Serialise: a msgpack map followed by the crc32 of those bytes (4 bytes, little-endian).
        Version 3 keeps its pages inline here; ``encode_parts`` puts them apart when they are large."""
        head, pages = self.encode_parts(None)
        assert pages is None
        return head

    def encode_parts(self, pages_object: str | None) -> tuple[bytes, bytes | bytearray | None]:
        """The head and, for version 3 with pages over ``INLINE_BYTES`` (and ``pages_object``
        given), the pages' bytes to put at ``pages_object`` before the head."""
        body: dict[str, Any] = {"format": FORMAT_NAME, "version": self.version, "fields": list(self.fields)}
        pages: bytes | bytearray | None = None
        if self.version == 3:
            table = self.shards if isinstance(self.shards, ShardTable) else self.shards.table()
            parts, pages = encode_pages(table)
            body["shards"] = len(self.shards)
            body.update(parts)
            if pages_object is None or len(pages) <= paging.INLINE_BYTES:
                body["pages"]["data"], pages = pages, None
            else:
                body["pages"]["object"] = pages_object
        elif not isinstance(self.shards, ShardTable):
            raise ValueError("a manifest read by pages is encoded as version 3")
        elif self.version == 1:
            body["columns"] = list(ENTRY_FIELDS)
            body["shards"] = [s.as_row() for s in self.shards]
        else:
            body["shards"] = len(self.shards)
            body["columns"] = {c: column(self.shards.columns[c]) for c in COLUMNS}
            body["names"] = self.shards.names.encode()
            if self.shards.index_names is not None:
                body["index_names"] = self.shards.index_names.encode()
        body.update(params=dict(self.params), skipped=self.skipped,
                    skipped_indices=list(self.skipped_indices[:_MAX_SKIPPED_LISTED]))
        data = msgpack.packb(body, use_bin_type=True)
        return data + struct.pack("<I", crc32(data)), pages

    @classmethod
    def decode(
        cls, data: bytes | bytearray | memoryview, *, name: str | None = None, trailer_checked: bool = False,
        load: Load | None = None,
    ) -> Manifest:
        """Parse and validate manifest bytes (version 1, 2 or 3); ``trailer_checked`` skips the
        crc32 check that the caller has just made. ``load`` reads a version 3 manifest's pages
        kept apart (without it, only the head is at hand).

        Raises:
            UnsupportedVersion: Written by a newer format version.
            CorruptShard: Truncated or malformed.
            IndexOutOfBounds: A shard entry's index lies outside its object.
        """
        what = "manifest"
        body = memoryview(data)[:-4]  # a view: a 25 MB manifest is not copied to be checked and parsed
        if len(data) < 5 or not trailer_checked and struct.unpack("<I", data[-4:])[0] != crc32(body):
            raise CorruptShard(f"manifest {name} is truncated or fails its crc32 check", name=name)
        raw = unpack(body, what=what, name=name)
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
        shards: ShardTable | PagedTable
        if version == 3:
            shards = decode_paged(raw, name, load)
        else:
            shards = decode_rows(raw, name) if version == 1 else decode_columns(raw, name)
        return cls(
            shards=shards,
            fields=tuple(fields),
            params=params,
            skipped=skipped,
            skipped_indices=tuple(skipped_indices),
            version=version,
        )
