"""Fetch byte ranges of objects ahead of use: parallel ranged GETs, a byte budget, retries.

Knows nothing of the format: a job names an object and, through a callable run in a
background thread, the byte range to fetch; the pipeline supplies that callable.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from remote_loader.config import FetchConfig
from remote_loader.errors import TransientStorageError
from remote_loader.storage import Store

T = TypeVar("T")


@dataclass
class Metrics:
    """Counters of one process's loading; ``as_dict()`` gives a snapshot.

    Attributes:
        gets: GET requests made (ranged parts and indexes), retries included.
        bytes: Bytes received.
        retries: Requests repeated after a transient fault.
        wait_seconds: Time the consumer waited for storage.
        user_seconds: Time spent in the pipeline's stages (decode, user code).
        samples: Samples produced by the source.
        skipped: Samples skipped because their bytes stayed corrupt (``on_error="skip"``).
        peak_buffered: Most shard bytes held at once (in flight or unread).
    """

    gets: int = 0
    bytes: int = 0
    retries: int = 0
    wait_seconds: float = 0.0
    user_seconds: float = 0.0
    samples: int = 0
    skipped: int = 0
    peak_buffered: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __getstate__(self) -> dict[str, Any]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


def with_retries(call: Callable[[], T], config: FetchConfig, metrics: Metrics) -> T:
    """Run ``call``; on a transient storage fault retry with exponential backoff and full jitter."""
    for attempt in range(1, config.max_attempts + 1):
        try:
            return call()
        except TransientStorageError:
            if attempt == config.max_attempts:
                raise
            metrics.add(retries=1)
            time.sleep(random.uniform(0, config.backoff * 2 ** (attempt - 1)))  # backoff between attempts
    raise AssertionError("unreachable")


def fetch_range(store: Store, bucket: str, key: str, start: int, end: int, config: FetchConfig, metrics: Metrics) -> bytes:
    """One ranged GET with retries, counted in ``metrics``."""

    def call() -> bytes:
        metrics.add(gets=1)
        return store.get_range(bucket, key, start, end)

    data = with_retries(call, config, metrics)
    metrics.add(bytes=len(data))
    return data


@dataclass
class Job:
    """One object to fetch part of; ``locate()`` returns ``(start, end, context)``."""

    key: str
    locate: Callable[[], tuple[int, int, Any]]


@dataclass
class Fetched:
    """A fetched range: ``buffer`` holds bytes ``[start, end)`` of ``key``."""

    key: str
    start: int
    end: int
    context: Any
    buffer: bytearray = field(repr=False)


class _Slot:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.fetched: Fetched | None = None
        self.parts_left = 0
        self.lock = threading.Lock()


class Prefetcher:
    """Fetch ``jobs`` in order, ahead of the consumer, within ``config.prefetch_bytes``.

    Iterate to get ``Fetched`` ranges in job order. The budget bounds the bytes being
    fetched or fetched and not yet handed out; a range leaves it when the iterator hands
    it to the consumer, who then owns that memory. ``close()`` (also on leaving a ``with``
    block, or when an iteration ends or is abandoned) stops the threads.
    """

    def __init__(self, store: Store, bucket: str, jobs: Iterable[Job], config: FetchConfig, metrics: Metrics) -> None:
        self.store, self.bucket, self.config, self.metrics = store, bucket, config, metrics
        self._jobs = iter(jobs)
        self._slots: deque[_Slot | None] = deque()  # None marks the end of the jobs
        self._cond = threading.Condition()
        self._held = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="remote-loader-get")
        self._scheduler = threading.Thread(target=self._schedule, name="remote-loader-prefetch", daemon=True)
        self._scheduler.start()

    def _reserve(self, size: int) -> bool:
        with self._cond:
            # A range larger than the whole budget is fetched alone rather than never.
            while not self._closed and self._held and self._held + size > self.config.prefetch_bytes:
                self._cond.wait()
            if self._closed:
                return False
            self._held += size
            self.metrics.peak_buffered = max(self.metrics.peak_buffered, self._held)
            return True

    def _release(self, size: int) -> None:
        with self._cond:
            self._held -= size
            self._cond.notify_all()

    def _schedule(self) -> None:
        for job in self._jobs:
            slot = _Slot(job)
            with self._cond:
                if self._closed:
                    return
                self._slots.append(slot)
                self._cond.notify_all()
            try:
                start, end, context = job.locate()
            except BaseException as exc:  # handed to the consumer, in order
                slot.error = exc
                slot.done.set()
                return
            if not self._reserve(end - start):
                return
            slot.fetched = Fetched(job.key, start, end, context, bytearray(end - start))
            parts = range(start, end, self.config.part_size)
            slot.parts_left = len(parts)
            if not parts:
                slot.done.set()
            for part in parts:
                self._pool.submit(self._fetch_part, slot, part, min(part + self.config.part_size, end))
        with self._cond:
            self._slots.append(None)
            self._cond.notify_all()

    def _fetch_part(self, slot: _Slot, start: int, end: int) -> None:
        fetched = slot.fetched
        assert fetched is not None
        try:
            if slot.error is None:
                data = fetch_range(self.store, self.bucket, fetched.key, start, end, self.config, self.metrics)
                fetched.buffer[start - fetched.start : end - fetched.start] = data
        except BaseException as exc:
            slot.error = exc
        with slot.lock:
            slot.parts_left -= 1
            if slot.parts_left == 0:
                slot.done.set()

    def __iter__(self) -> Iterator[Fetched]:
        try:
            while True:
                with self._cond:
                    while not self._slots:
                        self._cond.wait()
                    slot = self._slots.popleft()
                if slot is None:
                    return
                waited = time.perf_counter()
                slot.done.wait()
                self.metrics.add(wait_seconds=time.perf_counter() - waited)
                if slot.fetched is not None:
                    self._release(slot.fetched.end - slot.fetched.start)
                if slot.error is not None:
                    raise slot.error
                assert slot.fetched is not None
                yield slot.fetched
        finally:
            self.close()

    def close(self) -> None:
        """Stop fetching and end the threads (waits for GETs already running)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._scheduler.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
