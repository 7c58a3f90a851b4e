"""Index existing WebDataset tar shards in place, so both datasets read them.

Each ``*.tar`` under a prefix is read once, sequentially in ranged parts (bounded
memory): its headers give each member's offset and size, its data each member's crc32.
The index goes to a new object next to the shard (``<shard>.index``) and a manifest lists
the shards; the original objects are never modified.
"""

from __future__ import annotations

import tarfile
from functools import partial
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from remote_loader.format.checksum import crc32
from remote_loader.errors import CorruptShard, UploadError
from remote_loader.format import MANIFEST_NAME, Manifest, ShardEntry, ShardIndex
from remote_loader.format.index import BLOCK, INDEX_MEMBER
from remote_loader.storage import Location, Store

INDEX_SUFFIX = ".index"
_PART = 8 * 1024 * 1024


class _Stream:
    """Sequential reads of one object in parts, with a running crc32 of all bytes read."""

    def __init__(self, fetch: Callable[[int, int], bytes | memoryview], name: str, size: int) -> None:
        self.fetch, self.name, self.size = fetch, name, size
        self.pos = 0
        self.crc = 0
        self._buf: bytes | memoryview = b""
        self._buf_start = 0

    def _chunk(self, n: int) -> memoryview:
        """Up to ``n`` bytes from the current position (fewer only at the end of the object)."""
        offset = self.pos - self._buf_start
        if offset >= len(self._buf):
            if self.pos >= self.size:
                return memoryview(b"")
            end = min(self.size, self.pos + _PART)
            self._buf = self.fetch(self.pos, end)
            self._buf_start, offset = self.pos, 0
        chunk = memoryview(self._buf)[offset : offset + n]
        self.pos += len(chunk)
        self.crc = crc32(chunk, self.crc)
        return chunk

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes, or CorruptShard if the object ends first."""
        parts = []
        while n:
            chunk = self._chunk(n)
            if not chunk:
                raise CorruptShard(f"{self.name} is truncated: it ends inside a member at byte {self.pos}", name=self.name)
            parts.append(bytes(chunk))
            n -= len(chunk)
        return b"".join(parts)

    def crc_of(self, n: int) -> int:
        """The crc32 of the next ``n`` bytes, read without keeping them."""
        crc = 0
        while n:
            chunk = self._chunk(n)
            if not chunk:
                raise CorruptShard(f"{self.name} is truncated: it ends inside a member at byte {self.pos}", name=self.name)
            crc = crc32(chunk, crc)
            n -= len(chunk)
        return crc

    def drain(self) -> None:
        """Read to the end, so that ``crc`` covers the whole object."""
        while self._chunk(_PART):
            pass


def _split_name(path: str) -> tuple[str, str] | None:
    """WebDataset's key/field split: the key ends at the first dot of the file name."""
    directory, _, base = path.rpartition("/")
    key, dot, field = base.partition(".")
    if not dot or not key or not field:
        return None
    return (f"{directory}/{key}" if directory else key), field


def scan_tar(fetch: Callable[[int, int], bytes | memoryview], name: str, size: int) -> tuple[ShardIndex, int]:
    """Read a tar shard once, through ``fetch(start, end)``, and return its index and whole crc32."""
    stream = _Stream(fetch, name, size)
    keys: list[str] = []
    rows: list[dict[str, tuple[int, int, int]]] = []
    long_name: str | None = None
    while stream.pos + BLOCK <= size:
        header_at = stream.pos
        block = stream.read(BLOCK)
        if block == bytes(BLOCK):
            break  # end-of-archive marker
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            raise CorruptShard(f"{name}: no valid tar header at byte {header_at}", name=name) from None
        padded = info.size + (-info.size % BLOCK)
        if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
            data = stream.read(padded)[: info.size]
            long_name = _long_name(info.type, data) or long_name
            continue
        path, long_name = (long_name or info.name), None
        split = _split_name(path) if info.isreg() and path != INDEX_MEMBER else None
        if split is None:
            stream.crc_of(padded)
            continue
        offset = stream.pos
        crc = stream.crc_of(info.size)
        stream.crc_of(padded - info.size)
        key, field = split
        if not keys or keys[-1] != key or field in rows[-1]:
            keys.append(key)
            rows.append({})
        rows[-1][field] = (offset, info.size, crc)
    stream.drain()
    if not keys:
        raise CorruptShard(f"{name} holds no WebDataset samples (<key>.<field> members)", name=name)
    fields = sorted({f for row in rows for f in row})
    column = {f: j for j, f in enumerate(fields)}
    offsets = np.zeros((len(keys), len(fields)), dtype=np.uint64)
    sizes = np.zeros_like(offsets)
    crcs = np.zeros((len(keys), len(fields)), dtype=np.uint32)
    for i, row in enumerate(rows):
        for field, (offset, member_size, crc) in row.items():
            offsets[i, column[field]], sizes[i, column[field]], crcs[i, column[field]] = offset, member_size, crc
    return ShardIndex(keys=keys, fields=tuple(fields), offsets=offsets, sizes=sizes, crcs=crcs), stream.crc


def _long_name(kind: bytes, data: bytes) -> str | None:
    if kind == tarfile.GNUTYPE_LONGNAME:
        return data.rstrip(b"\0").decode("utf-8", "surrogateescape")
    for record in data.split(b"\n"):  # pax records: "<len> key=value"
        _, _, pair = record.partition(b" ")
        if pair.startswith(b"path="):
            return pair[5:].decode("utf-8", "surrogateescape")
    return None


@dataclass(frozen=True)
class IndexSummary:
    location: Location
    shards: int
    samples: int
    bytes: int


def index_webdataset(
    store: Store, location: Location, *, progress: Callable[[str], object] | None = None
) -> IndexSummary:
    """Index every ``*.tar`` under ``location`` and write a manifest; return what was indexed."""
    prefix = location.key("")
    tars = sorted((info.key[len(prefix):], info.size) for info in store.list(location.bucket, prefix)
                  if info.key.endswith(".tar"))
    if not tars:
        raise UploadError(f"no .tar objects under {location}")
    entries = []
    fields: set[str] = set()
    for name, size in tars:
        key = location.key(name)
        index, crc = scan_tar(partial(store.get_range, location.bucket, key), name, size)
        data = index.encode()
        index_name = name + INDEX_SUFFIX
        store.put(location.bucket, location.key(index_name), data)
        entries.append(ShardEntry(name, len(index), size, 0, len(data), crc32(data), crc, index_name))
        fields.update(index.fields)
        if progress:
            progress(name)
    manifest = Manifest(shards=tuple(entries), fields=tuple(sorted(fields)), params={"indexed": "webdataset"})
    store.put(location.bucket, location.key(MANIFEST_NAME), manifest.encode())
    return IndexSummary(location, len(entries), manifest.num_samples, manifest.num_bytes)
