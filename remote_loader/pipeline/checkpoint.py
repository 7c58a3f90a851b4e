"""Checkpoints of a ``RemoteDataset``'s epoch: taking a state, checking and loading one,
and cutting each worker's plan for the next iteration from it.

Two kinds of state resume an epoch. A position state (``position.py``) lists the samples a
worker has not delivered; gathered from every worker of every rank, it resumes on any
number of ranks and workers. A count state (``resume.py``) says how many items a plain
DataLoader took; it resumes on the same ranks and workers by skipping that many.

``Checkpoints`` owns what a state touches across processes: counters in shared memory made
with the dataset (the epoch, how many states were loaded, whether DataLoader workers
iterated, which worker applied which load), so that what the main process loads or sets
reaches workers started later, persistent ones included. ``Layout`` is what a state is
checked against and a share is cut from: the dataset, its seed, this rank's place in the
world and the pipeline's stages.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from remote_loader.errors import ConfigError
from remote_loader.pipeline.position import Plan, Progress
from remote_loader.pipeline.replay import Replay, check_rows
from remote_loader.pipeline.resume import MAX_WORKERS, ResumeState, consumed_per_worker
from remote_loader.pipeline.split import worker_bounds
from remote_loader.pipeline.stages import Stage
from remote_loader.pipeline.states import Remainder, WorkerState, find_states, gather, parse, steps_since_snapshot
from remote_loader.read import DatasetReader

# Slots of the shared state. _EPOCH: the epoch set_epoch chose (or a loaded state's); _AUTO:
# 1 while set_epoch was never called, each iteration then taking the next epoch; _NEXT: that
# next epoch; _PASS_*: the pass of DataLoader workers that took an epoch last, and which.
_EPOCH, _GENERATION, _IN_WORKERS, _AUTO, _NEXT, _PASS_SEED, _PASS_COUNT, _PASS_EPOCH, _APPLIED = range(9)


@dataclass(frozen=True)
class Layout:
    """What a state is checked against and a worker's share is cut from."""

    reader: DatasetReader
    seed: int
    shuffle: bool
    rank: int
    world_size: int
    equalize: bool
    stages: Sequence[Stage]

    def align(self) -> int:
        """The samples each output item holds, when fixed: workers' shares are cut in
        multiples of it, so batches come out whole and as many as ``len()`` says."""
        align = 1
        for stage in self.stages:
            group = stage.group()
            if group is None:
                return 1
            align *= group
        return align

    def worker_samples(self, worker: int, num_workers: int) -> int:
        """Samples worker ``worker`` of this rank reads per epoch."""
        low, high = worker_bounds(len(self.reader), rank=self.rank, world_size=self.world_size, worker=worker,
                                  num_workers=num_workers, equalize=self.equalize, align=self.align())
        return high - low

    def header(self, epoch: int, worker: int, num_workers: int) -> dict[str, Any]:
        """What every state of this worker in ``epoch`` starts with."""
        return {"epoch": epoch, "seed": self.seed, "shuffle": self.shuffle, "samples": len(self.reader),
                "shards": len(self.reader.counts), "dataset": self.reader.identity, "run": 0, "rank": self.rank,
                "world_size": self.world_size, "worker": worker, "num_workers": num_workers}

    def skip_point(self) -> tuple[int, int]:
        """(stages run before skipping, samples per output item) for a count-based resume."""
        reorders = [i for i, s in enumerate(self.stages) if s.reorders]
        after = reorders[-1] + 1 if reorders else 0
        tail = list(self.stages[after:])
        per_item = 1
        batch = tail[-1].batch() if tail else None
        if batch is not None:
            per_item = batch[0]
            tail = tail[:-1]
        if not all(s.one_to_one for s in tail):
            raise ConfigError(
                "resume needs every stage after the last shuffle to map one sample to one (decode, map, "
                "map_tuple, to_tuple), optionally ending with batched; select or an inner batched breaks that"
            )
        return after, per_item

    def replay_point(self) -> tuple[int, bool]:
        """(stages before the replay point, the end of the last shuffle or batched; whether
        a replay's placeholders can pass every stage before it, none of which looks at a
        sample's content), see ``replay.py``."""
        marks = [i for i, s in enumerate(self.stages) if s.reorders or s.batch() is not None]
        point = marks[-1] + 1 if marks else 0
        return point, all(s.one_to_one or s.reorders or s.batch() is not None for s in self.stages[:point])

    def check(self, state: WorkerState) -> WorkerState:
        expected = {"seed": self.seed, "shuffle": self.shuffle, "samples": len(self.reader),
                    "shards": len(self.reader.counts)}
        for key, value in expected.items():
            if state.header[key] != value:
                raise ConfigError(f"the state of {state.where} has {key}={state.header[key]!r}, this dataset has"
                                  f" {value!r}: it was saved for another dataset or seed")
        self.check_identity(state.header.get("dataset"))
        return state

    def check_identity(self, saved: int | None) -> None:
        if saved is not None and saved != self.reader.identity:
            raise ConfigError(f"the state was saved on another upload to {self.reader.location} (manifest"
                              f" {saved:08x}, now {self.reader.identity:08x}): the dataset was replaced since, so"
                              " the state's positions name other samples; start the epoch afresh")


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
        self.shared = torch.zeros(_APPLIED + MAX_WORKERS, dtype=torch.int64).share_memory_()
        self.shared[_EPOCH] = self.shared[_NEXT] = epoch
        self.shared[_AUTO] = int(auto)
        self.shared[_PASS_SEED] = -1
        self.lock = _FileLock()
        self.passes = 0  # iterations begun in this process (a persistent worker's count them)
        self.resume: ResumeState | Remainder | None = None
        self.generation = 0  # of the resume this copy holds
        self.position: WorkerState | None = None  # one worker's own state, loaded in its process
        self.live: Progress | None = None  # the latest iteration in this process

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["live"] = None  # an iteration stays in its process
        return state

    @property
    def auto(self) -> bool:
        """Whether iterations take the next epoch by themselves (``set_epoch`` never called)."""
        return bool(int(self.shared[_AUTO]))

    @property
    def epoch(self) -> int:
        """The epoch the next iteration follows."""
        return int(self.shared[_NEXT if self.auto else _EPOCH])

    @property
    def current(self) -> int:
        """The epoch of the iteration under way (the latest begun), else of the next one."""
        if self.auto and int(self.shared[_PASS_SEED]) != -1:
            return int(self.shared[_PASS_EPOCH])
        return self.epoch

    def begin(self, worker_info: Any) -> int:
        """The epoch of an iteration beginning now in this process (see the class's docstring)."""
        count, self.passes = self.passes, self.passes + 1
        if not self.auto:
            return int(self.shared[_EPOCH])
        # Each iteration in the main process is a pass of its own; DataLoader workers of one
        # pass share the loader's base seed, and persistent ones their count of iterations.
        key = (-2, count) if worker_info is None else ((int(worker_info.seed) - int(worker_info.id)) % 2**62, count)
        with self.lock.held():
            if worker_info is not None and (int(self.shared[_PASS_SEED]), int(self.shared[_PASS_COUNT])) == key:
                return int(self.shared[_PASS_EPOCH])
            position, epoch = self.position, int(self.shared[_NEXT])
            if position is not None:  # this worker's own state: its epoch, or the next if it had finished it
                epoch = int(position.header["epoch"]) + (0 if position.unfinished else 1)
            self.shared[_PASS_SEED], self.shared[_PASS_COUNT] = key
            self.shared[_PASS_EPOCH], self.shared[_NEXT] = epoch, epoch + 1
            return epoch

    def set_epoch(self, epoch: int, layout: Layout) -> None:
        stopped = self.unfinished_epoch(layout)
        if stopped is not None and stopped != epoch:
            raise ConfigError(f"the loaded state stopped mid-way through epoch {stopped} and its rest has not been"
                              f" iterated: set_epoch({stopped}) and finish it first, or make a new dataset to start"
                              f" epoch {epoch} without it")
        self.shared[_EPOCH] = epoch
        self.shared[_AUTO] = 0
        if self.resume is not None and self.resume.epoch != epoch:
            self.resume = None

    def unfinished_epoch(self, layout: Layout) -> int | None:
        """The epoch of a loaded mid-epoch state whose rest no iteration has taken yet."""
        position = self.position
        if position is not None and position.unfinished:
            return int(position.header["epoch"])
        resume = self.resume
        if resume is None or bool((self.shared[_APPLIED:] >= self.generation).any()):
            return None
        if isinstance(resume, Remainder):
            return resume.epoch if len(resume) else None
        shares = [layout.worker_samples(w, resume.num_workers) for w in range(resume.num_workers)]
        if all(skip == 0 for skip in resume.skip) or all(s >= n for s, n in zip(resume.skip, shares)):
            return None  # the start or the end of its epoch: nothing is left behind
        return resume.epoch

    def iterating_in(self, worker_info: Any) -> None:
        """Note where an iteration runs: in a DataLoader worker, this process cannot be asked."""
        if worker_info is not None:
            self.shared[_IN_WORKERS] = 1

    # ------------------------------------------------------------------ taking states

    def state(self, layout: Layout, worker_info: Any) -> dict[str, Any]:
        """The position of this process's iteration (see ``RemoteDataset.state_dict``)."""
        if self.live is not None:
            return self.live.state()
        if worker_info is None and int(self.shared[_IN_WORKERS]):
            raise ConfigError("this dataset's iteration runs in DataLoader workers, which this process cannot ask:"
                              " use torchdata's StatefulDataLoader and its state_dict(), or pass consumed= and"
                              " num_workers= for a plain DataLoader")
        worker, workers = (worker_info.id, worker_info.num_workers) if worker_info else (0, 1)
        plan, header, _, replay = self.plan(layout, self.epoch, worker, workers, take=False)
        return Progress(plan, header, replay).state()  # the next iteration's, nothing delivered yet

    def count_state(self, layout: Layout, consumed: int, num_workers: int) -> dict[str, Any]:
        """The state after ``consumed`` items came out of a DataLoader with ``num_workers``."""
        _, per_item = layout.skip_point()
        batch = layout.stages[-1].batch() if layout.stages else None
        keeps_short_batch = per_item == 1 or (batch is not None and batch[1])
        workers = max(1, num_workers)
        items = []
        for worker in range(workers):
            samples = layout.worker_samples(worker, workers)
            items.append(-(-samples // per_item) if keeps_short_batch else samples // per_item)
        taken = consumed_per_worker(items, consumed)
        return ResumeState(self.current, layout.seed, workers, [t * per_item for t in taken],
                           layout.reader.identity).as_dict()

    # ------------------------------------------------------------------ loading states

    def load(self, layout: Layout, state: Any, worker_info: Any) -> None:
        """Check ``state`` and hold it for the next iteration of its epoch (see
        ``RemoteDataset.load_state_dict``)."""
        replayed = steps_since_snapshot(state)
        if replayed:
            raise ConfigError(f"this StatefulDataLoader state was taken {replayed} batches after its workers' last"
                              " snapshot, so it does not say which samples those batches held: on the same ranks"
                              " and workers give it to the loader's load_state_dict, which replays them; to resume"
                              " on others, take states with snapshot_every_n_steps=1 (its default)")
        found = find_states(state)
        if not found:
            if not isinstance(state, Mapping):
                raise ConfigError(f"no RemoteDataset worker state found in this {type(state).__name__} (looked"
                                  " 8 levels deep): pass state_dict()s or StatefulDataLoader.state_dict()s")
            self._load_counts(layout, state)
            return
        parsed = [layout.check(parse(s)) for s in found]
        rank, world_size = layout.rank, layout.world_size
        if worker_info is not None:
            own = [s for s in parsed if (s.header["rank"], s.header["worker"], s.header["world_size"], s.header["num_workers"])
                   == (rank, worker_info.id, world_size, worker_info.num_workers)]
            if len(parsed) != 1 or not own:
                raise ConfigError(f"a DataLoader worker loads its own state only (rank {rank} worker {worker_info.id}"
                                  f" of {world_size} x {worker_info.num_workers}); gather every rank's state in the"
                                  " main process")
            self.position, self.live = own[0], None
            return
        only = parsed[0].header
        if len(parsed) == 1 and only["world_size"] > 1 and only["num_workers"] == 1 and \
                (only["rank"], only["world_size"]) == (rank, world_size):
            self.position, self.live = parsed[0], None  # this rank's own, without DataLoader workers
            return
        remainder = gather(parsed)
        self._install(remainder, remainder.epoch, finished=not len(remainder))

    def _load_counts(self, layout: Layout, state: Any) -> None:
        resume = ResumeState.from_dict(state)
        if resume.seed != layout.seed:
            raise ConfigError(f"state was saved with seed {resume.seed}, this dataset has seed {layout.seed}")
        layout.check_identity(resume.dataset)
        _, per_item = layout.skip_point()
        shares = [layout.worker_samples(worker, resume.num_workers) for worker in range(len(resume.skip))]
        for worker, (skip, samples) in enumerate(zip(resume.skip, shares)):
            if skip > -(-samples // per_item) * per_item:
                raise ConfigError(f"state skips {skip} samples of worker {worker}, which has {samples} in epoch"
                                  f" {resume.epoch}: it was saved for another dataset or split")
        self._install(resume, resume.epoch, finished=all(s >= n for s, n in zip(resume.skip, shares)))

    def _install(self, resume: ResumeState | Remainder, epoch: int, finished: bool) -> None:
        """Hold a resume for the next iteration of ``epoch`` in this process and in
        DataLoader workers started from now on; an iteration that takes its epoch by itself
        takes the next one if the state's epoch was ``finished``."""
        self.shared[_EPOCH] = epoch
        self.shared[_NEXT] = epoch + 1 if finished else epoch
        self.resume, self.position, self.live = resume, None, None
        self.shared[_GENERATION] += 1
        self.generation = int(self.shared[_GENERATION])

    # ------------------------------------------------------------------ applying them

    def take_resume(self, epoch: int, worker: int, num_workers: int, take: bool) -> ResumeState | Remainder | None:
        """The resume this worker applies: a loaded one, at the first iteration of its epoch
        only (the shared record of applied states makes it once per load)."""
        generation = int(self.shared[_GENERATION])
        if generation != self.generation:
            raise ConfigError("load_state_dict was called after this DataLoader's persistent workers started;"
                              " load the state before the first epoch, or create a new DataLoader")
        resume = self.resume
        if resume is None or resume.epoch != epoch or int(self.shared[_APPLIED + worker]) >= generation:
            return None
        if isinstance(resume, ResumeState) and resume.num_workers != num_workers:
            raise ConfigError(f"state was saved with {resume.num_workers} workers; this run has {num_workers}")
        if take:
            self.shared[_APPLIED + worker] = generation
        return resume

    def plan(self, layout: Layout, epoch: int, worker: int, num_workers: int, *,
             take: bool) -> tuple[Plan, dict[str, Any], ResumeState | Remainder | None, Replay | None]:
        """What this worker reads in this iteration, the header of its states, the resume
        loaded in the main process that applies, and the replay of its own state's run."""
        header = layout.header(epoch, worker, num_workers)
        position = self.position
        if position is not None:
            if position.header["epoch"] == epoch:
                split = ("rank", "world_size", "worker", "num_workers")
                if any(position.header[k] != header[k] for k in split):
                    saved = "rank {rank}/{world_size} worker {worker}/{num_workers}".format(**position.header)
                    raise ConfigError(f"the loaded state is {saved}'s own, not this worker's ({layout.rank}/"
                                      f"{layout.world_size}, {worker}/{num_workers}): to resume on other ranks or"
                                      " workers, give load_state_dict every rank's state")
                if take:
                    self.position = None
                if position.record is None:  # a state saved before records: its rest, in position order
                    plan = position.plan()
                    return plan, {**header, "run": plan.run}, None, None
                plan, replay = position.replay(placeholders=layout.replay_point()[1])
                if plan.run == 0:
                    check_rows(position.record, self._share(layout, None, worker, num_workers).rows, position.where)
                return plan, {**header, "run": plan.run}, None, replay
            if position.unfinished:
                raise ConfigError(f"the loaded state stopped mid-way through epoch {position.header['epoch']}, but"
                                  f" this iteration is epoch {epoch}: call set_epoch({position.header['epoch']}) first")
            if take:
                self.position = None  # a finished epoch: the next one starts afresh
        resume = self.take_resume(epoch, worker, num_workers, take)
        plan = self._share(layout, resume if isinstance(resume, Remainder) else None, worker, num_workers)
        return plan, {**header, "run": plan.run}, resume, None

    @staticmethod
    def _share(layout: Layout, remainder: Remainder | None, worker: int, num_workers: int) -> Plan:
        """This worker's share of the sequence divided: the rest of an epoch gathered from
        states, or the whole epoch."""
        total = len(layout.reader)
        sequence = remainder if remainder is not None else Remainder({}, np.array([0]), np.array([total]), 0)
        low, high = worker_bounds(len(sequence), rank=layout.rank, world_size=layout.world_size, worker=worker,
                                  num_workers=num_workers, equalize=layout.equalize, align=layout.align())
        return sequence.plan(low, high)

    def start(self, layout: Layout, epoch: int, worker: int, num_workers: int) -> tuple[Progress, int]:
        """The progress of a new iteration, and how many samples a count state skips."""
        plan, header, resume, replay = self.plan(layout, epoch, worker, num_workers, take=True)
        skip = resume.skip[worker] if isinstance(resume, ResumeState) else 0
        self.live = Progress(plan, header, replay, recorded=not skip)
        return self.live, skip
