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

import os
from enum import IntEnum
from typing import Any

import torch

from remote_loader.pipeline.state.file_lock import FileLock
from remote_loader.pipeline.state.passes import PassTable, pass_key


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


_TABLE = Slot.IN_WORKERS + 1  # from here: the table of passes (``passes.PassTable``)


class EpochClock:
    """A dataset's epochs (see the module's docstring), shared with its DataLoader workers."""

    def __init__(self, epoch: int = 0, auto: bool = True) -> None:
        self.shared = torch.zeros(_TABLE + PassTable.SIZE, dtype=torch.int64).share_memory_()
        self.shared[Slot.EPOCH] = self.shared[Slot.NEXT] = epoch
        self.shared[Slot.AUTO] = int(auto)
        self.shared[Slot.PASS] = -1
        self.passes.clear()
        self.lock = FileLock("remote-loader-epochs")

    @property
    def passes(self) -> PassTable:
        """The passes under way, in the shared numbers after the slots."""
        return PassTable(self.shared[_TABLE:])

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
                base, worker, workers = pass_key(worker_info), int(worker_info.id), int(worker_info.num_workers)
                joined = self.passes.join(base, workers, worker)
                if joined is not None:
                    return joined
            epoch = own if own is not None else int(shared[Slot.NEXT])
            if worker_info is not None:
                self.passes.record(base, workers, worker, epoch)
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
