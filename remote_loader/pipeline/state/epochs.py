"""Which epoch each iteration of a ``RemoteDataset`` follows, in whatever process it runs: a
few numbers in shared memory, made with the dataset, carry what the main process sets to
DataLoader workers started later, persistent ones included. (Which loaded state an iteration
resumes from is ``resume/handover.py``'s; the live stream is the dataset's.)

Until ``set_epoch`` is called, every iteration takes the next epoch by itself (0, 1, 2...;
after a loaded state, that state's epoch and then the ones after it). The workers of one
DataLoader pass each begin an iteration and must agree on its epoch: a pass is known by its
loader's base seed (``worker_info.seed - worker_info.id``) and number of workers, and each
worker joins its loader's latest pass recorded if it has not begun an iteration in it yet and
the worker that recorded it is still running (the workers of a pass begin together), else
records a new one with the next epoch. Each pass is a row of a table of ``PASSES`` rows, kept
while the pass can still have a late worker: until every worker of it has begun, or the
process that recorded it has ended. So however many other loaders make passes (a new eval
DataLoader per evaluation), or iterations run in the main process, while a loader's workers
begin, its late workers find its pass. Where more than ``PASSES`` loaders are each waiting
for a worker to begin, one more cannot record its pass without taking one of theirs away: it
raises ``ConfigError`` instead (``set_epoch`` before each pass needs no table). Persistent
workers (one base seed for all passes) and a DataLoader made anew with the same seeded
generator (the same base seed again) each begin a pass's iteration once, so their next pass
is a new one. After ``set_epoch(e)``, iterations follow ``e`` exactly.

A DataLoader worker that loaded its own state (torchdata's StatefulDataLoader restores each
worker so, right before the pass that goes on from it) follows that state's epoch in its
next iteration, whatever the epoch set (``begin(..., own=...)``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from enum import IntEnum
from typing import Any

import torch

from remote_loader.config import MAX_WORKERS
from remote_loader.errors import ConfigError


class Slot(IntEnum):
    """The numbers in shared memory."""

    EPOCH = 0  # the epoch set_epoch chose, or a loaded state's
    AUTO = 1  # 1 while set_epoch was never called: each iteration takes the next epoch
    NEXT = 2  # that next epoch
    PASS = 3  # the pass that took an epoch last: its loader's base seed (-2: one in the main process; -1: none),
    PASS_WORKERS = 4  # its number of workers,
    PASS_EPOCH = 5  # the epoch it took,
    PASS_PID = 6  # and the process of the worker that recorded it
    IN_WORKERS = 7  # 1 once DataLoader workers iterated: the main process cannot be asked for their state


_TABLE = Slot.IN_WORKERS + 1  # from here: the passes of DataLoaders begun last, a row each


class Row(IntEnum):
    """A row of the table of passes: several DataLoaders over one dataset may be in a pass at
    once (one begun while another's workers are still beginning), each known by its own row."""

    BASE = 0  # the loader's base seed (-1: a free row)
    WORKERS = 1  # its number of workers
    EPOCH = 2  # the epoch the pass took
    PID = 3  # the process of the worker that recorded it
    STAMP = 4  # when it was recorded, in passes recorded: of the rows free, the oldest is written over
    JOINED = 5  # per worker from here: 1 once it began its iteration of this pass


PASSES = 8
"""Passes of DataLoaders whose workers may still begin, remembered at once: a pass whose
workers have all begun, or whose recorder has ended, frees its row for the next."""
_WIDTH = Row.JOINED + MAX_WORKERS


def _running(pid: int) -> bool:
    """Whether process ``pid`` is running (a worker of a pass that ended has exited)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child that exits normally
        with contextlib.suppress(OSError):
            os.unlink(path)


class _FileLock:
    """A lock among a process and the DataLoader workers it starts, forked or spawned: an
    exclusive ``flock`` on a file named when the lock is made (created on first use, removed
    with the lock in the process that made it). A multiprocessing lock is tied to one start
    method, and the loader's is not known when a dataset is made."""

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.gettempdir(), f"remote-loader-epochs-{uuid.uuid4().hex}")
        weakref.finalize(self, _remove, self.path, os.getpid())

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}  # a copy uses the file, never removes it

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with open(self.path, "a") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            yield  # closing the file releases the lock


class EpochClock:
    """A dataset's epochs (see the module's docstring), shared with its DataLoader workers."""

    def __init__(self, epoch: int = 0, auto: bool = True) -> None:
        self.shared = torch.zeros(_TABLE + PASSES * _WIDTH, dtype=torch.int64).share_memory_()
        self.shared[Slot.EPOCH] = self.shared[Slot.NEXT] = epoch
        self.shared[Slot.AUTO] = int(auto)
        self.shared[Slot.PASS] = -1
        self._table()[:, Row.BASE] = -1
        self.lock = _FileLock()

    @property
    def auto(self) -> bool:
        """Whether iterations take the next epoch by themselves (``set_epoch`` never called)."""
        return bool(int(self.shared[Slot.AUTO]))

    @property
    def epoch(self) -> int:
        """The epoch the next iteration follows."""
        return int(self.shared[Slot.NEXT if self.auto else Slot.EPOCH])

    @property
    def current(self) -> int:
        """The epoch of the iteration under way (the latest begun), else of the next one."""
        if self.auto and int(self.shared[Slot.PASS]) != -1:
            return int(self.shared[Slot.PASS_EPOCH])
        return self.epoch

    @property
    def in_workers(self) -> bool:
        """Whether DataLoader workers have iterated (whose streams this process cannot ask)."""
        return bool(int(self.shared[Slot.IN_WORKERS]))

    def begin(self, worker_info: Any, own: int | None = None) -> int:
        """The epoch of an iteration beginning now in this process; ``own``: the epoch of the
        state a DataLoader worker loaded for itself, which it follows."""
        if worker_info is not None:
            self.shared[Slot.IN_WORKERS] = 1
        if not self.auto:
            return own if own is not None else int(self.shared[Slot.EPOCH])
        shared = self.shared
        with self.lock.held():
            if worker_info is not None:
                base, worker = (int(worker_info.seed) - int(worker_info.id)) % 2**62, int(worker_info.id)
                joined = self._join(base, int(worker_info.num_workers), worker)
                if joined is not None:
                    return joined
            epoch = own if own is not None else int(shared[Slot.NEXT])
            if worker_info is not None:
                self._record(base, int(worker_info.num_workers), worker, epoch)
                shared[Slot.PASS], shared[Slot.PASS_WORKERS] = base, worker_info.num_workers
                shared[Slot.PASS_PID] = os.getpid()
            else:
                shared[Slot.PASS] = -2
            shared[Slot.PASS_EPOCH], shared[Slot.NEXT] = epoch, epoch + 1
            return epoch

    def set_epoch(self, epoch: int) -> None:
        """Iterations follow ``epoch`` from now on."""
        self.shared[Slot.EPOCH] = epoch
        self.shared[Slot.AUTO] = 0

    def seek(self, epoch: int, finished: bool) -> None:
        """A state of ``epoch`` was loaded: the next iteration follows it (set or not), or,
        taking its epoch by itself, the one after it where ``finished``."""
        self.shared[Slot.EPOCH] = epoch
        self.shared[Slot.NEXT] = epoch + int(finished)

    def _table(self) -> torch.Tensor:
        return self.shared[_TABLE:].view(PASSES, _WIDTH)

    def _join(self, base: int, workers: int, worker: int) -> int | None:
        """The epoch of this loader's pass under way, which ``worker`` joins; None where it has
        none (every worker of the pass recorded began already, or its recorder has ended)."""
        table = self._table()
        for index in torch.argsort(table[:, Row.STAMP], descending=True).tolist():  # the latest first
            row = table[index]  # a view: what is set in it is set in shared memory
            if (int(row[Row.BASE]) == base and int(row[Row.WORKERS]) == workers
                    and not int(row[Row.JOINED + worker]) and _running(int(row[Row.PID]))):
                row[Row.JOINED + worker] = 1
                return int(row[Row.EPOCH])
        return None

    def _record(self, base: int, workers: int, worker: int, epoch: int) -> None:
        """A new pass of this loader, taking ``epoch``, begun by ``worker``: written over the
        oldest row free (see ``_free``); ConfigError where none is."""
        table = self._table()
        free = [index for index in range(PASSES) if _free(table[index])]
        if not free:
            raise ConfigError(
                f"{PASSES} DataLoaders over this dataset each have a worker yet to begin its pass, and one more pass"
                " cannot begin without mixing epochs into theirs: call dataset.set_epoch(epoch) before each pass,"
                f" or start the workers of at most {PASSES} DataLoaders at once")
        row = table[min(free, key=lambda index: int(table[index, Row.STAMP]))]
        row.zero_()
        row[Row.BASE], row[Row.WORKERS], row[Row.EPOCH], row[Row.PID] = base, workers, epoch, os.getpid()
        row[Row.STAMP] = int(table[:, Row.STAMP].max()) + 1
        row[Row.JOINED + worker] = 1


def _free(row: torch.Tensor) -> bool:
    """Whether a row of the table may be written over: its pass can have no late worker any
    more (every worker of it began, or the process that recorded it has ended), or it holds none."""
    if int(row[Row.BASE]) == -1:
        return True
    workers = int(row[Row.WORKERS])
    return bool(row[Row.JOINED:Row.JOINED + workers].all()) or not _running(int(row[Row.PID]))
