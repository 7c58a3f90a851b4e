"""Fetch byte ranges of objects ahead of use: parallel ranged GETs, a byte budget, retries.

Knows nothing of the format: a job names an object and, through a callable run in a
background thread, the byte range to fetch; the pipeline supplies that callable.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, TypeVar

import numpy as np

from remote_loader.read.arrivals import Arrivals
from remote_loader.read.buffers import Buffers
from remote_loader.read.cached_shard import ShardFile
from remote_loader.read.reach import Reach
from remote_loader.read.session import Cancelled, Object, ReadSession
from remote_loader.storage.daemon import DaemonPool, in_daemon_thread

T = TypeVar("T")
C = TypeVar("C")  # what a job says about its range, handed unread to the consumer

_POLL = 0.5  # longest single wait: every wait re-checks whether the fetcher failed or closed
_CLOSE_WITHIN = 1.0  # close() waits this long for threads; one stuck in a GET is left to its timeout


def fetch_range(session: ReadSession, bucket: str, obj: Object, start: int, end: int) -> bytes | bytearray:
    """One ranged GET through the session (its retrying store or the node's cache), counted in its metrics."""
    return session.get_range(bucket, obj, start, end)


def fetch_range_into(session: ReadSession, bucket: str, obj: Object, start: int, end: int, out: memoryview) -> None:
    """One ranged GET received into ``out`` through the session, counted in its metrics."""
    session.get_range_into(bucket, obj, start, end, out)


_Head = tuple[int, int, Future[bytes | bytearray]]  # bytes [start, end) of an object, fetched before it was located


@dataclass
class Job(Generic[C]):
    """One object to fetch part of; ``locate()`` returns ``(start, end, context)``, the
    byte range and what the consumer needs to read it (the fetcher never looks inside).

    ``early``, when given, is the first bytes of the object the range starts in or a little
    before, already being fetched (``fetch_head``) while the index ``locate()`` needs is on
    its way, saving a round trip. The job's maker decides which jobs have one; the fetcher
    takes it as the range's first part when the range starts inside it.
    """

    obj: Object
    """The object: its key, or a ``Shard`` of the manifest (read through the node's cache, where there is one)."""
    locate: Callable[[], tuple[int, int, C]]
    early: _Head | None = None


@dataclass
class Fetched(Generic[C]):
    """A range being fetched: ``buffer`` receives bytes ``[start, end)`` of ``obj`` part by part.

    The consumer may read a prefix of the range as soon as it has arrived: ``wait(upto)``
    blocks until bytes ``[start, upto)`` are in ``buffer`` (all of them by default) and
    raises the error of a part it needed that failed, or the fetcher's own failure.
    """

    obj: Object
    start: int
    end: int
    context: C
    buffer: memoryview = field(repr=False)
    parts: Arrivals = field(repr=False)  # where each part starts, and whether it arrived
    release: Callable[[], None] = field(default=lambda: None, repr=False)
    """Give the buffer back for reuse: call when done with it and holding no view of it."""
    check: Callable[[], None] = field(default=lambda: None, repr=False)
    """Raise if the fetcher failed or was closed (called between bounded waits)."""
    file: ShardFile | None = field(default=None, repr=False)
    """The whole object on the node's disk, where the range is read from there (``buffer`` is
    then empty): its members are read from the file, each straight into its ``bytes``."""
    _ready: int = 0  # leading parts known to have arrived whole

    def done_with(self) -> None:
        """The consumer is done with the range and holds no view of it: its buffer goes back
        for reuse once every part has settled. A part still arriving (after one before it
        failed) would write into whatever range reused it, so the buffer is dropped instead."""
        if all(self.parts.settled(k) for k in range(len(self.parts))):
            self.release()

    def wait(self, upto: int | None = None) -> int:
        """Block until bytes ``[start, upto)`` have arrived; raise if a part among them failed.
        Returns where the bytes known to have arrived end (``upto`` or further)."""
        end = self.end if upto is None else min(upto, self.end)
        for k in self.parts.holding(self.start, end)[self._ready:]:
            error = self.parts.wait(k, _POLL, self.check)
            if error is not None:
                raise error
            self._ready = k + 1
        return self.parts.bounds[self._ready] if self._ready < len(self.parts) else self.end


_LOCATE_AHEAD = 4  # ranges located (index GETs) ahead of the one being queued
_FIRST_PART = 1 << 20  # the first part of a range is small: its samples are needed first
_SECOND_PART = 2 << 20  # and the first ranges' second part is not much larger
_MIN_TAIL = 1 << 20  # a range's last part smaller than this joins the part before: a GET costs a round trip


class _Pending(Generic[C]):
    def __init__(self, job: Job[C]) -> None:
        self.job = job
        self.located = threading.Event()
        self.error: BaseException | None = None
        self.fetched: Fetched[C] | None = None


class FetcherClosed(Exception):
    """Raised in a waiter when the fetcher was closed under it."""


class Prefetcher(Generic[C]):
    """Fetch ``jobs`` in order, ahead of the consumer, within ``config.prefetch_bytes``.

    Iterate to get ``Fetched`` ranges in job order, each as soon as its GETs are under
    way: the consumer reads its parts as they arrive (``Fetched.wait``). Parts are fetched
    lowest part number first across ranges (the head of every range before the tail of
    any), since the consumer reads several ranges at once. The budget bounds the bytes of
    ranges not yet handed out; a range leaves it when the iterator hands it to the
    consumer, who then owns that memory.

    How far it reaches adapts to the store (``reach.py``): it starts with up to 8 GETs in
    flight and a quarter of ``config.prefetch_bytes`` (32 MiB at most) and raises both, up to ``config.concurrency`` and
    ``config.prefetch_bytes``, while the consumer waits for bytes and each step brings
    them in faster. ``metrics.gets_in_flight`` keeps the highest GET limit reached.
    ``locate_ahead`` jobs are located at once, ahead of the one being queued: an index's
    (cached per shard), or an unindexed tar's first GET, a round trip each.

    Every request goes through ``session.store`` (retried up to its outage deadline). An exception
    in any background thread reaches the consumer, in job order where it belongs to a job.
    ``close()`` (also on leaving a ``with`` block, or when an iteration is abandoned) stops
    the threads and returns within about a second even if GETs hang: a thread stuck in a
    request is left to end at its read timeout, and writes only into buffers of this
    fetcher, which are never reused after close.
    """

    def __init__(self, bucket: str, jobs: Iterable[Job[C]], session: ReadSession,
                 round_trip: float | None = None, locate_ahead: int = _LOCATE_AHEAD) -> None:
        self.bucket, self.session = bucket, session
        self._locate_ahead = locate_ahead
        self.config, self.metrics = session.config, session.metrics
        self._jobs = iter(jobs)
        self._slots: deque[_Pending[C] | None] = deque()  # None marks the end of the jobs
        # One lock, three waits, each woken only for its own news: getters for parts to fetch
        # (one per part, not all of them per event), the scheduler for budget, the consumer
        # for ranges handed out. Waking every thread at every event costs the GIL per thread.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._handed = threading.Condition(self._lock)
        self._held = 0
        self._closed = False
        self._failure: BaseException | None = None
        self._buffers = Buffers(self.metrics, self.config.free_ranges)
        self._parts: list[tuple[int, int, int, int, Fetched[C]]] = []  # heap: (part number, seq, start, end, range)
        self._seq = 0
        self._submitted = 0  # ranges queued so far
        self._active = 0  # GETs under way
        self._reach = Reach(self.config.concurrency, self.config.prefetch_bytes, round_trip)
        self._budget_blocked = False  # the scheduler waits for budget
        self.metrics.peak("gets_in_flight", self._reach.gets)
        # Its scheduler, the threads that locate ranges, and its getters (each a loop, until
        # closed), on daemon threads. The getters start now, while the first ranges are
        # located; through the node's cache, with the first range to GET (the ranges of
        # shards it holds whole need none).
        self._threads = DaemonPool(1, "remote-loader-fetch")
        self._locators = DaemonPool(locate_ahead, "remote-loader-locate")
        self._getters: DaemonPool | None = None
        if not session.caching:
            self._start_getters()
        self._threads.submit(self._schedule)

    def _start_getters(self) -> None:
        self._getters = DaemonPool(self.config.concurrency, "remote-loader-fetch", numbered=True)
        for _ in range(self.config.concurrency):
            self._getters.submit(self._get)

    def check(self) -> None:
        """Raise the fetcher's failure, or FetcherClosed once it is closed."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise FetcherClosed("the prefetcher was closed")

    def _reserve(self, size: int) -> bool:
        with self._lock:
            # A range larger than the whole budget is fetched alone rather than never.
            while not self._closed and self._held and self._held + size > self._reach.bytes:
                self._budget_blocked = True
                self._room.wait()
            self._budget_blocked = False
            if self._closed:
                return False
            self._held += size
            self.metrics.peak("peak_buffered", self._held)
            return True

    def _release(self, size: int) -> None:
        with self._lock:
            self._held -= size
            self._room.notify()

    def _wake_all(self) -> None:
        """Wake every waiter (called with the lock held): the fetcher failed or closed."""
        for condition in (self._work, self._room, self._handed):
            condition.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is None and not isinstance(error, Cancelled):
                self._failure = error
            self._wake_all()

    def _schedule(self) -> None:
        try:
            self._schedule_jobs()
        except BaseException as exc:  # any failure here reaches the consumer, never a silent stop
            self._fail(exc)

    def _schedule_jobs(self) -> None:
        # Indexes are located a few jobs ahead, in parallel: the consumer opens several ranges at once.
        pending: deque[tuple[_Pending[C], Future[tuple[int, int, C]], _Head | None]] = deque()
        while True:
            while len(pending) < self._locate_ahead and not self._closed:
                job = next(self._jobs, None)
                if job is None:
                    break
                slot = _Pending(job)
                pending.append((slot, self._locators.submit(job.locate), job.early))
                with self._lock:
                    self._slots.append(slot)
                    self._handed.notify()
            if not pending or self._closed:
                break
            slot, located, early = pending.popleft()
            while not wait([located], timeout=_POLL).done:
                if self._closed:
                    return
            try:
                start, end, context = located.result()
            except BaseException as exc:  # handed to the consumer, in order
                slot.error = exc
                slot.located.set()
                return
            if not self._reserve(end - start):
                return
            self._submit(slot, start, end, context, early)
        with self._lock:
            self._slots.append(None)
            self._handed.notify()

    def _submit(self, slot: _Pending[C], start: int, end: int, context: C, early: _Head | None = None) -> None:
        """Queue the parts of a located range. The first ranges start with small parts, so the
        first samples come early; later ones use whole parts (each GET has a fixed cost). A
        head fetched early (``Job.early``) is the first part when the range starts inside it.
        A last part under ``_MIN_TAIL`` joins the one before: on the critical path, a GET of a
        few KiB costs as long as one of MiBs."""
        if end > start and self._from_disk(slot, start, end, context):
            return
        size = self.config.part_size
        head = early if early is not None and early[0] <= start < min(end, early[1]) else None
        first = min(end, head[1]) if head is not None else start + min(_FIRST_PART, size)
        if self._submitted < _LOCATE_AHEAD or head is not None:
            bounds = [b for b in [start, first, *range(first + min(_SECOND_PART, size), end, size)] if b < end]
        else:
            bounds = list(range(start, end, size))
        if len(bounds) > (2 if head is not None else 1) and end - bounds[-1] < _MIN_TAIL:
            bounds.pop()
        self._submitted += 1
        if self._getters is None:
            self._start_getters()
        backing = self._buffers.take(end - start)
        fetched = Fetched(
            slot.job.obj,
            start,
            end,
            context,
            backing.data[: end - start],
            Arrivals(bounds, end),
            partial(self._give_back, backing),
            self.check,
        )
        slot.fetched = fetched
        slot.located.set()
        if head is not None:
            offset, _, future = head
            future.add_done_callback(partial(self._take_head, fetched, start - offset, first - offset))
        with self._lock:
            pushed = 0
            for number, (part, stop) in enumerate(zip(bounds, [*bounds[1:], end], strict=False)):
                if number or head is None:
                    heapq.heappush(self._parts, (number, self._seq, part, stop, fetched))
                    self._seq += 1
                    pushed += 1
            self._work.notify(pushed)

    def _from_disk(self, slot: _Pending[C], start: int, end: int, context: C) -> bool:
        """Hand out a range of a shard the node's cache holds whole as that file, nothing to
        fetch nor to copy into a buffer; False where the cache does not hold it."""
        shard = self.session.whole(slot.job.obj)
        if shard is None:
            return False
        self.metrics.add(cached_bytes=end - start)
        parts = Arrivals([start], end)
        parts.arrive(0)
        slot.fetched = Fetched(slot.job.obj, start, end, context, memoryview(b""), parts, shard.close, self.check,
                               shard)
        slot.located.set()
        return True

    @staticmethod
    def _take_head(fetched: Fetched[C], skip: int, stop: int, early: Future[bytes]) -> None:
        """Fill a range's first part from its head fetched early (in the thread that fetched it)."""
        error: BaseException | None = None
        try:
            fetched.buffer[: stop - skip] = memoryview(early.result())[skip:stop]
        except BaseException as exc:
            error = exc
        finally:
            fetched.parts.arrive(0, error)

    def _give_back(self, backing: np.ndarray) -> None:
        if not self._closed:  # after close a stuck GET may still write into it
            self._buffers.give(backing)

    def _get(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and (not self._parts or self._active >= self._reach.gets):
                        self._work.wait()
                    if self._closed:
                        return
                    number, _, start, end, fetched = heapq.heappop(self._parts)
                    self._active += 1
                try:
                    self._fetch_part(fetched, number, start, end)
                finally:
                    # Not kept while this thread waits for more: an idle getter's last range
                    # held its buffer (8 MiB) alive after the reader had given it back.
                    del fetched
                    with self._lock:
                        self._active -= 1
                        gets, budget = self._reach.gets, self._reach.bytes
                        self._adapt()
                        if self._parts:  # the GET this thread made room for, and any the reach added
                            self._work.notify(1 + max(0, self._reach.gets - gets))
                        if self._reach.bytes > budget:
                            self._room.notify()
        except BaseException as exc:
            self._fail(exc)

    def _adapt(self) -> None:
        """Let the reach look at the window that may have ended (called with the lock held)."""
        held_back = (bool(self._parts) and self._active >= self._reach.gets) or self._budget_blocked
        if self._reach.look(time.monotonic(), self.metrics.wait_seconds, self.metrics.bytes, held_back):
            self.metrics.peak("gets_in_flight", self._reach.gets)

    def _fetch_part(self, fetched: Fetched[C], number: int, start: int, end: int) -> None:
        error: BaseException | None = None
        try:
            out = fetched.buffer[start - fetched.start : end - fetched.start]
            fetch_range_into(self.session, self.bucket, fetched.obj, start, end, out)
        except BaseException as exc:
            error = exc
        finally:
            fetched.parts.arrive(number, error)

    def __iter__(self) -> Generator[Fetched[C], None, None]:
        try:
            while True:
                with self._lock:
                    while not self._slots:
                        self.check()
                        self._handed.wait(_POLL)
                    slot = self._slots.popleft()
                if slot is None:
                    return
                waited = time.perf_counter()
                while not slot.located.wait(_POLL):
                    self.check()
                self.metrics.add(wait_seconds=time.perf_counter() - waited)
                if slot.fetched is not None:
                    self._release(slot.fetched.end - slot.fetched.start)
                with self._lock:
                    self._reach.start(time.monotonic(), self.metrics.wait_seconds, self.metrics.bytes)
                if slot.error is not None:
                    raise slot.error
                assert slot.fetched is not None
                yield slot.fetched
        except GeneratorExit:  # abandoned: stop fetching (handed ranges may still be arriving otherwise)
            self.close()
            raise

    def close(self) -> None:
        """Stop fetching and end the threads, waiting about a second at most. Safe from any
        thread, the fetcher's own included: a pipeline dropped unclosed may be collected there."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._failure = None  # raised, its traceback holds this fetcher: kept, only the cyclic GC would free them
            self._parts.clear()  # queued parts hold their ranges, which hold this fetcher
            self._slots.clear()  # and so do the ranges not handed out: a cycle only the garbage collector frees
            self._wake_all()
        self.session.cancel.set()  # requests waiting to retry give up at once
        deadline = time.monotonic() + _CLOSE_WITHIN
        for pool in (self._threads, self._locators, self._getters):
            if pool is not None:
                pool.shutdown(join=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_head(session: ReadSession, bucket: str, obj: Object, offset: int, size: int) -> _Head:
    """Start fetching the first bytes of a range that starts at ``offset`` of an object of
    ``size`` bytes (a small object whole), on a daemon thread: before the range is located."""
    stop = size if size - offset < _FIRST_PART + _MIN_TAIL else offset + _FIRST_PART
    return offset, stop, in_daemon_thread(partial(fetch_range, session, bucket, obj, offset, stop))
