"""Shards: POSIX tar objects in the WebDataset layout whose last member is the index.

``ShardWriter`` streams a shard to any ``write(bytes)`` sink; ``ShardView`` slices samples
out of a shard's bytes with the index, never parsing a tar header.
"""

from __future__ import annotations

import mmap
import re
import tarfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from remote_loader.checksum import crc32
from remote_loader.errors import CorruptSampleError, CorruptShard, FormatError
from remote_loader.format.index import BLOCK, DIGEST_SIZE, INDEX_MEMBER, ShardIndex, check_field_name

_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,89}$")
_END_OF_ARCHIVE = bytes(2 * BLOCK)

Sample = dict[str, object]
"""A sample as readers yield it: ``__key__``, ``__shard__`` and one buffer per field."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid sample key (no dot, no slash, at most 90 chars), else raise."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"invalid sample key {key!r}: use up to 90 letters, digits, '_' or '-'")
    return key


def _padding(size: int) -> int:
    return -size % BLOCK


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0  # shards of the same samples are byte-identical
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def member_bytes(fields: Mapping[str, bytes]) -> int:
    """Return how many bytes a sample with these fields adds to a shard."""
    return sum(BLOCK + len(data) + _padding(len(data)) for data in fields.values())


def closing_bytes(index_size: int) -> int:
    """Return the bytes a shard needs after its last sample: index member and end of archive."""
    return BLOCK + index_size + _padding(index_size) + len(_END_OF_ARCHIVE)


@dataclass(frozen=True)
class ShardSummary:
    """What a finished shard holds and where its index lies; goes into the manifest."""

    samples: int
    size: int
    index_offset: int
    index_size: int
    index_crc: int
    crc32: int


class ShardWriter:
    """Write samples as tar members to ``sink``, then the index, then the end of archive.

    Args:
        sink: Called with each chunk of the shard, in order (a file's or an upload's ``write``).

    Examples:
        >>> import io
        >>> out = io.BytesIO()
        >>> w = ShardWriter(out.write)
        >>> w.add("000001", {"jpg": b"...", "cls": b"3"})
        >>> summary = w.close()
        >>> summary.samples, summary.size == len(out.getvalue())
        (1, True)
    """

    def __init__(self, sink: Callable[[bytes | memoryview], object]) -> None:
        self._sink = sink
        self._pos = 0
        self._crc = 0
        self._keys: list[str] = []
        self._key_bytes = 0
        self._fields: dict[str, int] = {}
        self._rows: list[list[tuple[int, int, int, int]]] = []
        self._digests = bytearray()
        self._closed = False

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._pos

    def __len__(self) -> int:
        return len(self._keys)

    def projected_size(self, key: str, fields: Mapping[str, bytes]) -> int:
        """Return an upper bound of the closed shard's size if this sample were added now."""
        names = set(self._fields) | set(fields)
        rows = len(self._keys) + 1
        # msgpack: each key a str header (<= 5 bytes) plus text; each column 8 + 8 + 4 bytes per
        # cell; the digests (a key and a bin header, then DIGEST_SIZE bytes a sample).
        index_bound = (256 + self._key_bytes + len(key) + 5 + rows * len(names) * 20 + sum(len(n) + 5 for n in names)
                       + 16 + rows * DIGEST_SIZE)
        return self._pos + member_bytes(fields) + closing_bytes(index_bound)

    def _emit(self, chunk: bytes | memoryview) -> None:
        self._sink(chunk)
        self._crc = crc32(chunk, self._crc)
        self._pos += len(chunk)

    def _member(self, name: str, data: bytes | memoryview) -> int:
        self._emit(_header(name, len(data)))
        offset = self._pos
        if len(data):
            self._emit(data)
        pad = _padding(len(data))
        if pad:
            self._emit(bytes(pad))
        return offset

    def add(self, key: str, fields: Mapping[str, bytes], digest: bytes | None = None) -> None:
        """Append one sample; its members are written adjacent, in ``fields`` order. ``digest``
        (``DIGEST_SIZE`` bytes, of the item the sample was made from) goes in the index: given
        for every sample of a shard, or for none."""
        if self._closed:
            raise FormatError("shard writer is closed")
        check_key(key)
        if not fields:
            raise ValueError(f"sample {key!r} has no field")
        if (digest is None) != (not self._digests) and self._keys:
            raise ValueError(f"sample {key!r}: a shard's samples have a digest each, or none has")
        if digest is not None and len(digest) != DIGEST_SIZE:
            raise ValueError(f"sample {key!r}: a digest is {DIGEST_SIZE} bytes, not {len(digest)}")
        row = []
        for field, data in fields.items():
            check_field_name(field)
            column = self._fields.setdefault(field, len(self._fields))
            offset = self._member(f"{key}.{field}", data)
            row.append((column, offset, len(data), crc32(data)))
        self._keys.append(key)
        self._key_bytes += len(key.encode()) + 5
        self._rows.append(row)
        if digest is not None:
            self._digests += digest

    def index(self) -> ShardIndex:
        """Return the index of the samples added so far."""
        shape = (len(self._keys), len(self._fields))
        offsets = np.zeros(shape, dtype=np.uint64)
        sizes = np.zeros(shape, dtype=np.uint64)
        crcs = np.zeros(shape, dtype=np.uint32)
        for i, row in enumerate(self._rows):
            for column, offset, size, crc in row:
                offsets[i, column], sizes[i, column], crcs[i, column] = offset, size, crc
        return ShardIndex(keys=self._keys, fields=tuple(self._fields), offsets=offsets, sizes=sizes, crcs=crcs,
                          digests=bytes(self._digests) if self._digests else None)

    def close(self) -> ShardSummary:
        """Write the index member and the end-of-archive blocks; return the shard's summary."""
        if self._closed:
            raise FormatError("shard writer is closed")
        if not self._keys:
            raise FormatError("a shard needs at least one sample")
        self._closed = True
        data = self.index().encode()
        index_offset = self._member(INDEX_MEMBER, data)
        self._emit(_END_OF_ARCHIVE)
        return ShardSummary(
            samples=len(self._keys),
            size=self._pos,
            index_offset=index_offset,
            index_size=len(data),
            index_crc=crc32(data),
            crc32=self._crc,
        )


class ShardView:
    """Samples sliced out of a shard's bytes by its index: no copy, no tar parsing.

    Args:
        buffer: The shard's bytes from offset ``base`` on (the whole shard when ``base`` is 0).
        index: The shard's decoded index.
        name: The shard's object name, put in ``__shard__`` and in error messages.
        verify: Check each member's crc32 before handing it out.
        base: Offset in the shard of ``buffer[0]``, when the buffer holds a range of it.
        first: First sample the buffer must cover.
        stop: End of the samples the buffer must cover (default: all).
    """

    def __init__(
        self,
        buffer: bytes | bytearray | memoryview | mmap.mmap,
        index: ShardIndex,
        *,
        name: str,
        verify: bool = True,
        base: int = 0,
        first: int = 0,
        stop: int | None = None,
    ) -> None:
        self._buf = memoryview(buffer).cast("B")
        self.index = index
        self.name = name
        self.verify = verify
        self.base = base
        stop = len(index) if stop is None else stop
        if first < stop and (index.start(first, stop) < base or index.extent(first, stop) > base + len(self._buf)):
            raise CorruptShard(f"shard {name} is {len(self._buf)} bytes, shorter than its index says", name=name)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def buffer(self) -> memoryview:
        """The bytes the view slices, from offset ``base`` of the shard on."""
        return self._buf

    def sample(self, i: int) -> Sample:
        """Return sample ``i``: ``__key__``, ``__shard__`` and a memoryview per field.

        Raises:
            CorruptSampleError: A member fails its crc32 check (with ``verify`` on).
        """
        key = self.index.keys[i]
        sample: Sample = {"__key__": key, "__shard__": self.name}
        for field, offset, size, crc in self.index.members(i):
            data = self._buf[offset - self.base : offset - self.base + size]
            if offset < self.base or len(data) != size:
                raise CorruptShard(f"shard {self.name}: sample {key!r} field {field!r} lies outside the fetched bytes",
                                   name=self.name)
            if self.verify and crc32(data) != crc:
                raise CorruptSampleError(
                    f"shard {self.name}: sample {key!r} field {field!r} fails its crc32 check",
                    name=self.name,
                    key=key,
                    field=field,
                )
            sample[field] = data
        return sample

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self.index)):
            yield self.sample(i)
