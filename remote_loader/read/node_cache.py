"""A node's shard cache: shards kept whole on a local disk once fetched, read from there again.

Under the cache's directory (``CacheConfig.directory``)::

    .lock                              held while space is counted and reserved
    <dataset>/about                    the dataset's URL and endpoint, for ``remote-loader cache``
    <dataset>/<upload>/<name>          a shard, whole, its crc32 the manifest's (``/`` in its name: ``%``)
    <dataset>/<upload>/.fill/<name>.part   a shard being written
    <dataset>/<upload>/.fill/<name>.lock   locked (flock) by the process writing it

``<dataset>`` is a hash of the endpoint and the dataset's URL; ``<upload>`` the manifest's
identity, different for any two uploads: a copy belongs to one upload, and a reader that finds
a newer one removes the older ones. Shard names never start with a dot, so ``.fill`` is no
shard's.

One fetch per node: a process that needs a shard the cache lacks takes the shard's lock, fetches
it whole into ``.part`` (parallel ranged GETs received straight into the file), checks its
crc32 against the manifest's and renames it into place; a process that wants the same shard
meanwhile waits for the lock (threads of one process wait for one fill), then reads the file.
Nothing reads a ``.part``; a fill that dies leaves one, which the next fill of that shard
writes over and the next reservation removes (its lock no longer held). Files are only ever
renamed into place whole, so a reader sees a shard whole or not at all.

Bound: before a fill, under ``.lock``, the space is counted (shards and parts) and reserved
(the part's blocks allocated at once, so a full disk shows there, not mid-write). What is
evicted to make room: shards of other datasets and uploads, least recently used first, never
another shard of the upload being filled. Every epoch reads shards in a fresh random order,
so every shard of a dataset is equally likely to be needed soon: evicting one to keep another
gains no hit and costs a write. A dataset larger than the bound keeps the shards it cached first
and streams the rest. A fill that does not fit, a full disk or a directory that cannot be
written: the shard is streamed from the store as without a cache, with one warning a process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from remote_loader.config import CacheConfig
from remote_loader.read.shard_fill import ShardFill, pread_into
from remote_loader.storage.daemon import wait_result

log = logging.getLogger("remote_loader")

FILL = ".fill"
_PART, _LOCK, _ABOUT = ".part", ".lock", "about"
_FREE = 0.1  # the share of the disk a cache without a bound leaves free
_STEP = 0.01  # seconds between tries of a lock another process holds
_TOUCH = 60.0  # seconds: a shard read is marked used (its mtime) if it was not within this
_FULL_FOR = 30.0  # seconds a process fetches nothing more into a cache it found full
_PATIENCE = 30.0  # seconds another process's fill is waited for, plus a second per 10 MB of shard


class NodeCache:
    """The cache directory of this node: space, eviction, and each dataset's uploads in it."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.root = Path(config.directory)

    def __repr__(self) -> str:
        return f"NodeCache({str(self.root)!r}, max_bytes={self.config.max_bytes})"

    def upload(self, endpoint: str, dataset: str, identity: int) -> UploadCache:
        """This process's cache of one upload of one dataset (one object per process)."""
        key = (str(self.root), endpoint, dataset, identity)
        with _registry_lock:
            found = _registry.get(key)
            if found is None:
                found = _registry[key] = UploadCache(self, endpoint, dataset, identity)
            return found

    def bound(self, used: int) -> int:
        """The most bytes the cache may hold, ``used`` being what it holds now."""
        if self.config.max_bytes is not None:
            return self.config.max_bytes
        disk = shutil.disk_usage(self.root)
        return max(0, used + disk.free - int(disk.total * _FREE))

    def reserve(self, size: int, own: Path, allocate: Callable[[], None]) -> bool:
        """Make room for ``size`` bytes and ``allocate`` them, under the cache's lock: False
        where they do not fit even with every shard of other uploads than ``own`` evicted."""
        with _locked(self.root / ".lock") as held:
            if not held:
                return False
            shards = list(self.files())
            used = sum(f.size for f in shards)
            bound = self.bound(used)
            if used + size > bound:
                for found in sorted((f for f in shards if f.upload != own and not f.partial), key=lambda f: f.used):
                    with contextlib.suppress(FileNotFoundError):
                        found.path.unlink()
                        used -= found.size
                    if used + size <= bound:
                        break
            if used + size > bound:
                return False
            allocate()
            return True

    def files(self) -> Iterator[CachedFile]:
        """Every shard and part in the cache; parts no process writes any more are removed."""
        for upload in self.uploads():
            fill = upload / FILL
            shards = [(p, False) for p in upload.iterdir() if p != fill]
            parts = [(p, True) for p in fill.iterdir() if p.suffix == _PART] if fill.is_dir() else []
            for path, writing in shards + parts:
                try:
                    if writing and _abandoned(path):
                        path.unlink()
                        continue
                    stat = path.stat()
                except FileNotFoundError:  # evicted or renamed meanwhile
                    continue
                yield CachedFile(path, upload, stat.st_blocks * 512 if writing else stat.st_size, stat.st_mtime,
                                 writing)

    def uploads(self) -> Iterator[Path]:
        """The upload folders of every dataset in the cache."""
        if not self.root.is_dir():
            return
        for dataset in sorted(p for p in self.root.iterdir() if p.is_dir()):
            yield from sorted(p for p in dataset.iterdir() if p.is_dir())

    def datasets(self) -> list[CachedDataset]:
        """What the cache holds, by dataset and upload (``remote-loader cache``)."""
        out: dict[Path, CachedDataset] = {}
        for found in self.files():
            dataset = found.upload.parent
            if dataset not in out:
                about = dataset / _ABOUT
                out[dataset] = CachedDataset(about.read_text().strip() if about.is_file() else dataset.name)
            entry = out[dataset]
            entry.uploads.add(found.upload.name)
            entry.bytes += found.size
            entry.shards += 0 if found.partial else 1
        return sorted(out.values(), key=lambda d: d.name)

    def clear(self) -> int:
        """Remove every shard no process is writing; return the bytes removed."""
        removed = 0
        for found in list(self.files()):
            if found.partial:
                continue
            with contextlib.suppress(FileNotFoundError):
                found.path.unlink()
                removed += found.size
        return removed


@dataclass(frozen=True)
class CachedFile:
    path: Path
    upload: Path
    size: int
    used: float  # mtime: set when written, and when read (to the minute)
    partial: bool


@dataclass
class CachedDataset:
    name: str
    uploads: set[str] = field(default_factory=set)
    shards: int = 0
    bytes: int = 0


class UploadCache:
    """The shards of one upload of one dataset in a node's cache, as one process uses them.

    ``read`` reads a shard's bytes from the cache, fetching the shard into it first where
    needed (once per node); ``discard`` drops a copy whose bytes failed a check. Every failure
    to write falls back to the store (``read`` returns False), never ends a read.
    """

    def __init__(self, node: NodeCache, endpoint: str, dataset: str, identity: int) -> None:
        self.node = node
        digest = hashlib.sha256(f"{endpoint}\n{dataset}".encode()).hexdigest()[:20]
        self.dataset_dir = node.root / digest
        self.dir = self.dataset_dir / f"{identity:08x}"
        self.describe = f"{dataset} ({endpoint})"
        self.broken: str | None = None  # why this process writes no more (a full disk...)
        self._lock = threading.Lock()
        self._opening = threading.Lock()
        self._filling: dict[str, Future[ShardFill | None]] = {}
        self._opened = False
        self._full_until = 0.0

    def _open(self) -> None:
        """Make the upload's folder, and remove older uploads of the dataset (once a process)."""
        with self._opening:  # the other threads' fills wait for the folders
            if self._opened:
                return
            (self.dir / FILL).mkdir(parents=True, exist_ok=True)
            (self.dataset_dir / _ABOUT).write_text(self.describe + "\n")
            for other in self.dataset_dir.iterdir():
                if other.is_dir() and other != self.dir:
                    shutil.rmtree(other, ignore_errors=True)  # an overwritten upload: never served again
            self._opened = True

    def path(self, name: str) -> Path:
        """Where shard ``name`` lies: one folder, its ``/`` written ``%`` (a shard name holds no
        ``%``), so that ``a`` and ``a/b.tar`` never need one path to be a file and a folder."""
        return self.dir / name.replace("/", "%")

    def read_into(self, name: str, start: int, end: int, out: memoryview) -> bool:
        """Bytes ``[start, end)`` of cached shard ``name`` into ``out``; False where it is not
        cached (or shorter than that: the copy is dropped)."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_mtime < time.time() - _TOUCH:  # least recently used: marked every minute at most
                with contextlib.suppress(OSError):
                    os.utime(fd)
            if pread_into(fd, start, out[: end - start]):
                return True
            self.discard(name)  # shorter than the manifest says
            return False
        finally:
            os.close(fd)

    def size(self, name: str) -> int | None:
        """The size of cached shard ``name``, or None where it is not cached."""
        try:
            return self.path(name).stat().st_size
        except OSError:
            return None

    def discard(self, name: str) -> None:
        """Drop the copy of ``name`` (its bytes failed a check): the next read fetches it again."""
        with contextlib.suppress(OSError):
            self.path(name).unlink()

    def read(self, name: str, size: int, crc: int, start: int, end: int, out: memoryview,
             fetch_into: Callable[[int, int, memoryview], None], part_size: int, threads: int,
             cancel: threading.Event) -> bool:
        """Bytes ``[start, end)`` of shard ``name`` (``size`` bytes, crc32 ``crc``) into ``out``
        from the cache, fetching the shard whole into it first where it lacks it (once per
        node: a fetch by another thread is read as its parts arrive, one by another process
        waited for); False where the cache cannot give them (then read them from the store).
        ``fetch_into(start, end, out)`` is a ranged GET."""
        if self.read_into(name, start, end, out):
            return True
        if self.broken is not None:
            return False
        fill = self._fill(name, size, crc, fetch_into, part_size, threads, cancel, start)
        if fill is None:  # fetched by another process meanwhile, or not to be cached
            return self.read_into(name, start, end, out)
        return fill.read_into(start, end, out, cancel)

    def _fill(self, name: str, size: int, crc: int, fetch_into: Callable[[int, int, memoryview], None],
              part_size: int, threads: int, cancel: threading.Event, first: int) -> ShardFill | None:
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
                fill.start(fetch_into, part_size, threads, first)
        finally:
            mine.set_result(fill)
            if fill is None:
                self._forget(name)
        return fill

    def _forget(self, name: str) -> None:
        with self._lock:
            self._filling.pop(name, None)

    def _begin(self, name: str, size: int, crc: int, cancel: threading.Event) -> ShardFill | None:
        """Take the shard's lock (waiting a bounded time for another process's fetch) and
        reserve its space; None where there is nothing to fetch or it cannot be cached."""
        if time.monotonic() < self._full_until:
            return None  # the cache was full a moment ago: not counted again for every shard
        final = self.path(name)
        part = final.parent / FILL / (final.name + _PART)
        try:
            self._open()
            lock = os.open(part.with_suffix(_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            self._stop(error)
            return None
        fd = -1
        try:
            if not _lock_within(lock, _PATIENCE + size / 10e6, cancel):
                if not cancel.is_set():  # not the reader going away: another process stuck
                    log.warning("another process has fetched %s into the node's cache for %.0f s: read from the store",
                                name, _PATIENCE + size / 10e6)
                return None
            if self.size(name) == size:
                return None  # fetched by another process while this one waited
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            if not self.node.reserve(size, self.dir, lambda: _allocate(fd, size)):
                self._full_until = time.monotonic() + _FULL_FOR
                return None
            if size == 0:  # nothing to fetch: whole at once
                if crc == 0:
                    os.rename(part, final)
                return None
            fill = ShardFill(name, size, crc, part, final, fd, lock, partial(self._forget, name))
            fd = lock = -1  # the fill's now
            return fill
        except OSError as error:
            with contextlib.suppress(OSError):
                part.unlink()
            self._stop(error)
            return None
        finally:
            if fd >= 0:
                os.close(fd)
            if lock >= 0:
                os.close(lock)  # releases the lock

    def _stop(self, error: OSError) -> None:
        """Write no more in this process; one warning says why."""
        if self.broken is None:
            self.broken = os.strerror(error.errno) if error.errno else str(error)
            full = " (the disk is full)" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            log.warning("the shard cache in %s cannot be written%s: %s; shards are read from the store",
                        self.node.root, full, self.broken)


def _allocate(fd: int, size: int) -> None:
    if size:
        os.posix_fallocate(fd, 0, size)


def _lock_within(fd: int, seconds: float, cancel: threading.Event) -> bool:
    """Take the file's lock, waiting at most ``seconds`` for the process that holds it."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline or cancel.is_set():
                return False
            time.sleep(_STEP)


def _abandoned(part: Path) -> bool:
    """Whether no process writes ``part`` any more (its lock is free)."""
    try:
        fd = os.open(part.with_suffix(_LOCK), os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """The cache's lock, held for a reservation: whether it was had within ``_PATIENCE`` (a
    process stopped while it holds it must not stop the others)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield _lock_within(fd, _PATIENCE, threading.Event())
    finally:
        os.close(fd)


_registry: dict[tuple[str, str, str, int], UploadCache] = {}
_registry_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A child starts with no fills in flight: its parent's would never end there."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _registry.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
