"""``Checkpoints``: a ``RemoteDataset``'s states and epochs, the entry of the ``resume``
subpackage (see its docstring for the contract).

It owns what a state touches across processes: slots in shared memory made with the
dataset (``Slot``: the epoch, how many states were loaded, whether DataLoader workers
iterated, which worker applied which load, the pass that took an epoch last), so that what
the main process loads or sets reaches workers started later, persistent ones included.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import re
import tempfile
import uuid
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from remote_loader.errors import ResumeError
from remote_loader.pipeline.resume.counts import MAX_WORKERS, ResumeState, consumed_per_worker
from remote_loader.pipeline.resume.layout import Layout
from remote_loader.pipeline.resume.states import (
    Remainder,
    WorkerState,
    find_states,
    gather,
    parse,
    steps_since_snapshot,
)
from remote_loader.pipeline.split import Plan, worker_bounds


class Slot(IntEnum):
    """The slots of a dataset's state in shared memory, which reaches every DataLoader worker."""

    EPOCH = 0  # the epoch set_epoch chose, or a loaded state's
    GENERATION = 1  # how many states were loaded
    IN_WORKERS = 2  # 1 once DataLoader workers iterated: this process cannot be asked for their state
    AUTO = 3  # 1 while set_epoch was never called: each iteration takes the next epoch
    NEXT = 4  # that next epoch
    PASS_SEED = 5  # the pass of DataLoader workers that took an epoch last: its loader's base seed,
    PASS_PROCESS = 6  # the number its parent gave its first worker process,
    PASS_COUNT = 7  # the iterations its workers had begun,
    PASS_EPOCH = 8  # and the epoch it took
    APPLIED = 9  # per worker from here: the generation of the last state it applied


_PASS = (Slot.PASS_SEED, Slot.PASS_PROCESS, Slot.PASS_COUNT)


def _first_process(worker_info: Any) -> int:
    """The number the parent gave the first worker process of this one's DataLoader pass:
    multiprocessing numbers the processes a parent makes in turn (``ForkProcess-7``), and a
    DataLoader makes its workers one after the other, in id order. -1 if the name says not."""
    match = re.search(r"-(\d+)$", multiprocessing.current_process().name)
    return int(match.group(1)) - int(worker_info.id) if match else -1


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


class Checkpoints:
    """A dataset's states: the one loaded, the live iteration's, and the shared counters.

    Epochs: until ``set_epoch`` is called, every iteration takes the next epoch by itself
    (0, 1, 2...; after a loaded state, that state's epoch and then the ones after it). A
    DataLoader's workers each begin their own iteration; those of one pass agree on its
    epoch through the shared state, under a lock: the first to begin takes the next epoch,
    the others find the pass recorded (a pass is known by the loader's base seed, and for
    persistent workers by how many iterations each worker began). After ``set_epoch(e)``,
    iterations follow ``e`` exactly.
    """

    def __init__(self, epoch: int = 0, auto: bool = True) -> None:
        # Made before DataLoader workers fork or spawn, so what the main process sets later
        # reaches persistent workers: the epoch, how many states were loaded (the
        # generation), whether workers iterated, and per worker the generation it applied.
        self.shared = torch.zeros(Slot.APPLIED + MAX_WORKERS, dtype=torch.int64).share_memory_()
        self.shared[Slot.EPOCH] = self.shared[Slot.NEXT] = epoch
        self.shared[Slot.AUTO] = int(auto)
        self.shared[Slot.PASS_SEED] = -1
        self.lock = _FileLock()
        self.passes = 0  # iterations begun in this process (a persistent worker's count them)
        self.resume: ResumeState | Remainder | None = None
        self.generation = 0  # of the resume this copy holds
        self.position: WorkerState | None = None  # one worker's own state, loaded in its process
        self.live: Any = None  # the latest iteration in this process (it gives its ``state()``)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["live"] = None  # an iteration stays in its process
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
        if self.auto and int(self.shared[Slot.PASS_SEED]) != -1:
            return int(self.shared[Slot.PASS_EPOCH])
        return self.epoch

    def begin(self, worker_info: Any) -> int:
        """The epoch of an iteration beginning now in this process (see the class's docstring)."""
        count, self.passes = self.passes, self.passes + 1
        if not self.auto:
            return int(self.shared[Slot.EPOCH])
        # Each iteration in the main process is a pass of its own; DataLoader workers of one
        # pass share the loader's base seed, the number their parent gave their first process
        # (a DataLoader made anew with the same seeded generator draws the same base seed),
        # and persistent ones their count of iterations.
        key = (-2, -2, count) if worker_info is None else (
            (int(worker_info.seed) - int(worker_info.id)) % 2**62, _first_process(worker_info), count)
        with self.lock.held():
            if worker_info is not None and tuple(int(self.shared[s]) for s in _PASS) == key:
                return int(self.shared[Slot.PASS_EPOCH])
            position, epoch = self.position, int(self.shared[Slot.NEXT])
            if position is not None:  # this worker's own state: its epoch, or the next if it had finished it
                epoch = int(position.header["epoch"]) + (0 if position.unfinished else 1)
            for slot, value in zip(_PASS, key, strict=True):
                self.shared[slot] = value
            self.shared[Slot.PASS_EPOCH], self.shared[Slot.NEXT] = epoch, epoch + 1
            return epoch

    def set_epoch(self, epoch: int, layout: Layout) -> None:
        stopped = self.unfinished_epoch(layout)
        if stopped is not None and stopped != epoch:
            raise ResumeError(f"the loaded state stopped mid-way through epoch {stopped} and its rest has not been"
                              f" iterated: set_epoch({stopped}) and finish it first, or make a new dataset to start"
                              f" epoch {epoch} without it")
        self.shared[Slot.EPOCH] = epoch
        self.shared[Slot.AUTO] = 0
        if self.resume is not None and self.resume.epoch != epoch:
            self.resume = None

    def unfinished_epoch(self, layout: Layout) -> int | None:
        """The epoch of a loaded mid-epoch state whose rest no iteration has taken yet."""
        position = self.position
        if position is not None and position.unfinished:
            return int(position.header["epoch"])
        resume = self.resume
        if resume is None or bool((self.shared[Slot.APPLIED:] >= self.generation).any()):
            return None
        if isinstance(resume, Remainder):
            return resume.epoch if len(resume) else None
        shares = [layout.worker_samples(w, resume.num_workers) for w in range(resume.num_workers)]
        if all(skip == 0 for skip in resume.skip) or all(s >= n for s, n in zip(resume.skip, shares, strict=True)):
            return None  # the start or the end of its epoch: nothing is left behind
        return resume.epoch

    def iterating_in(self, worker_info: Any) -> None:
        """Note where an iteration runs: in a DataLoader worker, this process cannot be asked."""
        if worker_info is not None:
            self.shared[Slot.IN_WORKERS] = 1

    # ------------------------------------------------------------------ taking states

    def state(self, worker_info: Any) -> dict[str, Any] | None:
        """The state of this process's live iteration; None if there is none yet (see
        ``RemoteDataset.state_dict``)."""
        if self.live is not None:
            return dict(self.live.state())
        if worker_info is None and int(self.shared[Slot.IN_WORKERS]):
            raise ResumeError("this dataset's iteration runs in DataLoader workers, which this process cannot ask:"
                              " use torchdata's StatefulDataLoader and its state_dict(), or pass consumed= and"
                              " num_workers= for a plain DataLoader")
        return None

    def count_state(self, layout: Layout, consumed: int, num_workers: int) -> dict[str, Any]:
        """The state after ``consumed`` items came out of a DataLoader with ``num_workers``."""
        per_item = layout.per_item()
        last = layout.stages[-1].cardinality if layout.stages else None
        keeps_short_batch = per_item == 1 or (last is not None and last.batches and last.keep_short)
        workers = max(1, num_workers)
        items = []
        for worker in range(workers):
            samples = layout.worker_samples(worker, workers)
            items.append(-(-samples // per_item) if keeps_short_batch else samples // per_item)
        taken = consumed_per_worker(items, consumed)
        return ResumeState(self.current, layout.seed, workers, [t * per_item for t in taken],
                           layout.reader.identity, (per_item, layout.world_size)).as_dict()

    # ------------------------------------------------------------------ loading states

    def load(self, layout: Layout, state: Any, worker_info: Any) -> None:
        """Check ``state`` and hold it for the next iteration of its epoch (see
        ``RemoteDataset.load_state_dict``)."""
        replayed = steps_since_snapshot(state)
        if replayed:
            raise ResumeError(f"this StatefulDataLoader state was taken {replayed} batches after its workers' last"
                              " snapshot, so it does not say which samples those batches held: on the same ranks"
                              " and workers give it to the loader's load_state_dict, which replays them; to resume"
                              " on others, take states with snapshot_every_n_steps=1 (its default)")
        found = find_states(state)
        if not found:
            if not isinstance(state, Mapping):
                raise ResumeError(f"no RemoteDataset worker state found in this {type(state).__name__} (looked"
                                  " 8 levels deep): pass state_dict()s or StatefulDataLoader.state_dict()s")
            self._load_counts(layout, state)
            return
        parsed = [layout.check(parse(s)) for s in found]
        rank, world_size = layout.rank, layout.world_size
        if worker_info is not None:
            own = [
                s
                for s in parsed
                if (s.header["rank"], s.header["worker"], s.header["world_size"], s.header["num_workers"])
                == (rank, worker_info.id, world_size, worker_info.num_workers)
            ]
            if len(parsed) != 1 or not own:
                raise ResumeError(
                    f"a DataLoader worker loads its own state only (rank {rank} worker {worker_info.id}"
                    f" of {world_size} x {worker_info.num_workers}); gather every rank's state in the"
                    " main process"
                )
            self.position, self.live = own[0], None
            return
        only = parsed[0].header
        if (
            len(parsed) == 1
            and only["world_size"] > 1
            and only["num_workers"] == 1
            and (only["rank"], only["world_size"]) == (rank, world_size)
        ):
            self.position, self.live = parsed[0], None  # this rank's own, without DataLoader workers
            return
        remainder = gather(parsed)
        self._install(remainder, remainder.epoch, finished=not len(remainder))

    def _load_counts(self, layout: Layout, state: Any) -> None:
        resume = ResumeState.from_dict(state)
        if resume.seed != layout.seed:
            raise ResumeError(f"state was saved with seed {resume.seed}, this dataset has seed {layout.seed}")
        layout.check_identity(resume.dataset)
        per_item = layout.per_item()
        if resume.split is not None and resume.split != (per_item, layout.world_size):
            (items, world), now = resume.split, (per_item, layout.world_size)
            raise ResumeError(
                f"this state counts items of {items} samples on {world} rank(s); this pipeline's items hold"
                f" {now[0]} on {now[1]}: the workers' shares are cut by them, so a count state resumes the"
                " pipeline it counted only (torchdata's StatefulDataLoader states resume any batch size and world)")
        shares = [layout.worker_samples(worker, resume.num_workers) for worker in range(len(resume.skip))]
        for worker, (skip, samples) in enumerate(zip(resume.skip, shares, strict=True)):
            if skip > -(-samples // per_item) * per_item:
                raise ResumeError(
                    f"state skips {skip} samples of worker {worker}, which has {samples} in epoch"
                    f" {resume.epoch}: it was saved for another dataset or split"
                )
        self._install(resume, resume.epoch, finished=all(s >= n for s, n in zip(resume.skip, shares, strict=True)))

    def _install(self, resume: ResumeState | Remainder, epoch: int, finished: bool) -> None:
        """Hold a resume for the next iteration of ``epoch`` in this process and in
        DataLoader workers started from now on; an iteration that takes its epoch by itself
        takes the next one if the state's epoch was ``finished``."""
        self.shared[Slot.EPOCH] = epoch
        self.shared[Slot.NEXT] = epoch + 1 if finished else epoch
        self.resume, self.position, self.live = resume, None, None
        self.shared[Slot.GENERATION] += 1
        self.generation = int(self.shared[Slot.GENERATION])

    # ------------------------------------------------------------------ applying them

    def resume_for(self, epoch: int, worker: int, num_workers: int) -> ResumeState | Remainder | None:
        """The loaded resume this worker applies, if any: at the first iteration of its epoch
        only (the shared record of applied states makes it once per load)."""
        generation = int(self.shared[Slot.GENERATION])
        if generation != self.generation:
            raise ResumeError(
                "load_state_dict was called after this DataLoader's persistent workers started;"
                " load the state before the first epoch, or create a new DataLoader"
            )
        resume = self.resume
        if resume is None or resume.epoch != epoch or int(self.shared[Slot.APPLIED + worker]) >= generation:
            return None
        if isinstance(resume, ResumeState) and resume.num_workers != num_workers:
            raise ResumeError(f"state was saved with {resume.num_workers} workers; this run has {num_workers}")
        return resume

    def plan(self, layout: Layout, epoch: int, worker: int, num_workers: int) -> Iteration:
        """What this worker reads in an iteration of ``epoch`` that begins now (nothing changes:
        ``take`` marks what it uses as used)."""
        header = layout.header(epoch, worker, num_workers)
        position = self.position
        if position is not None and position.header["epoch"] == epoch:
            split = ("rank", "world_size", "worker", "num_workers")
            if any(position.header[k] != header[k] for k in split):
                saved = "rank {rank}/{world_size} worker {worker}/{num_workers}".format(**position.header)
                raise ResumeError(
                    f"the loaded state is {saved}'s own, not this worker's ({layout.rank}/"
                    f"{layout.world_size}, {worker}/{num_workers}): to resume on other ranks or"
                    " workers, give load_state_dict every rank's state"
                )
            if position.mixing != layout.mixing:
                raise ResumeError(
                    f"the state of {position.where} was taken in a pipeline that mixes samples otherwise"
                    f" (open_shards, shuffle buffer, initial: {position.mixing.as_list()}, here"
                    f" {layout.mixing.as_list()}): its order cannot be followed; give load_state_dict every"
                    " rank's state to resume its rest in this pipeline's order"
                )
            if position.rows is not None:
                plan = Plan(position.rows, frozenset(p for p, _ in position.extras), position.header["run"])
            else:
                plan = self._share(layout, None, worker, num_workers)
            return Iteration(plan, {**header, "run": plan.run}, start=position.delivered,
                             expect=position.undelivered(), own_state=True)
        if position is not None and position.unfinished:
            raise ResumeError(
                f"the loaded state stopped mid-way through epoch {position.header['epoch']}, but"
                f" this iteration is epoch {epoch}: call set_epoch({position.header['epoch']}) first"
            )
        resume = self.resume_for(epoch, worker, num_workers)
        plan = self._share(layout, resume if isinstance(resume, Remainder) else None, worker, num_workers)
        start = resume.skip[worker] if isinstance(resume, ResumeState) else 0
        # A state of a finished epoch is used up by any later iteration: the next one starts afresh.
        return Iteration(plan, {**header, "run": plan.run}, start=start, resume=resume,
                         own_state=position is not None)

    def take(self, iteration: Iteration, worker: int) -> None:
        """Mark what ``iteration`` uses as used: this worker's own state, a loaded resume."""
        if iteration.own_state:
            self.position = None
        if iteration.resume is not None:
            self.shared[Slot.APPLIED + worker] = int(self.shared[Slot.GENERATION])

    @staticmethod
    def _share(layout: Layout, remainder: Remainder | None, worker: int, num_workers: int) -> Plan:
        """This worker's share of the sequence divided: the rest of an epoch gathered from
        states, or the whole epoch."""
        total = len(layout.reader)
        sequence = remainder if remainder is not None else Remainder({}, np.array([0]), np.array([total]), 0)
        low, high = worker_bounds(
            len(sequence),
            rank=layout.rank,
            world_size=layout.world_size,
            worker=worker,
            num_workers=num_workers,
            equalize=layout.equalize,
            align=layout.align(),
        )
        return sequence.plan(low, high)

@dataclass(frozen=True)
class Iteration:
    """What one worker reads in an iteration: its plan, the header of its states, the outputs
    of its delivery order given before (a resume's), the positions its own state says were not
    delivered (checked against its order), the loaded resume it applies (the rest of an epoch
    gathered from states, or a count state), and whether it uses up its own loaded state."""

    plan: Plan
    header: dict[str, Any]
    start: int = 0
    expect: list[tuple[int, int]] | None = None
    resume: ResumeState | Remainder | None = None
    own_state: bool = False
