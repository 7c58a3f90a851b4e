"""A node's shard cache: shards kept whole on a local disk once fetched, read from there again.
This module holds its folder, its bound and eviction; ``upload_cache.py`` reads and fills one
upload's shards.

In the directory named (``CacheConfig.directory``), which may hold other files and is shared
by the node's users, each user's cache is a folder of its own, made by the cache and private
to that user; nothing else in the directory is ever read, written or removed::

    remote-loader-<uid>/                   this user's cache
      CACHEDIR.TAG                         marks the folder as a cache (bford.info/cachedir)
      .lock                                held while space is reserved; holds the ledger of the bytes used
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
replaces and the next count of the space removes (its lock no longer held). Files are only ever
renamed into place whole, so a reader sees a shard whole or not at all. The check is recorded
with the file (``read/cached_shard.py``): a shard in place is read as it is while its file is
the one checked, checked whole again once it is not, and member by member with
``CacheConfig.verify_reads``.

Bound: before a fill, under ``.lock``, the space is reserved (the part's blocks allocated at
once, so a full disk shows there, not mid-write) against a ledger the lock file holds
(``Ledger``): the bytes the last count of every shard and part found, plus each reservation
of any process since, read and written under the lock, so each process's reservation sees the
others'. A reservation costs that, not a stat a file cached (which made a first epoch of
5,000 shards quadratic): the files are counted again where the ledger is missing or cut
short, a minute after the last count (no sooner than 100 times what it took), and before
any reservation that would pass the bound by the ledger, to find what to evict. A count that
evicts makes room for a twentieth of the bound more than it was asked for (at most that much
more than a fill needs), so the fills after it need none. What the ledger holds beyond the
files (removed since, or parts of fills that died) is gone at that count, before it could
refuse a reservation or make room that is there already; what it
lacks (files a process that keeps no ledger wrote) at the next count that falls due. What is
evicted to make room: shards of other datasets and uploads, least recently used first, never
another shard of the upload being filled. Every epoch reads shards in a fresh random order,
so every shard of a dataset is equally likely to be needed soon: evicting one to keep another
gains no hit and costs a write. A dataset larger than the bound keeps the shards it cached first
and streams the rest. A fill that does not fit, a full disk or a directory that cannot be
written: the shard is streamed from the store as without a cache, with one warning a process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from remote_loader.config import CacheConfig
from remote_loader.read.folder import Folder, Refused

FILL = ".fill"
TAG = "CACHEDIR.TAG"
_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
_TAG_TEXT = _SIGNATURE + b"\n# A shard cache of remote_loader: `remote-loader cache` shows it, `--clear` empties it.\n"
PART, LOCK, ABOUT = ".part", ".lock", "about"
_DATASET = re.compile(r"[0-9a-f]{20}\Z")
UPLOAD = re.compile(r"[0-9a-f]{8,16}\Z")
_LONGEST = 200  # bytes of a shard's file name, its suffix to come: past this, a hash of the name
_FREE = 0.1  # the share of the disk a cache without a bound leaves free
_PATIENCE = 30.0  # seconds the cache's lock is waited for, to count and reserve space
_RECOUNT = 60.0  # seconds after a count of the cache's files when a reservation counts them again
_RECOUNT_SHARE = 100.0  # and no sooner than this many times the time that count took
_LEDGER = re.compile(rb"remote-loader usage (\d+) (\d+\.\d+) (\d+\.\d+)\n\Z")
_ROOM = 20  # a count that evicts makes room for 1/20 of the bound more than the fill asked for


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
        where there is none): one a process, shared by the caches of one directory while any
        holds it. Raises ``Refused`` (or the OSError met) where it cannot be used."""
        with self._root_lock:
            if self._root is None:
                if not create and not os.path.isdir(self.config.directory):
                    return None
                self._root = _open_root(self.config.directory, create)
            return self._root

    def moved(self) -> bool:
        """Whether the cache's folder, once open, is no longer at its path (removed since)."""
        with self._root_lock:
            return self._root is not None and self._root.moved()

    def bound(self, root: Folder, used: int) -> int:
        """The most bytes the cache may hold, ``used`` being what it holds now."""
        if self.config.max_bytes is not None:
            return self.config.max_bytes
        disk = os.statvfs(root.fd)
        free, total = disk.f_bavail * disk.f_frsize, disk.f_blocks * disk.f_frsize
        return max(0, used + free - int(total * _FREE))

    def reserve(self, size: int, own: str, allocate: Callable[[], None]) -> bool:
        """Make room for ``size`` bytes and ``allocate`` them, under the cache's lock: False
        where they do not fit even with every shard of other uploads than ``own`` (a path)
        evicted. The bytes used are the ledger's (``Ledger``), the files counted only where it
        is missing or due, or where ``size`` more would pass the bound: then to evict."""
        root = self.root()
        assert root is not None
        with root.locked(LOCK, time.monotonic() + _PATIENCE) as fd:
            if fd is None:
                return False
            ledger = Ledger.read(fd)
            if ledger is None or ledger.due(time.time()) or ledger.used + size > self.bound(root, ledger.used):
                ledger = self._counted(root, size, own)
            if ledger.used + size > self.bound(root, ledger.used):
                ledger.write(fd)  # the count, for the next reservation of any process
                return False
            replace(ledger, used=ledger.used + size).write(fd)
            try:
                allocate()
            except BaseException:
                with contextlib.suppress(OSError):
                    ledger.write(fd)
                raise
            return True

    def _counted(self, root: Folder, size: int, own: str) -> Ledger:
        """Count every shard and part in the cache (removing the parts of fills that died) and,
        where ``size`` more bytes would pass the bound, evict shards of other uploads than
        ``own``, least recently used first, until they fit or none is left."""
        started, now = time.monotonic(), time.time()
        shards = list(self.files())
        used = sum(f.size for f in shards)
        bound = self.bound(root, used)
        if used + size > bound:  # room for the next fills too: a count a fill would be one a shard cached
            room = max(0, bound - bound // _ROOM)
            for found in sorted((f for f in shards if f.upload != own and not f.partial), key=lambda f: f.used):
                if found.folder.unlink(found.name):
                    used -= found.size
                if used + size <= room:
                    break
        return Ledger(used, now, time.monotonic() - started)

    def files(self) -> Iterator[CachedFile]:
        """Every shard and part in the cache; parts no process writes any more are removed.
        An upload's parts are listed before its shards: a part renamed into place meanwhile is
        counted twice, never missed (a reservation that missed it went past the bound)."""
        for dataset, upload in self.uploads():
            fill = existing(upload, FILL)
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
        for name in sorted(folders(root, _DATASET)):
            dataset = existing(root, name)
            if dataset is not None:
                for upload in sorted(folders(dataset, UPLOAD)):
                    found = existing(dataset, upload)
                    if found is not None:
                        yield dataset, found

    def datasets(self) -> list[CachedDataset]:
        """What the cache holds, by dataset and upload (``remote-loader cache``)."""
        out: dict[str, CachedDataset] = {}
        for found in self.files():
            dataset = found.dataset
            if dataset.path not in out:
                about = dataset.read(ABOUT, 4096)
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
            fill = existing(upload, FILL)
            if fill is None:
                continue
            for name, _ in fill.files():
                if name.endswith(LOCK) and fill.lstat(name[: -len(LOCK)] + PART) is None:
                    fill.remove_unheld(name)
        return removed


@dataclass(frozen=True)
class Ledger:
    """The bytes the cache holds, kept in its ``.lock`` for every process of the node: what
    the last count of its files found (at ``counted_at``, seconds since the epoch, in ``took``
    seconds), plus every reservation made since. Read and written under the lock alone.

    Only reservations add to it: a file removed since the count (a fill that failed, a damaged
    copy dropped, another upload's shards, what ``remote-loader cache --clear`` removed)
    stays counted until the next count, which comes before any reservation it would refuse, so
    that it never makes room that is there already. What no reservation added (a process of a
    version that keeps no ledger) is counted at the next count that falls due."""

    used: int
    counted_at: float
    took: float

    @classmethod
    def read(cls, fd: int) -> Ledger | None:
        """The ledger in the lock file open as ``fd``; None where it holds none, or not whole."""
        found = _LEDGER.match(os.pread(fd, 256, 0))
        return None if found is None else cls(int(found[1]), float(found[2]), float(found[3]))

    def write(self, fd: int) -> None:
        """Put it in the lock file open as ``fd`` (a write cut short reads as no ledger)."""
        data = b"remote-loader usage %d %.3f %.6f\n" % (self.used, self.counted_at, self.took)
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def due(self, now: float) -> bool:
        """Whether the files are to be counted again: ``_RECOUNT`` seconds after the last
        count, and no sooner than ``_RECOUNT_SHARE`` times what it took (a count holds every
        process's reservations up); at once where the clock went back."""
        return not 0.0 <= now - self.counted_at <= max(_RECOUNT, _RECOUNT_SHARE * self.took)


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
        if not name.endswith(PART):
            continue
        if not fill.held(name[: -len(PART)] + LOCK):
            fill.unlink(name)
            continue
        yield CachedFile(fill, name, upload.path, found.st_blocks * 512, found.st_mtime, True, dataset)


def _open_root(directory: str, create: bool) -> Folder | None:
    """This user's cache folder in ``directory``, the one this process has open where it is
    still there (one descriptor a directory, closed once no cache holds it), else opened."""
    with _roots_lock:
        found = _roots.get(directory)
        if found is None or found.moved():
            parent = Folder.named(directory)
            if not create and parent.lstat(folder_name()) is None:
                return None
            found = _roots[directory] = _claim(parent)
        return found


_roots: weakref.WeakValueDictionary[str, Folder] = weakref.WeakValueDictionary()
_roots_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A lock a parent's thread held at the fork would never be released in the child."""
    global _roots, _roots_lock
    _roots, _roots_lock = weakref.WeakValueDictionary(), threading.Lock()


if hasattr(os, "register_at_fork"):  # Windows has no fork
    os.register_at_fork(after_in_child=_forget_after_fork)


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


def folders(parent: Folder, pattern: re.Pattern[str]) -> list[str]:
    """The names of the folders (not links) in ``parent`` that fit the cache's layout."""
    return [name for name, found in parent.entries() if stat.S_ISDIR(found.st_mode) and pattern.match(name)]


def existing(parent: Folder, name: str) -> Folder | None:
    """Folder ``name`` of ``parent`` where it is one of this user's (None: absent, or not the cache's)."""
    try:
        return parent.sub(name, create=False)
    except OSError:
        return None
