"""One shard being fetched into the node's cache, read by the threads of this process as its
parts arrive (``read/upload_cache.py`` decides when a shard is fetched, and where).

The parts go straight into the part file, each mapped while it arrives; a thread that needs bytes ``[start, end)``
waits only for the parts that hold them, then reads them from the file, so the first samples
of a shard come as early as without a cache. Once every part is in, the whole is checked
against the manifest's crc32 and renamed into place; only then do other processes read it.
Bytes read before that check are checked as all bytes are (the index's crc32, each member's);
none is read before the first part's GET has found the object the size the manifest says.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator

from remote_loader.errors import InvalidRange
from remote_loader.read.arrivals import Arrivals
from remote_loader.read.cached_shard import check_whole
from remote_loader.read.folder import Folder
from remote_loader.storage.daemon import in_daemon_thread, map_on_daemon_threads
from remote_loader.storage.retrying import Cancelled

log = logging.getLogger("remote_loader")

_THREADS = 8  # GETs in flight for one shard: several shards fill at once (a group's, and the next's)
_POLL = 0.5  # a wait for a part looks at the reader's cancel this often


FetchInto = Callable[[int, int, memoryview, bool], None]
"""``fetch_into(start, end, out, sized)``: a ranged GET of bytes ``[start, end)`` of the shard
into ``out``; ``sized``: also check that the object is the size the manifest says
(``TruncatedShard`` if not)."""


class FillFailed(Exception):
    """A part of a shard was not fetched because another one failed first."""


class Slots:
    """The GETs one reader may have in flight (``FetchConfig.concurrency``), shared by the
    shards it fills at once: each fills on threads of its own, and without a shared bound
    several filling together overflowed the client's connections. A part a reader waits for
    (asked for when the fill began, or waited on already) takes the next free slot before
    the others, which go in the order they came."""

    def __init__(self, size: int) -> None:
        self.size = self._free = size
        self._changed = threading.Condition()
        self._urgent: collections.deque[object] = collections.deque()
        self._rest: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def held(self, urgent: bool, cancel: threading.Event) -> Iterator[None]:
        """Hold a slot meanwhile; ``Cancelled`` where ``cancel`` is set while waiting for one."""
        me, queue = object(), self._urgent if urgent else self._rest
        with self._changed:
            queue.append(me)
            try:
                while not (self._free and (self._urgent or self._rest)[0] is me):
                    if cancel.is_set():
                        raise Cancelled("the reader was closed while a part waited for a GET")
                    self._changed.wait(_POLL)
            finally:
                queue.remove(me)
                self._changed.notify_all()  # the next in line, where a slot is free
            self._free -= 1
        try:
            yield
        finally:
            with self._changed:
                self._free += 1
                self._changed.notify_all()


class ShardFill:
    """Shard ``name`` (``size`` bytes, crc32 ``crc``) being fetched into ``part`` (a folder and
    a name; open as ``fd``, allocated, its lock held as ``lock``), renamed to ``final`` once
    whole and checked.
    ``done(misplaced)`` is called at the end, whatever happened, after the lock is released;
    ``misplaced`` is the error that kept the whole, checked shard from its place, or None."""

    def __init__(self, name: str, size: int, crc: int, part: tuple[Folder, str], final: tuple[Folder, str], fd: int,
                 lock: int, done: Callable[[OSError | None], None]) -> None:
        self.name, self.size, self.crc, self.part, self.final = name, size, crc, part, final
        self.fd, self.lock, self._done = fd, lock, done
        self.parts = Arrivals([], size)
        self.spoiled = False  # bytes read from it failed a check: read no more from it
        self.wanted: set[int] = set()  # the parts a reader has waited for: their GETs go first
        self.sized = 0  # the part whose GET checks the object's size: every read waits for it
        weakref.finalize(self, os.close, fd)  # readers may still read the file after the fetch ends

    def start(self, fetch_into: FetchInto, part_size: int, slots: Slots, cancel: threading.Event, first: int) -> None:
        """Fetch the shard on threads of its own, in parts of ``part_size``, as many at once as
        ``slots`` has (8 at most), each GET holding one of them. The part holding byte ``first``
        (what the fetch was begun for) comes first, its GET checking the object's size
        (``fetch_into(start, end, out, True)``), then the last part (the index lies there: a
        shard's ranges are cut from it), then the rest in order. Smaller parts, more of them at
        once, fetched a 16 MB shard no sooner across the S3-like link and cost CPU: 8 parts of
        2 MB took 1.04-1.09 s of an epoch that 2 parts of 8 MB took in 0.78-0.85 s (3,000 JPEGs,
        one process)."""
        self.parts = Arrivals(list(range(0, self.size, part_size)), self.size)
        asked, last = self.parts.holding(first, first + 1)[0], len(self.parts) - 1
        self.wanted.add(asked)
        self.sized = asked
        order = list(dict.fromkeys([asked, last, *range(len(self.parts))]))
        in_daemon_thread(lambda: self._fetch(fetch_into, slots, cancel, order), "remote-loader-cache")

    def _fetch(self, fetch_into: FetchInto, slots: Slots, cancel: threading.Event, order: list[int]) -> None:
        def one(k: int) -> None:
            start, stop = self.parts.bounds[k], self.parts.stop(k)
            try:
                with slots.held(k in self.wanted, cancel), _mapped(self.fd, start, stop) as view:
                    fetch_into(start, stop, view, k == self.sized)
            except BaseException as error:
                self.parts.arrive(k, error)
                raise
            self.parts.arrive(k)

        kept, misplaced = False, None
        try:
            map_on_daemon_threads(one, order, min(slots.size, _THREADS), "remote-loader-cache", settle=5.0)
            if check_whole(self.fd, self.size, self.crc):  # read as it is from now on (read/cached_shard.py)
                try:
                    self.part[0].rename(self.part[1], *self.final)
                    kept = True
                except OSError as error:  # a directory planted there, an immutable folder
                    misplaced = error
            else:
                log.warning("%s fetched for the node's cache fails its crc32: not kept", self.name)
        except BaseException:  # noqa: BLE001 - each part's error is the readers'; the store tells the rest
            pass
        finally:
            for k in range(len(self.parts)):
                if not self.parts.settled(k):  # never started: an earlier part failed
                    self.parts.arrive(k, FillFailed(f"{self.name}: another part failed"))
            if not kept:
                with contextlib.suppress(OSError):
                    self.part[0].unlink(self.part[1])
            os.close(self.lock)  # other processes may fetch it now, or read it
            self._done(misplaced)

    def spoil(self) -> None:
        """Bytes read from this fetch failed a check: a part came damaged. Read no more from
        it (the same part would be read again): its readers go to the store."""
        self.spoiled = True

    def read_into(self, start: int, end: int, out: memoryview, cancel: threading.Event) -> bool:
        """Bytes ``[start, end)`` into ``out`` once the parts holding them have arrived; False
        where they will not (the fetch was cancelled by the reader that began it, or the
        object is shorter than the manifest says, or bytes read from it failed a check):
        read them from the store. A part that failed otherwise raises its error (the
        store's, after its retries; ``TruncatedShard`` from the part that checks the object's
        size, which every read waits for: no byte of an object longer than the manifest
        says is served)."""
        if self.spoiled:
            return False
        if end <= start:
            return True

        def check() -> None:
            if cancel.is_set():
                raise Cancelled(f"reading {self.name} was cancelled")

        for k in dict.fromkeys([self.sized, *self.parts.holding(start, end)]):
            self.wanted.add(k)
            error = self.parts.wait(k, _POLL, check)
            if isinstance(error, (Cancelled, InvalidRange, FillFailed)):
                return False
            if error is not None:
                raise error
        return pread_into(self.fd, start, out[: end - start])


@contextlib.contextmanager
def _mapped(fd: int, start: int, end: int) -> Iterator[memoryview]:
    """Bytes ``[start, end)`` of the file, mapped while a part is received into them. A fill
    maps only its parts on their way: the whole shard mapped, its pages written, counted in
    the process's memory until the fill ended (three shards of 400 MB filling at once: 1,063
    MB of mapped file in a process whose ranges held 156 MiB)."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, end - base, offset=base)
    whole = memoryview(mapped)
    part = whole[start - base:]
    try:
        yield part
    finally:
        with contextlib.suppress(BufferError):  # a part still stuck in a hung GET: the collector closes it
            part.release()
            whole.release()
            mapped.close()


def pread_into(fd: int, offset: int, view: memoryview) -> bool:
    """Fill ``view`` from the file at ``offset``; False where the file ends first."""
    while len(view):
        got = os.preadv(fd, [view], offset) if hasattr(os, "preadv") else _pread_into(fd, view, offset)
        if got == 0:
            return False
        view, offset = view[got:], offset + got
    return True


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """``os.preadv(fd, [view], offset)`` where there is none (macOS before 11): a read of up to
    8 MiB, then a copy (a whole range read at once would be held twice)."""
    data = os.pread(fd, min(len(view), 8 << 20), offset)
    view[: len(data)] = data
    return len(data)
