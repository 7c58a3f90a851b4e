"""Which item each of an upload's task threads is reading, and the watch over them.

Every task thread holds a row of a small table shared with the process that started the
upload: its process id, its task, the item it is reading and since when. That process looks
at the table as it waits for results: an item that takes long is named in a warning, and one
past ``stall_timeout`` ends the upload with an ``UploadError`` naming it, instead of a wait
for ever on a worker that stopped making progress (a dataset blocked on a lock, a thread pool
that did not survive ``fork``). Writing a row costs a few stores to shared memory per item.

A row is taken and freed under the table's lock, and the watch copies the table under it:
a row half written (its process set, its item and time not yet) is never read as an item
read since the clock's zero. An item's time is stored before its index, so a row read
between the two is between items.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from remote_loader.storage.retrying import Cancelled

log = logging.getLogger("remote_loader")

DEFAULT_STALL_TIMEOUT = 600.0
"""Seconds one item may take to be read and encoded before the upload ends, naming it."""

_WARN_AFTER = 60.0
_PID, _TASK, _INDEX, _SINCE, _WAITING = range(5)
_COLUMNS = 5
_BETWEEN = -1.0  # a row's task runs, between items (writing a shard, committing it)
_FREE = (0.0, 0.0, _BETWEEN, 0.0, 0.0)
_TURN_POLL = 0.1  # seconds between looks at stop and Ctrl-C while an item waits for its turn
_READ_LOCK_SECONDS = 1.0  # the watch skips a look it cannot take the lock for (a holder killed while holding it)


class Slots:
    """The table: a row per task thread that can run at once, a flag that tells the threads
    to start no new task, and one that tells them to stop at their next item (Ctrl-C). Shared
    with worker processes (``context`` given: passed to them as they start) or within this
    process.

    Args:
        rows: Task threads that can run at once.
        context: The worker processes' multiprocessing context; None within this process.
    """

    def __init__(self, rows: int, context: Any = None) -> None:
        if context is None:
            self._raw: Any = bytearray(rows * _COLUMNS * 8)
            self._lock: Any = threading.Lock()
            self._stop: Any = threading.Event()
            self._interrupted: Any = bytearray(1)
        else:
            self._raw, self._lock = context.RawArray("d", rows * _COLUMNS), context.Lock()
            # Read at every item without a lock: a worker killed while holding an Event's
            # lock would leave every other one blocked at its next item.
            self._stop, self._interrupted = context.Event(), context.RawArray("b", 1)
        self._table: np.ndarray | None = None
        self.table[:] = _FREE

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}

    @property
    def table(self) -> np.ndarray:
        if self._table is None:
            self._table = np.frombuffer(self._raw, dtype=np.float64).reshape(-1, _COLUMNS)
        return self._table

    def copy(self) -> np.ndarray | None:
        """The table as it stands between rows being taken and freed; None where its lock
        was not free within a second (the next look tries again)."""
        if not self._lock.acquire(timeout=_READ_LOCK_SECONDS):
            return None
        try:
            return self.table.copy()
        finally:
            self._lock.release()

    def stop(self) -> None:
        """Tell every task thread to start no new task (those running finish)."""
        self._stop.set()

    def interrupt(self) -> None:
        """Ctrl-C in the upload's process: every task thread stops at its next item, and none
        starts. A worker process gets no SIGINT of its own where only the upload's process was
        sent one (``kill -INT``)."""
        self._interrupted[0] = 1
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return bool(self._stop.is_set())

    @contextmanager
    def task(self, task_id: int, turn: Any = None, stop: threading.Event | None = None) -> Iterator[Reading]:
        """Hold a row while task ``task_id`` runs; what it reads goes in it. ``turn`` and
        ``stop``: as ``Reading`` takes them."""
        pid, row = os.getpid(), None
        with self._lock:
            free = np.flatnonzero(self.table[:, _PID] == 0)
            if len(free):
                row = int(free[0])
                self.table[row] = (pid, task_id, _BETWEEN, time.monotonic(), 0.0)
        try:
            yield Reading(self.table, row, self._interrupted, turn, stop)
        finally:
            if row is not None:
                with self._lock:
                    self.table[row] = _FREE


class Reading:
    """A task thread's row: the item it reads, from ``item(index)`` until it ends; whether the
    upload was interrupted (``Slots.interrupt``); and its process's turns at ``ds[i]``.

    Args:
        table: The watch's table (None: unwatched).
        row: This thread's row of it (None: unwatched).
        interrupted: Set on Ctrl-C (``Slots``'s flag).
        turn: The lock that the task threads of a process hold in turns around ``ds[i]``
            (None: no turns).
        stop: Set when the task is to stop at its next item: an item waiting for its turn
            stops waiting.
    """

    def __init__(self, table: np.ndarray | None, row: int | None, interrupted: Any = None, turn: Any = None,
                 stop: threading.Event | None = None) -> None:
        self.table, self.row, self._interrupted = table, row, interrupted
        self._turn, self._stop = turn, stop

    @property
    def interrupted(self) -> bool:
        return self._interrupted is not None and bool(self._interrupted[0])

    @contextmanager
    def item(self, index: int) -> Iterator[None]:
        if self.table is None or self.row is None:
            yield
            return
        self.table[self.row, _SINCE] = time.monotonic()  # before the index: a reader never pairs it with an old time
        self.table[self.row, _INDEX] = index
        try:
            yield
        finally:
            self.table[self.row, _INDEX] = _BETWEEN

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the process's turn at ``ds[i]``, waiting for it (marked in the row) while
        another task thread holds it; ``Cancelled`` where the task is told to stop meanwhile."""
        if self._turn is None:
            yield
            return
        if not self._turn.acquire(blocking=False):
            self._wait_turn()
        try:
            yield
        finally:
            self._turn.release()

    def _wait_turn(self) -> None:
        self._mark(waiting=True)
        try:
            while not self._turn.acquire(timeout=_TURN_POLL):
                if self._stopping():
                    raise Cancelled("a task stopped as its item waited for its turn at ds[i]: the upload is stopping")
            if self._stopping():  # the turn came once the upload had ended (a stalled ds[i] returned at last)
                self._turn.release()
                raise Cancelled("a task stopped as its item's turn at ds[i] came: the upload is stopping")
        finally:
            self._mark(waiting=False)

    def _stopping(self) -> bool:
        return self.interrupted or (self._stop is not None and self._stop.is_set())

    def _mark(self, waiting: bool) -> None:
        if self.table is None or self.row is None:
            return
        if not waiting:  # the item's time starts with its turn; stored first: never paired with the wait's start
            self.table[self.row, _SINCE] = time.monotonic()
        self.table[self.row, _WAITING] = float(waiting)


UNWATCHED = Reading(None, None)


@dataclass(frozen=True)
class Stalled:
    """An item past ``stall_timeout``: which, in which process and task, for how long."""

    index: int
    pid: int
    task: int
    seconds: float


class Watch:
    """The upload's view of the table: warns of an item that takes long (once each), and
    names the first past ``stall_timeout`` (None: only warns).

    Args:
        slots: The table the task threads write.
        stall_timeout: Seconds an item may take; None waits for ever.
        here: The tasks run in this process (threads), not in worker processes.
    """

    def __init__(self, slots: Slots, stall_timeout: float | None, here: bool = False) -> None:
        self.slots, self.stall_timeout, self.here = slots, stall_timeout, here
        self.warn_after = _WARN_AFTER if stall_timeout is None else min(_WARN_AFTER, stall_timeout / 2)
        self._warned: set[tuple[float, ...]] = set()
        self.stalled: list[Stalled] = []

    def where(self, pid: int) -> str:
        return "this process" if self.here else f"worker process {pid}"

    def check(self) -> Stalled | None:
        """Warn of items read for long (each once); the first item past the bound not reported before, or None."""
        table = self.slots.copy()
        if table is None:
            return None
        now = time.monotonic()
        reading = (table[:, _PID] != 0) & (table[:, _INDEX] >= 0) & (table[:, _WAITING] == 0)
        for pid, task, index, since, _ in table[reading]:
            seconds, key = now - since, (pid, task, index, since)
            if seconds > self.warn_after and key not in self._warned:
                self._warned.add(key)
                log.warning("upload: ds[%d] has taken %.0f s so far in %s (task %d)%s", index, seconds,
                            self.where(int(pid)), task, "" if self.stall_timeout is None else
                            f"; past stall_timeout={self.stall_timeout:g} s the upload ends, naming it")
            if self.stall_timeout is not None and seconds > self.stall_timeout \
                    and not any(s.pid == pid and s.index == index for s in self.stalled):
                self.stalled.append(Stalled(int(index), int(pid), int(task), seconds))
                return self.stalled[-1]
        return None

    def busy(self) -> bool:
        """Whether a task is running that has not stalled (it will finish: worth waiting for)."""
        table = self.slots.copy()
        if table is None:
            return False  # its lock held past a second: a holder that died holding it, nothing to wait for
        stalled = {(s.pid, s.index) for s in self.stalled}
        held_up = {s.pid for s in self.stalled}  # an item waiting for its turn there waits for the stalled one
        return any(pid and (pid, index) not in stalled and not (waiting and pid in held_up)
                   for pid, _, index, _, waiting in table)

    def error_for(self, stalled: Stalled) -> str:
        """The message of the ``UploadError`` that ends the upload for ``stalled``."""
        ended = "its thread is left to end by itself" if self.here else "the process was ended"
        return (f"ds[{stalled.index}] took more than stall_timeout={self.stall_timeout:g} s in"
                f" {self.where(stalled.pid)} (task {stalled.task}): it stopped making progress and {ended}"
                " (a dataset that blocks, or a library thread pool that did not survive fork); finished tasks are"
                " kept: run the same upload again to resume, or pass a larger stall_timeout (None waits for ever)")
