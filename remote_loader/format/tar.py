"""Scan a WebDataset tar once, sequentially, into a shard index: for shards written by
other tools, which have no index of their own. Pure: bytes come through a callable."""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator

import numpy as np

from remote_loader.checksum import crc32
from remote_loader.errors import CorruptShard
from remote_loader.format.index import BLOCK, INDEX_MEMBER, KEY_RULE, ShardIndex, bad_key, check_field_name

COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
"""Names of compressed tars: no byte range of one is a tar member, so they are neither
indexed in place nor streamed, and both say so."""

_PART = 8 * 1024 * 1024
_ZERO_BLOCK = bytes(BLOCK)
_MAX_EXTENDED = 1 << 20
"""The most bytes a pax or GNU long-name header may hold: far more than any path and its
attributes, far less than a claimed size that would fill memory."""

_EXTENDED = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK)
_SPARSE = "a sparse file (tar --sparse): its bytes are not stored in one piece and cannot be indexed in place"
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


class _Stream:
    """Sequential reads of one object in parts, with a running crc32 of all bytes read.
    ``member`` (or else ``header_at``) says what is being read, for a truncated object's message."""

    def __init__(self, fetch: Callable[[int, int], bytes | memoryview], name: str, size: int) -> None:
        self.fetch, self.name, self.size = fetch, name, size
        self.pos = 0
        self.crc = 0
        self.member: str | None = None
        self.header_at = 0
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

    def _truncated(self) -> CorruptShard:
        where = f"member {self.member!r}" if self.member is not None else f"the header at byte {self.header_at}"
        return CorruptShard(f"{self.name} is truncated: it ends at byte {self.pos}, inside {where}", name=self.name)

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes, or CorruptShard if the object ends first."""
        parts = []
        while n:
            chunk = self._chunk(n)
            if not chunk:
                raise self._truncated()
            parts.append(bytes(chunk))
            n -= len(chunk)
        return b"".join(parts)

    def crc_of(self, n: int) -> int:
        """The crc32 of the next ``n`` bytes, read without keeping them."""
        crc = 0
        while n:
            chunk = self._chunk(n)
            if not chunk:
                raise self._truncated()
            crc = crc32(chunk, crc)
            n -= len(chunk)
        return crc

    def drain(self) -> None:
        """Read to the end, so that ``crc`` covers the whole object."""
        while self._chunk(_PART):
            pass


def _header(block: bytes, name: str, at: int) -> tarfile.TarInfo:
    """Parse the tar header ``block`` found at byte ``at``, or refuse it saying why."""
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        for magic, kind in _COMPRESSED if at == 0 else ():
            if block.startswith(magic):
                raise CorruptShard(
                    f"{name} is {kind}-compressed (it starts with bytes {magic.hex(' ')}): a compressed tar cannot"
                    " be read by byte range; store it decompressed, as a .tar", name=name
                ) from None
        raise CorruptShard(f"{name}: no valid tar header at byte {at}", name=name) from None


def _pax_records(data: bytes, name: str, at: int) -> dict[str, str]:
    """The records of the pax header at byte ``at``: each ``"<length> <keyword>=<value>\\n"``,
    its length counting the whole record, so a value may hold newlines and ``=``."""
    records: dict[str, str] = {}
    pos, end = 0, len(data)
    while pos < end:
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        stop = pos + int(digits) if digits.isdigit() else -1
        keyword, equals, value = data[space + 1 : stop - 1].partition(b"=") if space < stop <= end else (b"", b"", b"")
        if not (equals and keyword and data[stop - 1] == 0x0A):
            if data.count(0, pos) == end - pos:
                break  # padding after the last record
            raise CorruptShard(f"{name}: the pax header at byte {at} holds a malformed record (at its byte {pos})",
                               name=name)
        records[keyword.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = stop
    return records


class _Extended:
    """What extended headers say of the members after them, as tarfile reads them: GNU long
    names and pax records for the next member (the first such header before it wins), global
    pax records for all that follow (a member's own records win)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: dict[str, str] = {}
        self.globals: dict[str, str] = {}

    def read(self, stream: _Stream, info: tarfile.TarInfo, at: int) -> None:
        """Take in the extended header ``info`` at byte ``at``, reading its data."""
        if info.size > _MAX_EXTENDED:
            raise CorruptShard(f"{self.name}: the header at byte {at} claims {info.size} bytes of names or"
                               f" attributes, more than {_MAX_EXTENDED} (tar would not write it)", name=self.name)
        data = stream.read(info.size + (-info.size % BLOCK))[: info.size]
        if info.type == tarfile.GNUTYPE_LONGNAME:
            end = data.find(b"\0")
            self.pending.setdefault("path", data[: end if end >= 0 else None].decode("utf-8", "surrogateescape"))
        elif info.type == tarfile.XGLTYPE:
            records = _pax_records(data, self.name, at)
            if "size" in records:
                raise CorruptShard(f"{self.name}: the global pax header at byte {at} sets a size for every member"
                                   " after it, which tar never writes", name=self.name)
            self.globals.update(records)
        elif info.type != tarfile.GNUTYPE_LONGLINK:
            for keyword, value in _pax_records(data, self.name, at).items():
                self.pending.setdefault(keyword, value)

    def apply(self, info: tarfile.TarInfo, at: int) -> str:
        """The path of the member whose header ``info`` is at byte ``at``, its size set from a
        pax ``size`` record; CorruptShard for a sparse file."""
        records = {**self.globals, **self.pending} if self.globals else self.pending
        self.pending = {}
        path = records["path"].rstrip("/") if "path" in records else info.name
        if any(keyword.startswith("GNU.sparse.") for keyword in records):
            path = records.get("GNU.sparse.name", path)
            raise CorruptShard(f"{self.name}: member {path!r} is {_SPARSE}", name=self.name)
        if "size" in records:
            if not records["size"].isdigit() or not records["size"].isascii():
                raise CorruptShard(f"{self.name}: member {path!r} has a malformed pax size record"
                                   f" {records['size']!r} (its header at byte {at})", name=self.name)
            info.size = int(records["size"])
        return path


def _members(stream: _Stream, name: str) -> Iterator[tuple[str, tarfile.TarInfo, int]]:
    """Each member's path, header and how many bytes of data follow it (block-padded), up to
    the end-of-archive marker; the caller reads or skips those bytes before asking for the next."""
    extended = _Extended(name)
    while stream.pos + BLOCK <= stream.size:
        at = stream.header_at = stream.pos
        stream.member = None
        block = stream.read(BLOCK)
        if block == _ZERO_BLOCK:
            return  # end-of-archive marker
        info = _header(block, name, at)
        if info.type in _EXTENDED:
            extended.read(stream, info, at)
            continue
        path = extended.apply(info, at) if extended.pending or extended.globals else info.name
        if info.type == tarfile.GNUTYPE_SPARSE:
            raise CorruptShard(f"{name}: member {path!r} is {_SPARSE}", name=name)
        # As tarfile: links, folders and devices have no data, whatever their size field says.
        data = info.size if info.isreg() or info.type not in tarfile.SUPPORTED_TYPES else 0
        stream.member = path
        yield path, info, data + (-data % BLOCK)
    stream.header_at, stream.member = stream.pos, None
    if stream.pos < stream.size and any(stream.read(stream.size - stream.pos)):
        raise stream._truncated()  # a header cut short: tarfile would end there and lose the member


def _split_name(path: str) -> tuple[str, str] | None:
    """WebDataset's key/field split: the key ends at the first dot of the file name (a name
    ending in that dot has an empty field, which ``_check_member`` refuses)."""
    directory, _, base = path.rpartition("/")
    key, dot, field = base.partition(".")
    if not dot or not key:
        return None
    return (f"{directory}/{key}" if directory else key), field


def _check_member(name: str, path: str, key: str, field: str) -> None:
    """Refuse a member whose name cannot be a sample's key and field, naming the tar and the
    member (its ``repr``: control characters and undecodable bytes show escaped)."""
    if not field:
        raise CorruptShard(f"{name}: member {path!r} cannot be read as a sample: its name ends with '.', which"
                           " WebDataset reads as a field without a name and an index cannot hold", name=name)
    try:
        check_field_name(field)
    except ValueError as error:
        raise CorruptShard(f"{name}: member {path!r} cannot be read as a sample: {error}", name=name) from None
    if bad_key([key]) is not None:
        raise CorruptShard(
            f"{name}: member {path!r} cannot be read as a sample: its key {key!r} is refused ({KEY_RULE})", name=name
        )


def _repeated(name: str, path: str, key: str, field: str) -> CorruptShard:
    return CorruptShard(f"{name}: member {path!r} repeats field {field!r} of sample {key!r}: WebDataset refuses"
                        " such a tar (duplicate file name)", name=name)


def scan_tar(fetch: Callable[[int, int], bytes | memoryview], name: str, size: int,
             max_fields: int | None = None) -> tuple[ShardIndex, int]:
    """Read a tar shard once, through ``fetch(start, end)``, and return its index and whole crc32.

    Members are read as tarfile (and so WebDataset) reads them: GNU long names, pax records
    (``path``, ``size``, global headers); field names lower-cased as WebDataset's
    ``group_by_keys`` does, except in a shard remote_loader wrote (it holds an ``__index__``
    member), whose index keeps them as written. A sparse member, a field repeated within a
    sample, a compressed or truncated object is refused with CorruptShard naming the tar
    and the member; so is the member that brings field name ``max_fields + 1``, as it comes
    (an index holds ``MAX_FIELDS``: a tar of a thousand is refused before its arrays grow).
    """
    stream = _Stream(fetch, name, size)
    keys: list[str] = []
    rows: list[dict[str, tuple[int, int, int]]] = []
    fields: set[str] = set()
    ours = False
    for path, info, padded in _members(stream, name):
        split = _split_name(path) if info.isreg() and path != INDEX_MEMBER else None
        if split is None:
            ours = ours or (path == INDEX_MEMBER and info.isreg())
            stream.crc_of(padded)
            continue
        key, field = split
        _check_member(name, path, key, field)
        offset = stream.pos
        crc = stream.crc_of(info.size)
        stream.crc_of(padded - info.size)
        if not keys or keys[-1] != key:
            keys.append(key)
            rows.append({})
        elif field in rows[-1]:
            raise _repeated(name, path, key, field)
        if max_fields is not None and field.lower() not in fields:  # as the names end (ours are bounded already)
            fields.add(field.lower())
            if len(fields) > max_fields:
                raise CorruptShard(f"{name} holds more field names than the {max_fields} an index holds (MAX_FIELDS):"
                                   f" member {path!r} brings the {max_fields + 1}th", name=name)
        rows[-1][field] = (offset, info.size, crc)
    stream.drain()
    if not keys:
        raise CorruptShard(f"{name} holds no WebDataset samples (<key>.<field> members)", name=name)
    return _index(keys, rows if ours else _lower_cased(name, keys, rows)), stream.crc


def _lower_cased(name: str, keys: list[str], rows: list[dict[str, tuple[int, int, int]]]
                 ) -> list[dict[str, tuple[int, int, int]]]:
    """``rows`` with their field names lower-cased, as WebDataset's ``group_by_keys(lcase=True)``
    names them; CorruptShard for two members of a sample that become one field."""
    lower = {field: field.lower() for row in rows for field in row}
    if all(field == low for field, low in lower.items()):
        return rows
    out = []
    for key, row in zip(keys, rows, strict=True):
        fields: dict[str, tuple[int, int, int]] = {}
        for field, member in row.items():
            if lower[field] in fields:
                raise _repeated(name, f"{key}.{field}", key, lower[field])
            fields[lower[field]] = member
        out.append(fields)
    return out


def _index(keys: list[str], rows: list[dict[str, tuple[int, int, int]]]) -> ShardIndex:
    """The index of samples ``keys``, each row ``field -> (offset, size, crc32)``."""
    fields = sorted({f for row in rows for f in row})
    column = {f: j for j, f in enumerate(fields)}
    offsets = np.zeros((len(keys), len(fields)), dtype=np.uint64)
    sizes = np.zeros_like(offsets)
    crcs = np.zeros((len(keys), len(fields)), dtype=np.uint32)
    for i, row in enumerate(rows):
        for field, (offset, member_size, crc) in row.items():
            offsets[i, column[field]], sizes[i, column[field]], crcs[i, column[field]] = offset, member_size, crc
    return ShardIndex(keys=keys, fields=tuple(fields), offsets=offsets, sizes=sizes, crcs=crcs)
