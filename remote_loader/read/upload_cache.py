"""One upload's shards in a node's cache (``node_cache.py``), as one process reads and fills
them: a shard read from its file, fetched whole into it once per node where it lacks it, and
every failure to write met by reading from the store (said once): a full cache or disk, a lock
held by a stuck process, a shard that cannot be put in place, a damaged copy that stays."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from remote_loader.config import CacheConfig
from remote_loader.read.cached_shard import ShardFile, check_whole, was_checked
from remote_loader.read.folder import Folder, Refused
from remote_loader.read.node_cache import (
    ABOUT,
    FILL,
    LOCK,
    PART,
    UPLOAD,
    NodeCache,
    existing,
    file_name,
    folders,
)
from remote_loader.read.shard_fill import FetchInto, ShardFill, Slots, pread_into
from remote_loader.storage.daemon import wait_result

log = logging.getLogger("remote_loader")

_TOUCH = 60.0  # seconds: a shard read is marked used (its atime) if it was not within this
_FULL_FOR = 30.0  # seconds a process fetches nothing more into a cache it found full
_PATIENCE = 30.0  # seconds another process's fill is waited for, plus a second per 10 MB of shard
_STUCK_FOR = 30.0  # seconds after such a wait ran out in which no other process's fill is waited for


# A fifo planted where a shard goes does not block its reader (Windows has neither O_NONBLOCK nor fifos).
_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
_ZEROS = 1 << 20  # bytes written at a time to allocate a file where the system cannot


class UploadCache:
    """The shards of one upload of one dataset in a node's cache, as one process uses them.

    ``read`` reads a shard's bytes from the cache, fetching the shard into it first where
    needed (once per node); ``discard`` drops a copy whose bytes failed a check. Every failure
    to write falls back to the store (``read`` returns False), never ends a read.
    """

    def __init__(self, node: NodeCache, endpoint: str, dataset: str, identity: int) -> None:
        self.node = node
        self.dataset_name = hashlib.sha256(f"{endpoint}\n{dataset}".encode()).hexdigest()[:20]
        self.upload_name = f"{identity:08x}"
        self.path = os.path.join(node.path, self.dataset_name, self.upload_name)
        self.describe = f"{dataset} ({endpoint})"
        self.broken: str | None = None  # why this process writes no more (a full disk...)
        self._lock = threading.Lock()
        self._opening = threading.Lock()
        self._filling: dict[str, Future[ShardFill | None]] = {}
        self._dir: Folder | None = None
        self._fill_dir: Folder | None = None
        self._full_until = 0.0
        self._said_full = False  # a shard did not fit under the cache's bound (said once)
        self._linked = False  # a link was found where a shard's lock goes (said once)
        self._unfilled: set[str] = set()  # shards this process fetches into the cache no more
        self._store_only: set[str] = set()  # shards it reads from the store: their copy is damaged, and stays
        self._stuck_until = 0.0  # a wait for another process's fill ran out: none is waited for until then

    def _open(self) -> Folder | None:
        """The upload's folder, made (with the dataset's, the shards of its other uploads
        removed) once a process; None where the cache cannot be used (said once)."""
        if self._dir is not None or self.broken is not None:
            return self._dir
        with self._opening:  # the other threads' fills wait for the folders
            if self._dir is None and self.broken is None:
                try:
                    root = self.node.root()
                    assert root is not None
                    dataset = root.sub(self.dataset_name)
                    with contextlib.suppress(OSError):  # for people to read; the cache works without it
                        dataset.write(ABOUT, (self.describe + "\n").encode())
                    for older in folders(dataset, UPLOAD):
                        if older != self.upload_name:
                            _remove_upload(dataset, older)  # another upload: never served to this one
                    upload = dataset.sub(self.upload_name)
                    self._fill_dir = upload.sub(FILL)
                    self._dir = upload
                except OSError as error:
                    self._stop(error)
        return self._dir

    def moved(self) -> bool:
        """Whether a folder this object holds open (the cache's, the upload's) is no longer at
        its path: the cache's directory was removed, perhaps made again since. Nothing of it
        can be written any more: a new object takes its place (``open_upload``)."""
        return self.node.moved() or any(folder.moved() for folder in (self._dir, self._fill_dir) if folder is not None)

    def read_into(self, name: str, size: int, crc: int, start: int, end: int, out: memoryview,
                  damaged: Callable[[], None] = lambda: None) -> bool:
        """Bytes ``[start, end)`` of cached shard ``name`` (``size`` bytes, crc32 ``crc``) into
        ``out``; False where it is not cached, or its file is not the one checked (dropped, as
        ``whole`` drops it)."""
        fd = self._open_checked(name, size, crc, damaged)
        if fd is None:
            return False
        try:
            if pread_into(fd, start, out[: end - start]):
                return True
            self._dropped(name, "was cut short since it was checked", damaged)
            return False
        finally:
            os.close(fd)

    def whole(self, name: str, size: int, crc: int, damaged: Callable[[], None] = lambda: None) -> ShardFile | None:
        """Cached shard ``name`` (``size`` bytes, crc32 ``crc``) open for reading, or None where
        the cache lacks it whole, or its file changed since it was checked and is no longer
        the shard's size or fails its crc32 now (the copy is dropped, with a warning, and
        ``damaged()`` called: the next read fetches it again). Checked, and trusted as it is,
        unless the cache checks every read (``CacheConfig.verify_reads``): then its members
        are to be checked as they are read (its reader checks every crc32:
        ``DatasetReader.verify``)."""
        fd = self._open_checked(name, size, crc, damaged)
        if fd is None:
            return None
        return ShardFile(fd, not self.node.config.verify_reads, size)

    def _open_checked(self, name: str, size: int, crc: int, damaged: Callable[[], None]) -> int | None:
        """Cached shard ``name`` open (a descriptor the caller closes), where it is there and is
        the shard's ``size``, and, unless every read is checked, as it was when checked whole
        or found whole now; else None (a copy that is not the shard's is dropped)."""
        folder = self._open()
        if folder is None or name in self._store_only:
            return None
        try:
            fd = folder.open(file_name(name), _READ)
        except OSError:
            return None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                return None
            if found.st_size != size:
                self._dropped(name, f"is {found.st_size} bytes, not the shard's {size}", damaged)
                return None
            _touch(fd, found)
            if not self.node.config.verify_reads and not was_checked(fd, found, crc) and \
                    not check_whole(fd, size, crc):
                self._dropped(name, "changed since it was checked and fails its crc32", damaged)
                return None
            opened, fd = fd, -1
            return opened
        finally:
            if fd >= 0:
                os.close(fd)

    def _dropped(self, name: str, why: str, damaged: Callable[[], None]) -> None:
        """The copy of ``name`` is not the shard (``why``): dropped, with a warning, and
        ``damaged()`` called; the next read fetches it again."""
        log.warning("%s in the node's cache %s: fetched again", name, why)
        self.discard(name)
        damaged()

    def size(self, name: str) -> int | None:
        """The size of cached shard ``name``, or None where it is not cached."""
        folder = self._open()
        found = folder.lstat(file_name(name)) if folder is not None else None
        return found.st_size if found is not None and stat.S_ISREG(found.st_mode) else None

    def discard(self, name: str) -> None:
        """Drop the copy of ``name`` (its bytes failed a check): the next read fetches it again.
        A fetch of it under way in this process is read no more (a part of it came damaged,
        and reading it again would give the same bytes): its reads go to the store, and it
        is not kept (its whole fails its crc32)."""
        with self._lock:
            pending = self._filling.get(name)
        fill = pending.result() if pending is not None and pending.done() else None
        if fill is not None:
            fill.spoil()
        folder = self._open()
        if folder is None:
            return
        try:
            folder.unlink(file_name(name))  # False where it is gone already
        except OSError as error:  # read-only, immutable: reading it again would give the same bytes
            if name not in self._store_only:
                self._store_only.add(name)
                log.warning("%s in the node's cache failed a check and cannot be removed (%s): read from the store",
                            name, error.strerror or error)

    def read(self, name: str, size: int, crc: int, start: int, end: int, out: memoryview, fetch_into: FetchInto,
             part_size: int, slots: Slots, cancel: threading.Event, damaged: Callable[[], None] = lambda: None) -> bool:
        """Bytes ``[start, end)`` of shard ``name`` (``size`` bytes, crc32 ``crc``) into ``out``
        from the cache, fetching the shard whole into it first where it lacks it (once per
        node: a fetch by another thread is read as its parts arrive, one by another process
        waited for); False where the cache cannot give them (then read them from the store).
        ``fetch_into(start, end, out, sized)`` is a ranged GET (``FetchInto``), each made
        holding one of ``slots``; ``damaged()`` is called where a copy is dropped (``whole``)."""
        if self.read_into(name, size, crc, start, end, out, damaged):
            return True
        if self.broken is not None or name in self._unfilled or name in self._store_only:
            return False
        fill = self._fill(name, size, crc, fetch_into, part_size, slots, cancel, start)
        if fill is None:  # fetched by another process meanwhile, or not to be cached
            return self.read_into(name, size, crc, start, end, out, damaged)
        return fill.read_into(start, end, out, cancel)

    def _fill(self, name: str, size: int, crc: int, fetch_into: FetchInto, part_size: int, slots: Slots,
              cancel: threading.Event, first: int) -> ShardFill | None:
        """The fetch of ``name`` into the cache this process runs, begun now if none is: one
        per shard and process (the threads that ask meanwhile wait for it to begin)."""
        with self._lock:
            pending = self._filling.get(name)
            if pending is None:
                mine: Future[ShardFill | None] = Future()
                self._filling[name] = mine
        if pending is not None:
            return wait_result(pending)
        fill = None
        try:
            fill = self._begin(name, size, crc, cancel)
            if fill is not None:
                fill.start(fetch_into, part_size, slots, cancel, first)
        finally:
            mine.set_result(fill)
            if fill is None:
                self._forget(name)
        return fill

    def _forget(self, name: str) -> None:
        with self._lock:
            self._filling.pop(name, None)

    def _ended(self, name: str, misplaced: OSError | None) -> None:
        """A fill of ``name`` ended; ``misplaced``: why the shard, fetched whole and checked,
        could not be put in place (each range would fetch it whole again: not tried again)."""
        if misplaced is not None:
            self._unfilled.add(name)
            log.warning("%s cannot be put in place in the node's cache (%s): read from the store", name,
                        misplaced.strerror or misplaced)
        self._forget(name)

    def _begin(self, name: str, size: int, crc: int, cancel: threading.Event) -> ShardFill | None:
        """Take the shard's lock (waiting a bounded time for another process's fetch) and
        reserve its space; None where there is nothing to fetch or it cannot be cached."""
        if time.monotonic() < self._full_until:
            return None  # the cache was full a moment ago: not counted again for every shard
        upload, fill_dir, final = self._open(), self._fill_dir, file_name(name)
        if upload is None or fill_dir is None:
            return None
        part = final + PART
        patience = 0.0 if time.monotonic() < self._stuck_until else _PATIENCE + size / 10e6
        try:
            lock = fill_dir.lock(final + LOCK, time.monotonic() + patience, _GiveUp(cancel, self))
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._full(name, size, "the disk is full")
            elif error.errno != errno.ELOOP:
                self._stop(error)
            elif not self._linked:  # planted by someone: that shard is read from the store
                self._linked = True
                log.warning("the shard cache in %s holds a link where %s goes, which it never follows: that shard"
                            " is read from the store", self.node.config.directory, os.path.join(fill_dir.path,
                                                                                                  final + LOCK))
            return None
        if lock is None:
            if not cancel.is_set():  # not the reader going away: another process stuck; not waited for again
                self._unfilled.add(name)
                if patience and self._ran_out():  # the first wait to run out (others cut short, or at once)
                    log.warning("another process has fetched %s into the node's cache for %.0f s: read from the"
                                " store, as are, for %.0f s, the shards other processes are fetching (a process"
                                " stopped while it fetches holds several)", name, patience, _STUCK_FOR)
            return None
        fd = -1
        try:
            if self.size(name) == size:
                return None  # fetched by another process while this one waited
            fd = fill_dir.create(part)
            if not self.node.reserve(size, upload.path, lambda: _allocate(fd, size)):
                with contextlib.suppress(OSError):
                    fill_dir.unlink(part)
                self._full(name, size, "under its bound")
                return None
            if size == 0:  # nothing to fetch: whole at once
                if crc == 0:
                    fill_dir.rename(part, upload, final)
                return None
            fill = ShardFill(name, size, crc, (fill_dir, part), (upload, final), fd, lock, partial(self._ended, name))
            fd = lock = -1  # the fill's now
            return fill
        except OSError as error:
            with contextlib.suppress(OSError):
                fill_dir.unlink(part)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk full: looked at again later
                self._full(name, size, "the disk is full")
            else:
                self._stop(error)
            return None
        finally:
            if fd >= 0:
                os.close(fd)
            if lock >= 0:
                os.close(lock)  # releases the lock

    def _ran_out(self) -> bool:
        """A wait for another process's fill ran out: wait for none for ``_STUCK_FOR`` seconds.
        True for the first of the waits that run out together (the one that says so)."""
        with self._lock:
            now = time.monotonic()
            first = now >= self._stuck_until
            if first:
                self._stuck_until = now + _STUCK_FOR
        return first

    def _full(self, name: str, size: int, why: str) -> None:
        """``name`` does not fit: fetch nothing into the cache for a while (one warning)."""
        self._full_until = time.monotonic() + _FULL_FOR
        if not self._said_full:
            self._said_full = True
            log.warning("the shard cache in %s has no room for %s (%d bytes), %s: the shards that do not fit"
                        " are read from the store, and the cache looked at again every %.0f s",
                        self.node.config.directory, name, size, why, _FULL_FOR)

    def _stop(self, error: OSError) -> None:
        """Write no more in this process; one warning says why."""
        if self.broken is not None:
            return
        if isinstance(error, Refused):
            self.broken = str(error)
            log.warning("the shard cache in %s is not used: %s; shards are read from the store",
                        self.node.config.directory, error)
            return
        self.broken = os.strerror(error.errno) if error.errno else str(error)
        full = " (the disk is full)" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        where = f": {error.filename}" if error.filename else ""
        log.warning("the shard cache in %s cannot be written%s: %s%s; shards are read from the store",
                    self.node.config.directory, full, self.broken, where)


def _remove_upload(dataset: Folder, name: str) -> None:
    """Remove another upload's shards, and the parts and locks of shards no process fetches.
    Its folders stay: a process still reading that upload (a job started before the dataset
    was overwritten, until its next pass) keeps using them, and would lose its cache, not
    only these shards, if they went."""
    upload = existing(dataset, name)
    if upload is None:
        return
    fill = existing(upload, FILL)
    if fill is not None:
        for found, _ in fill.files():
            if found.endswith(PART) and not fill.held(found[: -len(PART)] + LOCK):
                fill.unlink(found)
        for found, _ in fill.files():
            if found.endswith(LOCK) and fill.lstat(found[: -len(LOCK)] + PART) is None:
                fill.remove_unheld(found)
    for found, _ in upload.files():
        if not found.startswith("."):
            upload.unlink(found)


def _touch(fd: int, found: os.stat_result) -> None:
    """Mark a shard used (least recently used goes first), every minute at most: its access
    time, never its modification time, which is part of the record of its check."""
    if max(found.st_atime, found.st_mtime) < time.time() - _TOUCH:
        with contextlib.suppress(OSError):
            os.utime(fd, ns=(time.time_ns(), found.st_mtime_ns))


class _GiveUp:
    """What ends a wait for another process's fill early: the reader going away, or another
    wait of this process that ran out (the holder is likely stuck, and holds others)."""

    def __init__(self, cancel: threading.Event, cache: UploadCache) -> None:
        self.cancel, self.cache = cancel, cache

    def is_set(self) -> bool:
        return self.cancel.is_set() or time.monotonic() < self.cache._stuck_until


def _allocate(fd: int, size: int) -> None:
    """The new file's first ``size`` bytes given their blocks on disk, so that a full disk
    shows here, not in a write into its mapping (which would end the process with SIGBUS)."""
    if size and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
        return
    zeros, offset = bytes(min(size, _ZEROS)), 0  # macOS has no posix_fallocate: zeros written once
    while offset < size:
        offset += os.pwrite(fd, zeros[: size - offset], offset)


def open_upload(node: NodeCache, endpoint: str, dataset: str, identity: int) -> UploadCache:
    """This process's cache of one upload of one dataset in ``node``: one object a process and
    cache configuration, so that each dataset reads and fills as its own configuration says
    (its bound, ``max_bytes``, bounds its fills; ``verify_reads`` how it reads), made anew
    where the folders of the one before were removed (each pass of a reader asks again).

    It lasts while anything uses it (a reader keeps the one it was given, a fill under way
    its own): then its folders are closed, and the next to ask makes another. An entry of an
    older upload goes with the last reader of that upload: one that is still reading (until
    its next pass tells it of the overwrite) keeps the folders it has open, where a new entry
    would remove the new upload's shards."""
    key = (node.config, endpoint, dataset, identity)
    with _registry_lock:
        found = _registry.get(key)
        if found is None or found.moved():
            found = _registry[key] = UploadCache(node, endpoint, dataset, identity)
        return found


_registry: weakref.WeakValueDictionary[tuple[CacheConfig, str, str, int], UploadCache] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A child starts with no fills in flight: its parent's would never end there."""
    global _registry, _registry_lock
    _registry, _registry_lock = weakref.WeakValueDictionary(), threading.Lock()


if hasattr(os, "register_at_fork"):  # Windows has no fork
    os.register_at_fork(after_in_child=_forget_after_fork)
