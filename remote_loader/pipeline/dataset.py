"""``RemoteDataset``: stream an uploaded dataset into PyTorch, split across ranks and workers."""

from __future__ import annotations

import copy
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from remote_loader.config import FetchConfig
from remote_loader.errors import ConfigError
from remote_loader.pipeline import stages
from remote_loader.pipeline.resume import MAX_WORKERS, ResumeState, consumed_per_worker
from remote_loader.pipeline.source import span_jobs, stream_samples, tar_jobs
from remote_loader.pipeline.split import Span, iter_assign, rank_size, shard_order, worker_bounds
from remote_loader.read import DatasetReader, Job, Metrics, RetryPolicy
from remote_loader.read.heap import release_free_memory
from remote_loader.storage import Store, open_location



def current_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as given, else from torch.distributed, else ``RANK`` / ``WORLD_SIZE``."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


_EPOCH, _GENERATION, _APPLIED = 0, 1, 2  # slots of the shared state


def _shared_state(epoch: int = 0) -> torch.Tensor:
    """Counters in shared memory, made before DataLoader workers fork or spawn, so what the
    main process sets later reaches persistent workers: the epoch, how many resume states
    were loaded (the generation), and per worker the generation it applied."""
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
        **connection: Any,
    ) -> None:
        if isinstance(client, str):
            client, location = open_location(client, **connection)
            bucket, base_folder = location.bucket, location.prefix
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error = on_error
        if bucket is None or base_folder is None:
            raise ConfigError("RemoteDataset needs (client, bucket, base_folder) or an s3:// URL")
        if open_shards < 1:
            raise ConfigError(f"open_shards must be >= 1, got {open_shards}")
        self.fetch = fetch or FetchConfig()
        self.reader = DatasetReader(client, bucket, base_folder, verify=verify, fetch=self.fetch)
        if self.reader.has_manifest():  # read now, so forked DataLoader workers share its arrays
            self.reader.counts
        self.seed, self.shuffle_shards, self.open_shards = seed, shuffle_shards, open_shards
        self.rank, self.world_size, self.equalize = rank, world_size, equalize
        self.stages: list[stages.Stage] = []
        self._metrics = Metrics.table(1 + MAX_WORKERS)  # row 0: this process; row 1 + w: worker w
        self._shared = _shared_state()
        self._resume: ResumeState | None = None
        self._generation = 0  # of the resume state this copy holds

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
        clone._resume, clone._generation = None, 0
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
        """Samples become tuples of these fields (``"jpg;png"``: the first present)."""
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
        self._shared[_EPOCH] = epoch
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume = None

    def _split(self) -> tuple[int, int, bool]:
        rank, world_size = current_world(self.rank, self.world_size)
        equalize = world_size > 1 if self.equalize is None else self.equalize
        return rank, world_size, equalize

    def __len__(self) -> int:
        """Samples this rank reads per epoch (before select or batching)."""
        rank, world_size, equalize = self._split()
        return rank_size(len(self.reader), rank, world_size, equalize)

    def _spans(self, worker: int, num_workers: int, epoch: int | None = None) -> Iterator[Span]:
        rank, world_size, equalize = self._split()
        return iter_assign(self.reader.counts, seed=self.seed, epoch=self.epoch if epoch is None else epoch, rank=rank,
                           world_size=world_size, worker=worker, num_workers=num_workers, shuffle=self.shuffle_shards,
                           equalize=equalize)

    def _worker_samples(self, worker: int, num_workers: int) -> int:
        """Samples worker ``worker`` of this rank reads per epoch."""
        rank, world_size, equalize = self._split()
        low, high = worker_bounds(len(self.reader), rank=rank, world_size=world_size, worker=worker,
                                  num_workers=num_workers, equalize=equalize)
        return high - low

    # ------------------------------------------------------------------ resume

    def _skip_point(self) -> tuple[int, int]:
        """(stages run before skipping, samples per output item) for position-based resume."""
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

    def state_dict(self, consumed: int, num_workers: int = 0) -> dict[str, Any]:
        """The position after ``consumed`` items of this epoch came out of the DataLoader.

        Args:
            consumed: Items (batches, with ``batched``) the training loop took this epoch.
            num_workers: The DataLoader's ``num_workers``; it hands out items round-robin
                across workers, which fixes how many came from each.

        Save the result in the checkpoint; after a restart call ``load_state_dict`` and run
        the same epoch: it yields exactly the items not yet consumed.
        """
        _, per_item = self._skip_point()
        last = self.stages[-1] if self.stages else None
        keeps_short_batch = per_item == 1 or (isinstance(last, stages.Batched) and last.partial)
        workers = max(1, num_workers)
        items = []
        for worker in range(workers):
            samples = self._worker_samples(worker, workers)
            items.append(-(-samples // per_item) if keeps_short_batch else samples // per_item)
        taken = consumed_per_worker(items, consumed)
        return ResumeState(self.epoch, self.seed, workers, [t * per_item for t in taken]).as_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the epoch a ``state_dict`` was taken in: the next iteration skips what was consumed."""
        resume = ResumeState.from_dict(state)
        if resume.seed != self.seed:
            raise ConfigError(f"state was saved with seed {resume.seed}, this dataset has seed {self.seed}")
        _, per_item = self._skip_point()
        self._shared[_EPOCH] = resume.epoch
        for worker, skip in enumerate(resume.skip):
            samples = self._worker_samples(worker, resume.num_workers)
            if skip > -(-samples // per_item) * per_item:
                raise ConfigError(f"state skips {skip} samples of worker {worker}, which has {samples} in epoch"
                                  f" {resume.epoch}: it was saved for another dataset or split")
        self._resume = resume
        self._shared[_GENERATION] += 1
        self._generation = int(self._shared[_GENERATION])

    # ------------------------------------------------------------------ iteration

    def _take_skip(self, epoch: int, worker: int, num_workers: int) -> int:
        """Samples this worker skips: its count of a loaded state, at the first iteration of
        the state's epoch only (the shared record of applied states makes it once per load)."""
        generation = int(self._shared[_GENERATION])
        if generation != self._generation:
            raise ConfigError("load_state_dict was called after this DataLoader's persistent workers started;"
                              " load the state before the first epoch, or create a new DataLoader")
        resume = self._resume
        if resume is None:
            return 0
        if resume.epoch != epoch or int(self._shared[_APPLIED + worker]) >= generation:
            return 0
        if resume.num_workers != num_workers:
            raise ConfigError(f"state was saved with {resume.num_workers} workers; this run has {num_workers}")
        self._shared[_APPLIED + worker] = generation
        return resume.skip[worker]

    def __iter__(self) -> Iterator[Any]:
        rank, _, _ = self._split()
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        if num_workers > MAX_WORKERS:
            raise ConfigError(f"RemoteDataset supports up to {MAX_WORKERS} DataLoader workers, got {num_workers}")
        epoch = self.epoch  # once: the main process may set the next one while this runs
        skip = self._take_skip(epoch, worker, num_workers)
        seed = (self.seed, epoch, rank, worker)
        metrics = Metrics(self._metrics[1 + worker if info else 0].numpy())
        policy = self.reader.policy(metrics, cancel=threading.Event())
        jobs = self._jobs(epoch, worker, num_workers, policy, resuming=bool(skip))
        release_free_memory()  # the split's temporaries, so that a worker keeps only its share
        data: Any = stream_samples(self.reader, jobs, policy=policy, open_shards=self.open_shards, seed=(*seed, 1),
                                   on_error=self.on_error)
        skip_after = self._skip_point()[0] if skip else -1
        context = stages.Context(self.seed, epoch, rank, worker)
        for position, stage in enumerate(self.stages):
            if position == skip_after:
                data = itertools.islice(data, skip, None)
            data = stage.run(data, context)
        if skip_after == len(self.stages):
            data = itertools.islice(data, skip, None)
        yield from _timed(data, metrics)

    def _jobs(self, epoch: int, worker: int, num_workers: int, policy: RetryPolicy, *, resuming: bool) -> Iterable[Job]:
        """What this worker fetches: its spans, or for plain WebDataset tars without a
        manifest, whole tars dealt round-robin to ranks x workers in the epoch's order."""
        if self.reader.has_manifest():
            return span_jobs(self.reader, self._spans(worker, num_workers, epoch), policy, self.open_shards, self.on_error)
        tars = self.reader.list_tars()
        if not tars:
            self.reader.manifest  # raises ObjectNotFound naming the missing manifest
        if resuming:
            raise ConfigError("resume needs an indexed dataset: run remote-loader index on it")
        rank, world_size, _ = self._split()
        slots, slot = world_size * num_workers, rank * num_workers + worker
        order = shard_order(len(tars), self.seed, epoch, self.shuffle_shards)
        return tar_jobs(self.reader, [tars[k] for position, k in enumerate(order) if position % slots == slot])


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
