"""``RemoteDataset``: stream an uploaded dataset into PyTorch, split across ranks and workers."""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from remote_loader.config import FetchConfig, check_world, require_bool, require_int, world_from_env
from remote_loader.errors import ConfigError, DatasetNotFound
from remote_loader.pipeline import stages
from remote_loader.pipeline.position import (
    Plan,
    Progress,
    Remainder,
    WorkerState,
    find_states,
    gather,
    parse,
    steps_since_snapshot,
)
from remote_loader.pipeline.resume import MAX_WORKERS, ResumeState, consumed_per_worker
from remote_loader.pipeline.source import span_jobs, stream_positions, tar_jobs
from remote_loader.pipeline.split import plan_spans, rank_size, shard_order, worker_bounds
from remote_loader.read import DatasetReader, Job, Metrics, RetryPolicy
from remote_loader.read.heap import release_free_memory
from remote_loader.storage import Store, open_location


def current_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as given, else from torch.distributed, else ``RANK`` / ``WORLD_SIZE``."""
    if (rank is None) != (world_size is None):
        raise ConfigError(f"give rank and world_size together, or neither (to take both from torch.distributed"
                          f" or RANK / WORLD_SIZE); got rank={rank!r}, world_size={world_size!r}")
    if rank is not None and world_size is not None:
        return check_world(rank, world_size)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return world_from_env()


_EPOCH, _GENERATION, _IN_WORKERS, _APPLIED = 0, 1, 2, 3  # slots of the shared state


def _shared_state(epoch: int = 0) -> torch.Tensor:
    """Counters in shared memory, made before DataLoader workers fork or spawn, so what the
    main process sets later reaches persistent workers: the epoch, how many resume states
    were loaded (the generation), whether DataLoader workers iterated, and per worker the
    generation it applied."""
    state = torch.zeros(_APPLIED + MAX_WORKERS, dtype=torch.int64)
    state[_EPOCH] = epoch
    return state.share_memory_()


class RemoteDataset(IterableDataset):
    """Samples of an uploaded dataset, in a fresh shard order every epoch.

    Each epoch the shard order is drawn from (seed, epoch); ranks and then DataLoader
    workers take contiguous ranges of it (see ``pipeline/split.py``). Each worker fetches
    its shards ahead with parallel ranged GETs under ``fetch.prefetch_bytes`` and mixes
    samples of ``open_shards`` shards at once.

    Args:
        client: A store from ``make_client``, or an ``s3://bucket/prefix`` URL.
        bucket: The bucket (omit with a URL).
        base_folder: The dataset's prefix (omit with a URL).
        seed: Seed of the shard order, the shard mixing and the shuffle buffer.
        shuffle_shards: Shuffle the shard order each epoch.
        open_shards: Shards read at once by each worker, their samples interleaved.
        rank: This process's rank; default from torch.distributed, else ``RANK``.
        world_size: Number of ranks; default from torch.distributed, else ``WORLD_SIZE``.
        equalize: Give every rank the same sample count by wrapping around (repeating at
            most ``world_size - 1`` samples); default on when ``world_size > 1``.
        fetch: Part size, concurrency, prefetch byte budget and the retry policy (its
            ``outage_deadline`` bounds how long a failing store is retried).
        verify: Check every member's crc32 (on by default). Bytes that fail are fetched
            again up to ``fetch.max_attempts`` times.
        on_error: For a sample whose bytes stay corrupt: ``"raise"`` CorruptSampleError
            naming shard and key, or ``"skip"`` it and count it in ``metrics.skipped``.
        unindexed: Stream the ``.tar`` objects under the prefix as plain WebDataset tars,
            without a manifest (whole tars dealt to ranks and workers; no resume, no
            equalising). Without it, a prefix with no manifest raises ``DatasetNotFound``.
        **connection: ``endpoint_url``, ``access_key``, ``secret_key``, ``region``,
            ``backend``, with a URL.

    Example:
        >>> ds = (RemoteDataset(client, "bucket", "imagenet").shuffle(1000)  # doctest: +SKIP
        ...       .decode("pil").to_tuple("jpg;png", "cls").map_tuple(preproc, None).batched(64))
    """

    def __init__(
        self,
        client: Store | str,
        bucket: str | None = None,
        base_folder: str | None = None,
        *,
        seed: int = 0,
        shuffle_shards: bool = True,
        open_shards: int = 4,
        rank: int | None = None,
        world_size: int | None = None,
        equalize: bool | None = None,
        fetch: FetchConfig | None = None,
        verify: bool = True,
        on_error: str = "raise",
        unindexed: bool = False,
        **connection: Any,
    ) -> None:
        if isinstance(client, str):
            client, location = open_location(client, **connection)
            bucket, base_folder = location.bucket, location.prefix
        elif connection:
            raise ConfigError(f"{', '.join(sorted(connection))}: connection options go with a URL, not a store")
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        if bucket is None or base_folder is None:
            raise ConfigError("RemoteDataset needs (client, bucket, base_folder) or an s3:// URL")
        open_shards = require_int("open_shards", open_shards, 1)
        seed = require_int("seed", seed, 0, 2**63 - 1)
        require_bool("shuffle_shards", shuffle_shards)
        require_bool("equalize", equalize, optional=True)
        require_bool("verify", verify)
        require_bool("unindexed", unindexed)
        if rank is not None or world_size is not None:
            rank, world_size = current_world(rank, world_size)
        self.fetch = fetch or FetchConfig()
        self.reader = DatasetReader(client, bucket, base_folder, verify=verify, fetch=self.fetch)
        self.unindexed = unindexed
        if not unindexed:
            self.reader.counts  # read now, so forked DataLoader workers share its arrays; DatasetNotFound
        elif self.reader.has_manifest():
            raise ConfigError(f"{self.reader.location} has a manifest: unindexed=True is for tars without one")
        self.seed, self.shuffle_shards, self.open_shards = seed, shuffle_shards, open_shards
        self.rank, self.world_size, self.equalize = rank, world_size, equalize
        self.stages: list[stages.Stage] = []
        self._metrics = Metrics.table(1 + MAX_WORKERS)  # row 0: this process; row 1 + w: worker w
        self._shared = _shared_state()
        self._resume: ResumeState | Remainder | None = None
        self._generation = 0  # of the resume state this copy holds
        self._position: WorkerState | None = None  # one worker's own state, loaded in its process
        self._live: Progress | None = None  # the latest iteration in this process

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_live"] = None  # an iteration stays in its process
        return state

    @property
    def metrics(self) -> Metrics:
        """Counters of this pipeline's loading, summed over this process and its DataLoader
        workers (their counters live in shared memory): cheap to read every N steps."""
        return Metrics.total(self._metrics)

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration follows (see ``set_epoch``)."""
        return int(self._shared[_EPOCH])

    def __repr__(self) -> str:
        return f"RemoteDataset({self.reader.location}, stages={len(self.stages)}, epoch={self.epoch})"

    # ------------------------------------------------------------------ the chain

    def _with(self, stage: stages.Stage) -> RemoteDataset:
        clone = copy.copy(self)
        clone.stages = [*self.stages, stage]
        clone._metrics = Metrics.table(1 + MAX_WORKERS)
        clone._shared = _shared_state(self.epoch)
        clone._resume, clone._generation, clone._position, clone._live = None, 0, None, None
        return clone

    def shuffle(self, bufsize: int, initial: int | None = None) -> RemoteDataset:
        """Mix samples in a buffer of ``bufsize`` (output starts at ``initial``, default ``min(bufsize, 100)``).

        Samples entering the buffer are copied out of their shard buffers, so the buffer's
        memory is ``bufsize`` samples, whatever the shard size.
        """
        start = initial if initial is not None else min(bufsize, 100) if isinstance(bufsize, int) else 0
        return self._with(stages.Shuffle(bufsize, start))

    def decode(self, mode: str | Callable[..., Any] = "pil", *, min_size: int | None = None,
               threads: int = 0) -> RemoteDataset:
        """Decode images (``pil``, ``rgb8``, ``torchrgb``, ``raw`` or a callable) and labels.

        ``min_size``: JPEGs are decoded at a reduced scale (1/2, 1/4, 1/8) whose shorter side
        stays at least ``min_size`` pixels; much faster when the model input is small.
        ``threads``: decode on this many threads (order kept); libjpeg-turbo and Pillow
        release the GIL, so one process fills several cores.
        """
        return self._with(stages.Decode(mode, min_size, threads))

    def to_tuple(self, *fields: str) -> RemoteDataset:
        """Samples become tuples of these fields (``"jpg;png"``: the first present); one
        string of several names, ``to_tuple("jpg;png cls")``, as in WebDataset, works too."""
        return self._with(stages.ToTuple(fields))

    def map(self, fn: Callable[[Any], Any], *, threads: int = 0) -> RemoteDataset:
        """Apply ``fn`` to every sample, on ``threads`` threads if given (order kept).

        Threads pay off for code that releases the GIL (Pillow's resize, torch ops,
        numpy on large arrays); pure-Python code belongs in DataLoader worker processes.
        """
        return self._with(stages.Map(fn, threads))

    def map_tuple(self, *fns: Callable[[Any], Any] | None) -> RemoteDataset:
        """Apply ``fns[i]`` to element ``i`` of each tuple (None keeps it)."""
        return self._with(stages.MapTuple(fns))

    def select(self, predicate: Callable[[Any], bool]) -> RemoteDataset:
        """Keep samples for which ``predicate`` is true."""
        return self._with(stages.Select(predicate))

    def batched(
        self, batchsize: int, collation_fn: Callable[[list[Any]], Any] | None = None, partial: bool = True
    ) -> RemoteDataset:
        """Group samples into batches, collated by ``collation_fn`` (default: torch's default_collate)."""
        collate = collation_fn or torch.utils.data.default_collate
        return self._with(stages.Batched(batchsize, collate, partial))

    # ------------------------------------------------------------------ epochs and sizes

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows.

        It reaches DataLoader workers too, persistent ones included (the epoch lives in
        shared memory). A loaded resume state applies to the first iteration of its own
        epoch only.
        """
        if type(epoch) is not int or epoch < 0:
            raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
        stopped = self._unfinished_epoch()
        if stopped is not None and stopped != epoch:
            raise ConfigError(f"the loaded state stopped mid-way through epoch {stopped} and its rest has not been"
                              f" iterated: set_epoch({stopped}) and finish it first, or make a new dataset to start"
                              f" epoch {epoch} without it")
        self._shared[_EPOCH] = epoch
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume = None

    def _unfinished_epoch(self) -> int | None:
        """The epoch of a loaded mid-epoch state whose rest no iteration has taken yet."""
        position = self._position
        if position is not None and position.unfinished:
            return int(position.header["epoch"])
        resume = self._resume
        if resume is None or bool((self._shared[_APPLIED:] >= self._generation).any()):
            return None
        if isinstance(resume, Remainder):
            return resume.epoch if len(resume) else None
        shares = [self._worker_samples(w, resume.num_workers) for w in range(resume.num_workers)]
        if all(skip == 0 for skip in resume.skip) or all(s >= n for s, n in zip(resume.skip, shares)):
            return None  # the start or the end of its epoch: nothing is left behind
        return resume.epoch

    def _split(self) -> tuple[int, int, bool]:
        rank, world_size = current_world(self.rank, self.world_size)
        equalize = world_size > 1 if self.equalize is None else self.equalize
        return rank, world_size, equalize

    def __len__(self) -> int:
        """Items this rank yields per epoch (batches, after ``batched``), whatever the number
        of DataLoader workers. A TypeError where that cannot be known in advance: after
        ``select`` (it depends on the samples) and for unindexed tars."""
        if self.unindexed:
            raise TypeError("len() of unindexed tars is unknown: their sample counts are read as they stream")
        rank, world_size, equalize = self._split()
        count: int | None = rank_size(len(self.reader), rank, world_size, equalize)
        for stage in self.stages:
            count = None if count is None else stage.outputs(count)
        if count is None:
            raise TypeError("len() of a pipeline with select() is unknown: it depends on the samples")
        return count

    def _align(self) -> int:
        """The samples each output item holds, when fixed: workers' shares are cut in
        multiples of it, so batches come out whole and as many as ``len()`` says."""
        align = 1
        for stage in self.stages:
            group = stage.group()
            if group is None:
                return 1
            align *= group
        return align

    def _worker_samples(self, worker: int, num_workers: int) -> int:
        """Samples worker ``worker`` of this rank reads per epoch."""
        rank, world_size, equalize = self._split()
        low, high = worker_bounds(len(self.reader), rank=rank, world_size=world_size, worker=worker,
                                  num_workers=num_workers, equalize=equalize, align=self._align())
        return high - low

    # ------------------------------------------------------------------ checkpoints

    def _skip_point(self) -> tuple[int, int]:
        """(stages run before skipping, samples per output item) for count-based resume."""
        shuffles = [i for i, s in enumerate(self.stages) if isinstance(s, stages.Shuffle)]
        after = shuffles[-1] + 1 if shuffles else 0
        tail = self.stages[after:]
        per_item = 1
        if tail and isinstance(tail[-1], stages.Batched):
            per_item = tail[-1].batchsize
            tail = tail[:-1]
        if not all(s.one_to_one for s in tail):
            raise ConfigError(
                "resume needs every stage after the last shuffle to map one sample to one (decode, map, "
                "map_tuple, to_tuple), optionally ending with batched; select or an inner batched breaks that"
            )
        return after, per_item

    def state_dict(self, consumed: int | None = None, num_workers: int = 0) -> dict[str, Any]:
        """Where this epoch stands, to save in a checkpoint and give to ``load_state_dict``.

        Without arguments: the position of this process's iteration, which is what
        torchdata's ``StatefulDataLoader`` asks each worker for (or the main process, with
        ``num_workers=0``). It lists the samples not yet delivered (in the open ranges, the
        shuffle buffer, stages and a partial batch), so its size grows with ``open_shards``
        and the shuffle buffer, never with the dataset. The states of all workers of all
        ranks resume the epoch on any number of ranks and workers.

        With ``consumed``, for a plain DataLoader whose workers cannot be asked: the
        position after ``consumed`` items (batches, with ``batched``) of this epoch came out
        of a DataLoader with ``num_workers`` workers, which hands out items round-robin.
        Such a state resumes on the same ranks and workers only.
        """
        if consumed is not None:
            return self._count_state(consumed, num_workers)
        if self._live is not None:
            return self._live.state()
        if self.unindexed:
            raise ConfigError("checkpoints need an indexed dataset: run remote-loader index on it")
        info = get_worker_info()
        if info is None and int(self._shared[_IN_WORKERS]):
            raise ConfigError("this dataset's iteration runs in DataLoader workers, which this process cannot ask:"
                              " use torchdata's StatefulDataLoader and its state_dict(), or pass consumed= and"
                              " num_workers= for a plain DataLoader")
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        plan, header, _ = self._plan(self.epoch, worker, workers, take=False)
        return Progress(plan, header).state()  # the next iteration's, nothing delivered yet

    def _count_state(self, consumed: int, num_workers: int) -> dict[str, Any]:
        _, per_item = self._skip_point()
        last = self.stages[-1] if self.stages else None
        keeps_short_batch = per_item == 1 or (isinstance(last, stages.Batched) and last.partial)
        workers = max(1, num_workers)
        items = []
        for worker in range(workers):
            samples = self._worker_samples(worker, workers)
            items.append(-(-samples // per_item) if keeps_short_batch else samples // per_item)
        taken = consumed_per_worker(items, consumed)
        return ResumeState(self.epoch, self.seed, workers, [t * per_item for t in taken], self.reader.identity).as_dict()

    def load_state_dict(self, state: Any) -> None:
        """Resume an epoch from a checkpoint: the next iteration of that epoch delivers
        exactly the samples not yet delivered.

        ``state`` is one of:

        - every rank's state, gathered (a list of StatefulDataLoader ``state_dict()``s, or
          of this method's worker states, in any order): the rest of the epoch is divided
          among this run's ranks and workers, whatever their numbers were;
        - one worker's own state: StatefulDataLoader restores each worker with its own,
          and each rank with ``num_workers=0`` with its own;
        - a state from ``state_dict(consumed=...)``: the same ranks and workers only.

        Load before the DataLoader starts its workers.
        """
        replayed = steps_since_snapshot(state)
        if replayed:
            raise ConfigError(f"this StatefulDataLoader state was taken {replayed} batches after its workers' last"
                              " snapshot, so it does not say which samples those batches held: create the"
                              " StatefulDataLoader with snapshot_every_n_steps=1 (its default)")
        found = find_states(state)
        if not found:
            if not isinstance(state, Mapping):
                raise ConfigError(f"no RemoteDataset worker state found in this {type(state).__name__} (looked"
                                  " 8 levels deep): pass state_dict()s or StatefulDataLoader.state_dict()s")
            self._load_counts(state)
            return
        parsed = [self._check(parse(s)) for s in found]
        rank, world_size, _ = self._split()
        info = get_worker_info()
        if info is not None:
            own = [s for s in parsed if (s.header["rank"], s.header["worker"], s.header["world_size"], s.header["num_workers"])
                   == (rank, info.id, world_size, info.num_workers)]
            if len(parsed) != 1 or not own:
                raise ConfigError(f"a DataLoader worker loads its own state only (rank {rank} worker {info.id} of"
                                  f" {world_size} x {info.num_workers}); gather every rank's state in the main process")
            self._position, self._live = own[0], None
            return
        only = parsed[0].header
        if len(parsed) == 1 and only["world_size"] > 1 and only["num_workers"] == 1 and \
                (only["rank"], only["world_size"]) == (rank, world_size):
            self._position, self._live = parsed[0], None  # this rank's own, without DataLoader workers
            return
        remainder = gather(parsed)
        self._install(remainder, remainder.epoch)

    def _check(self, state: WorkerState) -> WorkerState:
        expected = {"seed": self.seed, "shuffle": self.shuffle_shards, "samples": len(self.reader),
                    "shards": len(self.reader.counts)}
        for key, value in expected.items():
            if state.header[key] != value:
                raise ConfigError(f"the state of {state.where} has {key}={state.header[key]!r}, this dataset has"
                                  f" {value!r}: it was saved for another dataset or seed")
        self._check_identity(state.header.get("dataset"))
        return state

    def _check_identity(self, saved: int | None) -> None:
        if saved is not None and saved != self.reader.identity:
            raise ConfigError(f"the state was saved on another upload to {self.reader.location} (manifest"
                              f" {saved:08x}, now {self.reader.identity:08x}): the dataset was replaced since, so"
                              " the state's positions name other samples; start the epoch afresh")

    def _load_counts(self, state: Any) -> None:
        resume = ResumeState.from_dict(state)
        if resume.seed != self.seed:
            raise ConfigError(f"state was saved with seed {resume.seed}, this dataset has seed {self.seed}")
        self._check_identity(resume.dataset)
        _, per_item = self._skip_point()
        for worker, skip in enumerate(resume.skip):
            samples = self._worker_samples(worker, resume.num_workers)
            if skip > -(-samples // per_item) * per_item:
                raise ConfigError(f"state skips {skip} samples of worker {worker}, which has {samples} in epoch"
                                  f" {resume.epoch}: it was saved for another dataset or split")
        self._install(resume, resume.epoch)

    def _install(self, resume: ResumeState | Remainder, epoch: int) -> None:
        """Hold a resume for the next iteration of ``epoch`` in this process and in
        DataLoader workers started from now on."""
        self._shared[_EPOCH] = epoch
        self._resume, self._position, self._live = resume, None, None
        self._shared[_GENERATION] += 1
        self._generation = int(self._shared[_GENERATION])

    def _take_resume(self, epoch: int, worker: int, num_workers: int, take: bool) -> ResumeState | Remainder | None:
        """The resume this worker applies: a loaded one, at the first iteration of its epoch
        only (the shared record of applied states makes it once per load)."""
        generation = int(self._shared[_GENERATION])
        if generation != self._generation:
            raise ConfigError("load_state_dict was called after this DataLoader's persistent workers started;"
                              " load the state before the first epoch, or create a new DataLoader")
        resume = self._resume
        if resume is None or resume.epoch != epoch or int(self._shared[_APPLIED + worker]) >= generation:
            return None
        if isinstance(resume, ResumeState) and resume.num_workers != num_workers:
            raise ConfigError(f"state was saved with {resume.num_workers} workers; this run has {num_workers}")
        if take:
            self._shared[_APPLIED + worker] = generation
        return resume

    def _plan(self, epoch: int, worker: int, num_workers: int, *,
              take: bool) -> tuple[Plan, dict[str, Any], ResumeState | Remainder | None]:
        """What this worker reads in this iteration, the header of its states, and the
        resume loaded in the main process that applies."""
        rank, world_size, equalize = self._split()
        total = len(self.reader)
        header = {"epoch": epoch, "seed": self.seed, "shuffle": self.shuffle_shards, "samples": total,
                  "shards": len(self.reader.counts), "dataset": self.reader.identity, "run": 0, "rank": rank,
                  "world_size": world_size,
                  "worker": worker, "num_workers": num_workers}
        position = self._position
        if position is not None:
            if position.header["epoch"] == epoch:
                split = ("rank", "world_size", "worker", "num_workers")
                if any(position.header[k] != header[k] for k in split):
                    saved = "rank {rank}/{world_size} worker {worker}/{num_workers}".format(**position.header)
                    raise ConfigError(f"the loaded state is {saved}'s own, not this worker's ({rank}/{world_size},"
                                      f" {worker}/{num_workers}): to resume on other ranks or workers, give"
                                      " load_state_dict every rank's state")
                if take:
                    self._position = None
                plan = position.plan()
                return plan, {**header, "run": plan.run}, None
            if position.unfinished:
                raise ConfigError(f"the loaded state stopped mid-way through epoch {position.header['epoch']}, but"
                                  f" this iteration is epoch {epoch}: call set_epoch({position.header['epoch']}) first")
            if take:
                self._position = None  # a finished epoch: the next one starts afresh
        resume = self._take_resume(epoch, worker, num_workers, take)
        # The sequence divided: the rest of an epoch gathered from states, or the whole epoch.
        whole = Remainder(header, np.array([0]), np.array([total]), 0)
        sequence = resume if isinstance(resume, Remainder) else whole
        low, high = worker_bounds(len(sequence), rank=rank, world_size=world_size, worker=worker,
                                  num_workers=num_workers, equalize=equalize, align=self._align())
        plan = sequence.plan(low, high)
        return plan, {**header, "run": plan.run}, resume

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        # The plan is made now, so that a StatefulDataLoader asking for the state before the
        # first item gets this iteration's; an error waits for the first next(), where
        # DataLoader workers report it (one raised here ends a persistent worker).
        self._live = None
        try:
            return self._start()
        except Exception as error:  # noqa: BLE001 - raised unchanged at the first next()
            return _failing(error)

    def _start(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        if num_workers > MAX_WORKERS:
            raise ConfigError(f"RemoteDataset supports up to {MAX_WORKERS} DataLoader workers, got {num_workers}")
        if info is not None:
            self._shared[_IN_WORKERS] = 1
        epoch = self.epoch  # once: the main process may set the next one while this runs
        if self.unindexed:
            if self._take_resume(epoch, worker, num_workers, take=False) is not None or self._position is not None:
                raise ConfigError("resume needs an indexed dataset: run remote-loader index on it")
            return self._iterate(epoch, worker, num_workers, None, 0)
        plan, header, resume = self._plan(epoch, worker, num_workers, take=True)
        skip = resume.skip[worker] if isinstance(resume, ResumeState) else 0
        self._live = Progress(plan, header)
        return self._iterate(epoch, worker, num_workers, self._live, skip)

    def _iterate(self, epoch: int, worker: int, num_workers: int, progress: Progress | None, skip: int) -> Iterator[Any]:
        rank, _, _ = self._split()
        info = get_worker_info()
        metrics = Metrics(self._metrics[1 + worker if info else 0].numpy())
        policy = self.reader.policy(metrics, cancel=threading.Event())
        jobs = self._jobs(epoch, worker, num_workers, policy, progress)
        release_free_memory()  # the split's temporaries, so that a worker keeps only its share
        data: Iterator[tuple[Any, Any]] = stream_positions(
            self.reader, jobs, policy=policy, open_shards=self.open_shards, seed=(self.seed, epoch, rank, worker, 1),
            on_error=self.on_error, progress=progress)
        names = stages.InFlight()
        data = names.entering(data)
        counted = progress.done if progress is not None else _ignore

        def done(ids: Any) -> None:
            counted(ids)
            names.left(ids)

        skip_after = self._skip_point()[0] if skip else -1
        context = stages.Context(self.seed, epoch, rank, worker)
        for position, stage in enumerate(self.stages):
            if position == skip_after:
                data = _skip(data, skip, done)
            data = stages.run_paired(stage, data, context, done, names)
        if skip_after == len(self.stages):
            data = _skip(data, skip, done)
        yield from _timed(_deliver(data, done), metrics)

    def _jobs(self, epoch: int, worker: int, num_workers: int, policy: RetryPolicy,
              progress: Progress | None) -> Iterable[Job]:
        """What this worker fetches: its plan's spans, or for plain WebDataset tars without a
        manifest, whole tars dealt round-robin to ranks x workers in the epoch's order."""
        if progress is not None:
            counts = self.reader.counts
            spans = plan_spans(counts, shard_order(len(counts), self.seed, epoch, self.shuffle_shards), progress.plan.rows)
            return span_jobs(self.reader, spans, policy, self.open_shards, self.on_error, progress)
        tars = self.reader.list_tars()
        if not tars:
            raise DatasetNotFound(f"no .tar objects under {self.reader.location} to stream unindexed",
                                  bucket=self.reader.location.bucket, key=self.reader.location.key(""))
        rank, world_size, _ = self._split()
        slots, slot = world_size * num_workers, rank * num_workers + worker
        order = shard_order(len(tars), self.seed, epoch, self.shuffle_shards)
        return tar_jobs(self.reader, [tars[k] for position, k in enumerate(order) if position % slots == slot])


def _failing(error: Exception) -> Iterator[Any]:
    raise error
    yield  # a generator: it raises at the first next()


def _ignore(ids: Any) -> None:
    pass


def _skip(pairs: Iterator[tuple[Any, Any]], count: int, done: Callable[[Any], None]) -> Iterator[tuple[Any, Any]]:
    """``pairs`` less the first ``count`` items, which count as delivered (a count-based resume)."""
    for i, _ in itertools.islice(pairs, count):
        done(i)
    yield from pairs


def _deliver(pairs: Iterator[tuple[Any, Any]], done: Callable[[Any], None]) -> Iterator[Any]:
    """The items; each one's samples count as delivered as it leaves."""
    for ids, item in pairs:
        done(ids)
        yield item


def _timed(data: Iterator[Any], metrics: Metrics) -> Iterator[Any]:
    """Count time spent producing items, less the time waiting on storage, as user time."""
    while True:
        started, waited = time.perf_counter(), metrics.wait_seconds
        try:
            item = next(data)
        except StopIteration:
            return
        metrics.add(user_seconds=time.perf_counter() - started - (metrics.wait_seconds - waited))
        yield item
