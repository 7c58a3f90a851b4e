"""Scan a WebDataset tar once, sequentially, into a shard index: for shards written by
other tools, which have no index of their own. Pure: bytes come through a callable."""

from __future__ import annotations

import tarfile
from collections.abc import Callable

import numpy as np

from remote_loader.checksum import crc32
from remote_loader.errors import CorruptShard
from remote_loader.format.index import BLOCK, INDEX_MEMBER, KEY_RULE, ShardIndex, bad_key, check_field_name

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
                raise CorruptShard(
                    f"{self.name} is truncated: it ends inside a member at byte {self.pos}", name=self.name
                )
            parts.append(bytes(chunk))
            n -= len(chunk)
        return b"".join(parts)

    def crc_of(self, n: int) -> int:
        """The crc32 of the next ``n`` bytes, read without keeping them."""
        crc = 0
        while n:
            chunk = self._chunk(n)
            if not chunk:
                raise CorruptShard(
                    f"{self.name} is truncated: it ends inside a member at byte {self.pos}", name=self.name
                )
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


def _check_member(name: str, path: str, key: str, field: str) -> None:
    """Refuse a member whose name cannot be a sample's key and field, naming the tar and the
    member (its ``repr``: control characters and undecodable bytes show escaped)."""
    try:
        check_field_name(field)
    except ValueError as error:
        raise CorruptShard(f"{name}: member {path!r} cannot be read as a sample: {error}", name=name) from None
    if bad_key([key]) is not None:
        raise CorruptShard(
            f"{name}: member {path!r} cannot be read as a sample: its key {key!r} is refused ({KEY_RULE})", name=name
        )


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
        key, field = split
        _check_member(name, path, key, field)
        offset = stream.pos
        crc = stream.crc_of(info.size)
        stream.crc_of(padded - info.size)
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
