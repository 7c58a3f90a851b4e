"""A node's shard cache: shards kept whole on a local disk once fetched, read from there again.

In the directory named (``CacheConfig.directory``), which may hold other files and is shared
by the node's users, each user's cache is a folder of its own, made by the cache and private
to that user; nothing else in the directory is ever read, written or removed::

    remote-loader-<uid>/                   this user's cache
      CACHEDIR.TAG                         marks the folder as a cache (bford.info/cachedir)
      .lock                                held while space is counted and reserved
      <dataset>/about                      the dataset's URL and endpoint, for ``remote-loader cache``
      <dataset>/<upload>/<name>            a shard, whole, its crc32 the manifest's
      <dataset>/<upload>/.fill/<name>.part     a shard being written
      <dataset>/<upload>/.fill/<name>.lock     locked (flock) by the process writing it

``<dataset>`` is a hash of the endpoint and the dataset's URL; ``<upload>`` the manifest's
identity, different for any two uploads: a copy belongs to one upload, and a process that
reads one removes the shards of the dataset's other uploads (their folders stay, for a
process still reading one until its next pass tells it of the overwrite). A shard's
``<name>`` is its object name with ``%`` and ``/`` escaped (a hash where that is too long
for a file name), never starting with a dot.

A directory others may write is hostile (``read/folder.py``): every folder is held open and
what lies in it is reached without following links; files are made with ``O_EXCL`` and renamed
into place; a directory another user owns or can write (but for a sticky one, as ``/tmp``),
or a folder in it that is a link or not this user's, is refused, with one warning, and shards
are read from the store. Only the cache's own layout below its tagged folder is ever removed
(in an upload's folder, every file not named with a dot first is a shard); a folder, a link, or
a file elsewhere or of another name is left where it is.

One fetch per node: a process that needs a shard the cache lacks takes the shard's lock, fetches
it whole into ``.part`` (parallel ranged GETs received straight into the file), checks its
crc32 against the manifest's and renames it into place; a process that wants the same shard
meanwhile waits for the lock (threads of one process wait for one fill), then reads the file.
Nothing reads a ``.part``; a fill that dies leaves one, which the next fill of that shard
replaces and the next reservation removes (its lock no longer held). Files are only ever
renamed into place whole, so a reader sees a shard whole or not at all. The check is recorded
with the file (``read/cached_shard.py``): a shard in place is read as it is while its file is
the one checked, checked whole again once it is not, and member by member with
``CacheConfig.verify_reads``.

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
import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from remote_loader.config import CacheConfig
from remote_loader.read.cached_shard import ShardFile, check_whole, was_checked
from remote_loader.read.folder import Folder, Refused
from remote_loader.read.shard_fill import ShardFill, Slots, pread_into
from remote_loader.storage.daemon import wait_result

log = logging.getLogger("remote_loader")

FILL = ".fill"
TAG = "CACHEDIR.TAG"
_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
_TAG_TEXT = _SIGNATURE + b"\n# A shard cache of remote_loader: `remote-loader cache` shows it, `--clear` empties it.\n"
_PART, _LOCK, _ABOUT = ".part", ".lock", "about"
_DATASET = re.compile(r"[0-9a-f]{20}\Z")
_UPLOAD = re.compile(r"[0-9a-f]{8,16}\Z")
_LONGEST = 200  # bytes of a shard's file name, its suffix to come: past this, a hash of the name
_FREE = 0.1  # the share of the disk a cache without a bound leaves free
_TOUCH = 60.0  # seconds: a shard read is marked used (its atime) if it was not within this
_FULL_FOR = 30.0  # seconds a process fetches nothing more into a cache it found full
_PATIENCE = 30.0  # seconds another process's fill is waited for, plus a second per 10 MB of shard
_STUCK_FOR = 30.0  # seconds after such a wait ran out in which no other process's fill is waited for


def folder_name() -> str:
    """The folder of this user's cache in the directory named."""
    return f"remote-loader-{os.geteuid()}"


def file_name(name: str) -> str:
    """The file shard ``name`` is kept as: one folder for every shard (``a`` and ``a/b.tar``
    never need one path to be a file and a folder), never a dot first."""
    escaped = name.replace("%", "%25").replace("/", "%2F")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    if not escaped or len(escaped.encode()) > _LONGEST:
        escaped = hashlib.sha256(name.encode()).hexdigest()
    return escaped


class NodeCache:
    """The cache directory of this node: space, eviction, and each dataset's uploads in it."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.path = os.path.join(config.directory, folder_name())
        self._root: Folder | None = None
        self._root_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NodeCache({self.config.directory!r}, max_bytes={self.config.max_bytes})"

    def root(self, create: bool = True) -> Folder | None:
        """This user's cache folder, open (made where missing, unless not ``create``: then None
        where there is none). Raises ``Refused`` (or the OSError met) where it cannot be used."""
        with self._root_lock:
            if self._root is None:
                if not create and not os.path.isdir(self.config.directory):
                    return None
                directory = Folder.named(self.config.directory)
                if not create and directory.lstat(folder_name()) is None:
                    return None
                self._root = _claim(directory)
            return self._root

    def upload(self, endpoint: str, dataset: str, identity: int) -> UploadCache:
        """This process's cache of one upload of one dataset (one object per process)."""
        key = (self.path, endpoint, dataset, identity, self.config.verify_reads)  # each reads as its config says
        with _registry_lock:
            found = _registry.get(key)
            if found is None:
                found = _registry[key] = UploadCache(self, endpoint, dataset, identity)
            return found

    def bound(self, root: Folder, used: int) -> int:
        """The most bytes the cache may hold, ``used`` being what it holds now."""
        if self.config.max_bytes is not None:
            return self.config.max_bytes
        disk = os.statvfs(root.fd)
        free, total = disk.f_bavail * disk.f_frsize, disk.f_blocks * disk.f_frsize
        return max(0, used + free - int(total * _FREE))

    def reserve(self, size: int, own: str, allocate: Callable[[], None]) -> bool:
        """Make room for ``size`` bytes and ``allocate`` them, under the cache's lock: False
        where they do not fit even with every shard of other uploads than ``own`` (a path) evicted."""
        root = self.root()
        assert root is not None
        with root.locked(".lock", time.monotonic() + _PATIENCE) as held:
            if not held:
                return False
            shards = list(self.files())
            used = sum(f.size for f in shards)
            bound = self.bound(root, used)
            if used + size > bound:
                for found in sorted((f for f in shards if f.upload != own and not f.partial), key=lambda f: f.used):
                    if found.folder.unlink(found.name):
                        used -= found.size
                    if used + size <= bound:
                        break
            if used + size > bound:
                return False
            allocate()
            return True

    def files(self) -> Iterator[CachedFile]:
        """Every shard and part in the cache; parts no process writes any more are removed.
        An upload's parts are listed before its shards: a part renamed into place meanwhile is
        counted twice, never missed (a reservation that missed it went past the bound)."""
        for dataset, upload in self.uploads():
            fill = _existing(upload, FILL)
            if fill is not None:
                yield from _parts(fill, upload, dataset)
            for name, found in upload.files():
                if not name.startswith("."):
                    yield CachedFile(upload, name, upload.path, found.st_size, max(found.st_atime, found.st_mtime),
                                     False, dataset)

    def uploads(self) -> Iterator[tuple[Folder, Folder]]:
        """The upload folders of every dataset in the cache, each with its dataset's folder."""
        root = self.root(create=False)
        if root is None:
            return
        for name in sorted(_folders(root, _DATASET)):
            dataset = _existing(root, name)
            if dataset is not None:
                for upload in sorted(_folders(dataset, _UPLOAD)):
                    found = _existing(dataset, upload)
                    if found is not None:
                        yield dataset, found

    def datasets(self) -> list[CachedDataset]:
        """What the cache holds, by dataset and upload (``remote-loader cache``)."""
        out: dict[str, CachedDataset] = {}
        for found in self.files():
            dataset = found.dataset
            if dataset.path not in out:
                about = dataset.read(_ABOUT, 4096)
                text = about.decode(errors="replace").strip() if about else ""
                out[dataset.path] = CachedDataset(text or os.path.basename(dataset.path))
            entry = out[dataset.path]
            entry.uploads.add(os.path.basename(found.upload))
            entry.bytes += found.size
            entry.shards += 0 if found.partial else 1
        return sorted(out.values(), key=lambda d: d.name)

    def clear(self) -> int:
        """Remove every shard no process is writing, and the locks of shards none is; return
        the bytes removed."""
        removed = 0
        for found in list(self.files()):
            if not found.partial and found.folder.unlink(found.name):
                removed += found.size
        for _, upload in self.uploads():
            fill = _existing(upload, FILL)
            if fill is None:
                continue
            for name, _ in fill.files():
                if name.endswith(_LOCK) and fill.lstat(name[: -len(_LOCK)] + _PART) is None:
                    fill.remove_unheld(name)
        return removed


@dataclass(frozen=True)
class CachedFile:
    folder: Folder
    name: str
    upload: str  # the upload folder's path
    size: int
    used: float  # the later of mtime (set when written) and atime (set when read, to the minute)
    partial: bool
    dataset: Folder


@dataclass
class CachedDataset:
    name: str
    uploads: set[str] = field(default_factory=set)
    shards: int = 0
    bytes: int = 0


def _parts(fill: Folder, upload: Folder, dataset: Folder) -> Iterator[CachedFile]:
    """The parts of shards being fetched into ``upload``; those no process writes any more removed."""
    for name, found in fill.files():
        if not name.endswith(_PART):
            continue
        if not fill.held(name[: -len(_PART)] + _LOCK):
            fill.unlink(name)
            continue
        yield CachedFile(fill, name, upload.path, found.st_blocks * 512, found.st_mtime, True, dataset)


def _claim(directory: Folder) -> Folder:
    """This user's cache folder in ``directory``, tagged as a cache: made and tagged here, or
    found tagged; an untagged folder that holds anything but a tag being written is refused
    (not the cache's: nothing in it is touched)."""
    root = directory.sub(folder_name())
    tag = root.read(TAG, len(_SIGNATURE))
    if tag is None:
        if any(not name.startswith(f".{TAG}.") for name, _ in root.entries()):
            tag = root.read(TAG, len(_SIGNATURE))  # a process starting beside this one has just tagged it
            if tag is None:
                raise Refused(f"{root.path} holds files the cache did not write (it has no {TAG}): name another"
                              " directory")
        else:
            root.write(TAG, _TAG_TEXT)  # processes that start together each write the same tag
            tag = root.read(TAG, len(_SIGNATURE))
    if tag != _SIGNATURE:
        raise Refused(f"{root.path}/{TAG} is not the cache's: name another directory")
    return root


def _folders(parent: Folder, pattern: re.Pattern[str]) -> list[str]:
    """The names of the folders (not links) in ``parent`` that fit the cache's layout."""
    return [name for name, found in parent.entries() if stat.S_ISDIR(found.st_mode) and pattern.match(name)]


def _existing(parent: Folder, name: str) -> Folder | None:
    """Folder ``name`` of ``parent`` where it is one of this user's (None: absent, or not the cache's)."""
    try:
        return parent.sub(name, create=False)
    except OSError:
        return None


_READ = os.O_RDONLY | os.O_NONBLOCK  # a fifo planted where a shard goes does not block its reader


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
                        dataset.write(_ABOUT, (self.describe + "\n").encode())
                    for older in _folders(dataset, _UPLOAD):
                        if older != self.upload_name:
                            _remove_upload(dataset, older)  # another upload: never served to this one
                    upload = dataset.sub(self.upload_name)
                    self._fill_dir = upload.sub(FILL)
                    self._dir = upload
                except OSError as error:
                    self._stop(error)
        return self._dir

    def read_into(self, name: str, start: int, end: int, out: memoryview) -> bool:
        """Bytes ``[start, end)`` of cached shard ``name`` into ``out``; False where it is not
        cached (or shorter than that: the copy is dropped)."""
        folder = self._open()
        if folder is None or name in self._store_only:
            return False
        try:
            fd = folder.open(file_name(name), _READ)
        except OSError:
            return False
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                return False
            _touch(fd, found)
            if pread_into(fd, start, out[: end - start]):
                return True
            self.discard(name)  # shorter than the manifest says
            return False
        finally:
            os.close(fd)

    def whole(self, name: str, size: int, crc: int, damaged: Callable[[], None] = lambda: None,
              members_checked: bool = True) -> ShardFile | None:
        """Cached shard ``name`` (``size`` bytes, crc32 ``crc``) open for reading, or None where
        the cache lacks it whole, or its file changed since it was checked and fails its crc32
        now (the copy is dropped, with a warning, and ``damaged()`` called: the next read
        fetches it again). Checked, and trusted as it is, unless the cache checks every read
        (``CacheConfig.verify_reads``): then its members are to be checked as they are read,
        and where the reader checks none (``members_checked`` false) the file is checked as
        when trusted, so that checking every read never checks less."""
        folder = self._open()
        if folder is None or name in self._store_only:
            return None
        try:
            fd = folder.open(file_name(name), _READ)
        except OSError:
            return None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size != size:
                return None
            _touch(fd, found)
            trusted = not self.node.config.verify_reads
            if (trusted or not members_checked) and not was_checked(fd, found, crc) and not check_whole(fd, size, crc):
                log.warning("%s in the node's cache changed since it was checked and fails its crc32: fetched again",
                            name)
                self.discard(name)
                damaged()
                return None
            shard, fd = ShardFile(fd, trusted, size), -1
            return shard
        finally:
            if fd >= 0:
                os.close(fd)

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

    def read(self, name: str, size: int, crc: int, start: int, end: int, out: memoryview,
             fetch_into: Callable[[int, int, memoryview], None], part_size: int, slots: Slots,
             cancel: threading.Event) -> bool:
        """Bytes ``[start, end)`` of shard ``name`` (``size`` bytes, crc32 ``crc``) into ``out``
        from the cache, fetching the shard whole into it first where it lacks it (once per
        node: a fetch by another thread is read as its parts arrive, one by another process
        waited for); False where the cache cannot give them (then read them from the store).
        ``fetch_into(start, end, out)`` is a ranged GET, each made holding one of ``slots``."""
        if self.read_into(name, start, end, out):
            return True
        if self.broken is not None or name in self._unfilled or name in self._store_only:
            return False
        fill = self._fill(name, size, crc, fetch_into, part_size, slots, cancel, start)
        if fill is None:  # fetched by another process meanwhile, or not to be cached
            return self.read_into(name, start, end, out)
        return fill.read_into(start, end, out, cancel)

    def _fill(self, name: str, size: int, crc: int, fetch_into: Callable[[int, int, memoryview], None],
              part_size: int, slots: Slots, cancel: threading.Event, first: int) -> ShardFill | None:
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
        part = final + _PART
        patience = 0.0 if time.monotonic() < self._stuck_until else _PATIENCE + size / 10e6
        try:
            lock = fill_dir.lock(final + _LOCK, time.monotonic() + patience, _GiveUp(cancel, self))
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self._full(name, size, "the disk is full")
            elif error.errno != errno.ELOOP:
                self._stop(error)
            elif not self._linked:  # planted by someone: that shard is read from the store
                self._linked = True
                log.warning("the shard cache in %s holds a link where %s goes, which it never follows: that shard"
                            " is read from the store", self.node.config.directory, os.path.join(fill_dir.path,
                                                                                                  final + _LOCK))
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
    upload = _existing(dataset, name)
    if upload is None:
        return
    fill = _existing(upload, FILL)
    if fill is not None:
        for found, _ in fill.files():
            if found.endswith(_PART) and not fill.held(found[: -len(_PART)] + _LOCK):
                fill.unlink(found)
        for found, _ in fill.files():
            if found.endswith(_LOCK) and fill.lstat(found[: -len(_LOCK)] + _PART) is None:
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
    if size:
        os.posix_fallocate(fd, 0, size)


_registry: dict[tuple[str, str, str, int, bool], UploadCache] = {}
_registry_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A child starts with no fills in flight: its parent's would never end there."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _registry.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
