"""A whole shard in the node's cache, open for reading: whether its bytes were checked whole
and the file is unchanged since, and its members read from the file straight into ``bytes``.

A shard enters the cache only once its bytes match the manifest's crc32 (``read/shard_fill.py``);
that check is recorded with the file's inode, size and modification time, in an extended
attribute of the file (with every other process's reads in mind) and in this process (for a
filesystem without extended attributes). A later read finds the file as checked, or checks it
whole again: a write into it changes its modification time. What no record can tell is damage
that leaves those as they were (a failing disk's bits, a time set back on purpose): that is
what ``CacheConfig.verify_reads`` is for, every member checked at every read.

Members are read with ``os.pread``, one call a member: one copy, from the page cache into the
sample's ``bytes``, made without the GIL (a range of small samples is read with one call and
its members copied out of it: ``read/shards.py``'s ``SMALL_SAMPLES``); no mapping, so a file
cut short or a disk's read error is an error the reader handles, never a signal that ends the
process. A dataset read with ``views=True`` maps the file instead and hands out views of the
mapping: no copy at all, at the price of that safety (a file of the cache cut short by another
program while mapped ends the reading process with SIGBUS; the cache itself never writes into
a shard in place: it renames a whole new file over it or unlinks it, and a mapping keeps the
file it was made of).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref

from remote_loader.checksum import crc32

_RECORD = "user.remote_loader.checked"
_CHUNK = 4 << 20  # bytes read at a time to check a file whole
_KEEP = 1 << 16  # files this process remembers having checked (where extended attributes fail)

_checked: dict[tuple[int, int], bytes] = {}  # (device, inode) -> stamp, checked in this process
_lock = threading.Lock()
_mappings: weakref.WeakValueDictionary[tuple[int, int, int, int], mmap.mmap] = weakref.WeakValueDictionary()
"""Each cached file mapped in this process, by (device, inode, size, mtime), while any view of
it or any ``ShardFile`` reading it lives: one mapping (and one descriptor, which the mapping
keeps) a shard however many of its ranges are read, not one a range."""


def _stamp(found: os.stat_result, crc: int) -> bytes:
    return struct.pack("<QQqI", found.st_ino, found.st_size, found.st_mtime_ns, crc)


def record_checked(fd: int, crc: int) -> None:
    """Record that the file open as ``fd`` has just been checked whole: its bytes' crc32 is ``crc``."""
    found = os.fstat(fd)
    stamp = _stamp(found, crc)
    with _lock:
        _checked.pop((found.st_dev, found.st_ino), None)
        _checked[(found.st_dev, found.st_ino)] = stamp
        if len(_checked) > _KEEP:
            del _checked[next(iter(_checked))]
    try:
        os.setxattr(fd, _RECORD, stamp)
    except (OSError, AttributeError):  # a filesystem, or a system (macOS's os), without them:
        pass  # this process's record serves this process


def was_checked(fd: int, found: os.stat_result, crc: int) -> bool:
    """Whether the file open as ``fd`` (``found`` its ``fstat``) is as it was when checked
    whole against ``crc``: the same inode, size and modification time."""
    stamp = _stamp(found, crc)
    if _checked.get((found.st_dev, found.st_ino)) == stamp:
        return True
    try:
        return os.getxattr(fd, _RECORD) == stamp
    except (OSError, AttributeError):  # AttributeError: macOS's os has no getxattr
        return False


def check_whole(fd: int, size: int, crc: int) -> bool:
    """Whether the ``size`` bytes of the file open as ``fd`` have crc32 ``crc`` (recorded if so)."""
    value, offset = 0, 0
    while offset < size:
        chunk = os.pread(fd, min(_CHUNK, size - offset), offset)
        if not chunk:
            return False
        value, offset = crc32(chunk, value), offset + len(chunk)
    if value != crc:
        return False
    record_checked(fd, crc)
    return True


def _mapping(fd: int, size: int) -> mmap.mmap | None:
    """The file open as ``fd`` (``size`` bytes) mapped read-only: this process's mapping of it
    where one lives, else a new one; None where the file is no longer ``size`` bytes."""
    found = os.fstat(fd)
    if found.st_size != size:
        return None
    key = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
    with _lock:
        mapped = _mappings.get(key)
        if mapped is None:
            mapped = _mappings[key] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        return mapped


class ShardFile:
    """A whole shard in the node's cache, open as ``fd`` (closed by ``close()``, or once the
    object is dropped). ``checked``: its bytes were checked whole and are trusted as they are.
    """

    def __init__(self, fd: int, checked: bool, size: int) -> None:
        self.fd, self.checked, self.size = fd, checked, size
        self._close = weakref.finalize(self, os.close, fd)
        self._mapped: memoryview | None = None
        self.unmappable = False

    def mapped(self) -> memoryview | None:
        """The whole file as a read-only view of it mapped (mapped once a process, and kept
        while any view of it lives); None where it was cut short since it was opened, or its
        filesystem maps no file (``unmappable``: FUSE with ``direct_io`` before Linux 6.6)."""
        if self._mapped is None and not self.unmappable:
            try:
                mapped = _mapping(self.fd, self.size) if self.size else b""
            except OSError:
                self.unmappable = True
                return None
            if mapped is None:
                return None
            self._mapped = memoryview(mapped)
        return self._mapped

    def view(self, offset: int, size: int) -> memoryview | None:
        """Bytes ``[offset, offset + size)`` of the shard as a read-only view of the file
        mapped (``mapped()``), or of their copy where it cannot be mapped; None past the size
        the file had when opened, or where it was cut short since."""
        if offset < 0 or offset + size > self.size:
            return None
        whole = self.mapped()
        if whole is not None:
            return whole[offset : offset + size]
        copy = self.read(offset, size) if self.unmappable else None
        return None if copy is None else memoryview(copy)

    def read(self, offset: int, size: int) -> bytes | None:
        """Bytes ``[offset, offset + size)`` of the shard; None where the file ends first (it
        was cut short since it was opened whole)."""
        data = os.pread(self.fd, size, offset)
        if len(data) == size:
            return data
        while len(data) < size:  # a read may come back short before the end of a file
            more = os.pread(self.fd, size - len(data), offset + len(data))
            if not more:
                return None
            data += more
        return data

    def close(self) -> None:
        self._mapped = None  # the mapping itself goes with the last view of it
        self._close()
