"""Which epoch each iteration of a ``RemoteDataset`` follows, and which loaded state it
resumes from, in whatever process it runs: a few numbers in shared memory, made with the
dataset, carry what the main process sets to DataLoader workers started later, persistent
ones included.

Until ``set_epoch`` is called, every iteration takes the next epoch by itself (0, 1, 2...;
after a loaded state, that state's epoch and then the ones after it). The workers of one
DataLoader pass each begin an iteration and must agree on its epoch: a pass is known by its
loader's base seed (``worker_info.seed - worker_info.id``) and number of workers, and each
worker joins its loader's latest pass recorded if it has not begun an iteration in it yet and
the worker that recorded it is still running (the workers of a pass begin together), else
records a new one with the next epoch. The last ``PASSES`` passes are kept, a row each, so
that another loader's pass (or an iteration in the main process) made while a loader's
workers begin does not take that loader's pass away from its late workers. Persistent
workers (one base seed for all passes) and a DataLoader made anew with the same seeded
generator (the same base seed again) each begin a pass's iteration once, so their next pass
is a new one. After ``set_epoch(e)``, iterations
follow ``e`` exactly.

A DataLoader worker that loaded its own state (torchdata's StatefulDataLoader restores each
worker so, right before the pass that goes on from it) follows that state's epoch in its
next iteration, whatever the epoch set: the workers of the restored pass finish the epoch of
their checkpoint (those whose share was done yield nothing), and the pass after it takes the
next epoch, or the one set.
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

from remote_loader.errors import ResumeError
from remote_loader.pipeline.resume import MAX_WORKERS, Loaded


class Slot(IntEnum):
    """The numbers in shared memory."""

    EPOCH = 0  # the epoch set_epoch chose, or a loaded state's
    AUTO = 1  # 1 while set_epoch was never called: each iteration takes the next epoch
    NEXT = 2  # that next epoch
    PASS = 3  # the pass that took an epoch last: its loader's base seed (-2: one in the main process; -1: none),
    PASS_WORKERS = 4  # its number of workers,
    PASS_EPOCH = 5  # the epoch it took,
    PASS_PID = 6  # and the process of the worker that recorded it
    GENERATION = 7  # how many states the main process loaded
    IN_WORKERS = 8  # 1 once DataLoader workers iterated: the main process cannot be asked for their state


_APPLIED = Slot.IN_WORKERS + 1  # per worker from here: the generation of the last loaded state it applied
_TABLE = _APPLIED + MAX_WORKERS  # from here: the passes of DataLoaders begun last, a row each


class Row(IntEnum):
    """A row of the table of passes: several DataLoaders over one dataset may be in a pass at
    once (one begun while another's workers are still beginning), each known by its own row."""

    BASE = 0  # the loader's base seed (-1: a free row)
    WORKERS = 1  # its number of workers
    EPOCH = 2  # the epoch the pass took
    PID = 3  # the process of the worker that recorded it
    STAMP = 4  # when it was recorded, in passes recorded: the oldest row is the one written over
    JOINED = 5  # per worker from here: 1 once it began its iteration of this pass


PASSES = 8
"""Passes of DataLoaders remembered at once: a loader's worker that begins late finds its
pass while fewer than this many other passes began since."""
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


class Epochs:
    """A dataset's epochs and loaded state (see the module's docstring), and the live stream
    of this process, which gives its state."""

    def __init__(self, epoch: int = 0, auto: bool = True) -> None:
        self.shared = torch.zeros(_TABLE + PASSES * _WIDTH, dtype=torch.int64).share_memory_()
        self.shared[Slot.EPOCH] = self.shared[Slot.NEXT] = epoch
        self.shared[Slot.AUTO] = int(auto)
        self.shared[Slot.PASS] = -1
        self._table()[:, Row.BASE] = -1
        self.lock = _FileLock()
        self.loaded: Loaded | None = None
        self.local = False  # the loaded state was loaded in this process, a DataLoader worker, for itself
        self.generation = 0  # the main process's loads this copy knows of
        self.live: Any = None  # the latest stream of this process

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["live"] = None  # a stream stays in its process
        if self.loaded is None:  # states loaded since in another process (a decoding process), applied there
            state["generation"] = max(self.generation, int(self.shared[Slot.GENERATION]))
        return state

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

    def _own_epoch(self) -> int | None:
        """The epoch of the state a DataLoader worker loaded for itself, while unused."""
        return self.loaded.epoch if self.local and self.loaded is not None else None

    def next_in_this_process(self) -> int:
        """The epoch the next iteration in this process follows (before it begins)."""
        own = self._own_epoch()
        return own if own is not None else self.epoch

    def begin(self, worker_info: Any) -> int:
        """The epoch of an iteration beginning now in this process."""
        if worker_info is not None:
            self.shared[Slot.IN_WORKERS] = 1
        own = self._own_epoch()
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
        """A new pass of this loader, taking ``epoch``, begun by ``worker``: written over the oldest row."""
        table = self._table()
        row = table[int(torch.argmin(table[:, Row.STAMP]))]
        row.zero_()
        row[Row.BASE], row[Row.WORKERS], row[Row.EPOCH], row[Row.PID] = base, workers, epoch, os.getpid()
        row[Row.STAMP] = int(table[:, Row.STAMP].max()) + 1
        row[Row.JOINED + worker] = 1

    def set_epoch(self, epoch: int) -> None:
        owed = self.owed()
        if owed is not None and owed.epoch != epoch:
            raise ResumeError(f"the loaded state stopped mid-way through epoch {owed.epoch} and its rest has not been"
                              f" iterated: set_epoch({owed.epoch}) and finish it first, or make a new dataset to start"
                              f" epoch {epoch} without it")
        self.shared[Slot.EPOCH] = epoch
        self.shared[Slot.AUTO] = 0
        if self.loaded is not None and self.loaded.epoch != epoch:
            self.loaded = None

    def owed(self) -> Loaded | None:
        """A loaded mid-epoch state whose rest no iteration has taken yet."""
        loaded = self.loaded
        if loaded is None or not loaded.pending:
            return None
        if not self.local and bool((self.shared[_APPLIED:] >= self.generation).any()):
            return None
        return loaded

    # ------------------------------------------------------------------ loaded states

    def hold(self, loaded: Loaded, in_worker: bool) -> None:
        """Hold ``loaded`` for the next iteration of its epoch: in this process only for a
        DataLoader worker's own, else here and in the DataLoader workers started from now on
        (an iteration that takes its epoch by itself takes the next one after a finished state)."""
        self.loaded, self.local, self.live = loaded, in_worker, None
        if in_worker:
            return
        self.shared[Slot.EPOCH] = loaded.epoch
        self.shared[Slot.NEXT] = loaded.epoch + int(loaded.finished)
        self.shared[Slot.GENERATION] += 1
        self.generation = int(self.shared[Slot.GENERATION])

    def applying(self, epoch: int, worker: int) -> Loaded | None:
        """The loaded state worker ``worker``'s iteration of ``epoch`` resumes from: at the first
        iteration of its epoch only (``applied`` marks it used)."""
        if int(self.shared[Slot.GENERATION]) != self.generation:
            raise ResumeError("load_state_dict was called after this DataLoader's persistent workers started;"
                              " load the state before the first epoch, or create a new DataLoader")
        loaded = self.loaded
        if loaded is None:
            return None
        if not self.local:
            applied = int(self.shared[_APPLIED + worker]) >= self.generation
            return loaded if loaded.epoch == epoch and not applied else None
        if loaded.epoch != epoch:
            if loaded.pending:
                raise ResumeError(f"the loaded state stopped mid-way through epoch {loaded.epoch}, but this iteration"
                                  f" is epoch {epoch}: call set_epoch({loaded.epoch}) first")
            self.loaded = None  # a state of a finished epoch is used up by any later iteration
        return self.loaded

    def applied(self, loaded: Loaded | None, worker: int) -> None:
        """Mark ``loaded`` used by ``worker``."""
        if loaded is None:
            return
        if self.local:
            self.loaded = None
        else:
            self.shared[_APPLIED + worker] = self.generation

    def counted_before(self, epoch: int) -> list[int] | None:
        """The samples each worker had delivered where ``epoch`` resumed from a count state
        loaded here, if it did; ResumeError where it resumed from workers' own or gathered
        states, whose rest a count of items cannot place (which of it was delivered depends
        on where each worker stood, which only the workers' states say)."""
        loaded = self.loaded
        if self.local or loaded is None or loaded.epoch != epoch:
            return None
        if loaded.rest is not None or any(s.remaining is not None for s in loaded.own.values()):
            raise ResumeError(f"epoch {epoch} resumed from workers' own or gathered states: a count state cannot say"
                              " which of its rest was delivered; checkpoint it with the StatefulDataLoader's"
                              " state_dict(), or count from the next epoch")
        if not loaded.own:
            return None
        return [loaded.own[w].delivered for w in sorted(loaded.own)]

    # ------------------------------------------------------------------ the live stream's state

    def state(self, worker_info: Any) -> dict[str, Any] | None:
        """The state of this process's live stream; None if there is none yet."""
        if self.live is not None:
            return dict(self.live.get_state())
        if worker_info is None and int(self.shared[Slot.IN_WORKERS]):
            raise ResumeError("this dataset's iteration runs in DataLoader workers, which this process cannot ask:"
                              " use torchdata's StatefulDataLoader and its state_dict(), or pass consumed= and"
                              " num_workers= for a plain DataLoader")
        return None
