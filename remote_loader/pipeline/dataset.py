"""``RemoteDataset``: stream an uploaded dataset into PyTorch, split across ranks and workers."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from remote_loader.config import FetchConfig, current_world, require_bool, require_int
from remote_loader.errors import ConfigError, DatasetNotFound, ResumeError
from remote_loader.pipeline import stages
from remote_loader.pipeline.resume import MAX_WORKERS, Checkpoints, Layout, Progress, route, skip_delivered
from remote_loader.pipeline.source import ShardSource
from remote_loader.pipeline.split import EpochOrders, plan_spans, rank_size, shard_order
from remote_loader.read import DatasetReader, Metrics
from remote_loader.read.heap import release_free_memory
from remote_loader.storage import Store, open_location


class RemoteDataset(IterableDataset):
    """Samples of an uploaded dataset, in a fresh shard order every epoch.

    Each epoch the shard order is drawn from (seed, epoch); ranks and then DataLoader
    workers take contiguous ranges of it (see ``pipeline/split.py``). Each worker fetches
    its shards ahead with parallel ranged GETs under ``fetch.prefetch_bytes`` and mixes
    samples of ``open_shards`` shards at once.

    Args:
        client: A store from ``make_client``, a boto3 S3 client or ``minio.Minio`` of your own (see
            docs/storage.md), or an ``s3://bucket/prefix`` URL.
        bucket: The bucket (omit with a URL).
        base_folder: The dataset's prefix (omit with a URL).
        seed: Seed of the shard order, the shard mixing and the shuffle buffer.
        shuffle_shards: Shuffle the shard order each epoch.
        open_shards: Shards read at once by each worker, their samples interleaved.
        rank: This process's rank; default from torch.distributed, else ``RANK``.
        world_size: Number of ranks; default from torch.distributed, else ``WORLD_SIZE``.
        equalize: Give every rank the same sample count by wrapping around (repeating at
            most ``world_size - 1`` samples); default on when ``world_size > 1``.
        fetch: Part size, concurrency, prefetch byte budget, checksum refetches, and in
            ``fetch.retry`` how requests are retried (``RetryConfig.outage_deadline`` bounds
            how long a failing store is retried).
        verify: Check every member's crc32 (on by default). Bytes that fail are fetched
            again up to ``fetch.refetch_attempts`` times.
        on_error: For a sample whose bytes stay corrupt: ``"raise"`` CorruptSampleError
            naming shard and key, or ``"skip"`` it and count it in ``metrics.skipped``.
        unindexed: Stream the ``.tar`` objects under the prefix as plain WebDataset tars,
            without a manifest (whole tars dealt to ranks and workers; no resume, no
            equalising). Without it, a prefix with no manifest raises ``DatasetNotFound``.
        **connection: ``endpoint_url``, ``access_key``, ``secret_key``, ``region``,
            ``backend``, with a URL.

    Examples:
        >>> ds = (RemoteDataset(client, "bucket", "imagenet").shuffle(1000)
        ...       .decode("pil").to_tuple("jpg;png", "cls").map_tuple(preproc, None).batched(64))
    """

    def __init__(
        self,
        client: Store | str | Any,
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
            bucket, base_folder = location.bucket, location.base_folder
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
            _ = self.reader.counts  # read now, so forked DataLoader workers share its arrays; DatasetNotFound
        elif self.reader.has_manifest():
            raise ConfigError(f"{self.reader.location} has a manifest: unindexed=True is for tars without one")
        self.seed, self.shuffle_shards, self.open_shards = seed, shuffle_shards, open_shards
        self.rank, self.world_size, self.equalize = rank, world_size, equalize
        self.stages: list[stages.Stage] = []
        self._metrics = Metrics.table(1 + MAX_WORKERS)  # row 0: this process; row 1 + w: worker w
        self._checkpoints = Checkpoints()
        self._orders = EpochOrders()  # shared by the pipeline's copies
        if not unindexed:
            self._orders.get(self.reader.counts, seed, 0, shuffle_shards)  # before DataLoader workers fork

    def __copy__(self) -> RemoteDataset:
        """A shallow copy with its own view of the checkpoints (what it loaded and its live
        iteration), sharing the counters in shared memory, as a forked worker does."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._checkpoints = copy.copy(self._checkpoints)
        return clone

    @property
    def metrics(self) -> Metrics:
        """Counters of this pipeline's loading, summed over this process and its DataLoader
        workers (their counters live in shared memory): cheap to read every N steps."""
        return Metrics.total(self._metrics)

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration follows: until ``set_epoch`` is called,
        each iteration takes the next one by itself (see ``set_epoch``)."""
        return self._checkpoints.epoch

    def __repr__(self) -> str:
        return f"RemoteDataset({self.reader.location}, stages={len(self.stages)}, epoch={self.epoch})"

    # ------------------------------------------------------------------ the chain

    def _with(self, stage: stages.Stage) -> RemoteDataset:
        clone = copy.copy(self)
        clone.stages = [*self.stages, stage]
        clone._metrics = Metrics.table(1 + MAX_WORKERS)
        clone._checkpoints = Checkpoints(self.epoch, auto=self._checkpoints.auto)
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

        Without it, each iteration (each pass of a DataLoader, persistent workers or not)
        takes the next epoch by itself: 0, 1, 2..., or after ``load_state_dict`` the state's
        epoch and then the ones after it. Once called, iterations follow the epoch set, exactly:
        call it before every epoch. It reaches DataLoader workers too, persistent ones
        included (the epoch lives in shared memory). A loaded resume state applies to the
        first iteration of its own epoch only.
        """
        if type(epoch) is not int or epoch < 0:
            raise ConfigError(f"epoch must be an integer >= 0, got {epoch!r}")
        self._checkpoints.set_epoch(epoch, self._layout())
        if not self.unindexed:
            self._orders.get(self.reader.counts, self.seed, epoch, self.shuffle_shards)  # before workers fork

    def _layout(self) -> Layout:
        """This rank's place in the world now, with the dataset and the stages."""
        rank, world_size = current_world(self.rank, self.world_size)
        equalize = world_size > 1 if self.equalize is None else self.equalize
        return Layout(self.reader, self.seed, self.shuffle_shards, rank, world_size, equalize, tuple(self.stages))

    def __len__(self) -> int:
        """Items this rank yields per epoch (batches, after ``batched``), whatever the number
        of DataLoader workers. A TypeError where that cannot be known in advance: after
        ``select`` (it depends on the samples) and for unindexed tars."""
        if self.unindexed:
            raise TypeError("len() of unindexed tars is unknown: their sample counts are read as they stream")
        layout = self._layout()
        count: int | None = rank_size(len(self.reader), layout.rank, layout.world_size, layout.equalize)
        for stage in self.stages:
            count = None if count is None else stage.outputs(count)
        if count is None:
            raise TypeError("len() of a pipeline with select() is unknown: it depends on the samples")
        return count

    # ------------------------------------------------------------------ checkpoints

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
            return self._checkpoints.count_state(self._layout(), consumed, num_workers)
        if self.unindexed:
            raise ResumeError("checkpoints need an indexed dataset: run remote-loader index on it")
        return self._checkpoints.state(self._layout(), get_worker_info())

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
        self._checkpoints.load(self._layout(), state, get_worker_info())

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        # The plan is made now, so that a StatefulDataLoader asking for the state before the
        # first item gets this iteration's; an error waits for the first next(), where
        # DataLoader workers report it (one raised here ends a persistent worker).
        self._checkpoints.live = None
        try:
            return self._start()
        except Exception as error:  # noqa: BLE001 - raised unchanged at the first next()
            return _failing(error)

    def _start(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        if num_workers > MAX_WORKERS:
            raise ConfigError(f"RemoteDataset supports up to {MAX_WORKERS} DataLoader workers, got {num_workers}")
        self._checkpoints.iterating_in(info)
        epoch = self._checkpoints.begin(info)  # once: the main process may set the next one while this runs
        if self.unindexed:
            checkpoints = self._checkpoints
            if checkpoints.resume_for(epoch, worker, num_workers) is not None or checkpoints.position is not None:
                raise ResumeError("resume needs an indexed dataset: run remote-loader index on it")
            return self._iterate(epoch, worker, num_workers, None, 0)
        progress, skip = self._checkpoints.start(self._layout(), epoch, worker, num_workers)
        return self._iterate(epoch, worker, num_workers, progress, skip)

    def _iterate(self, epoch: int, worker: int, num_workers: int, progress: Progress | None,
                 skip: int) -> Iterator[Any]:
        layout = self._layout()
        info = get_worker_info()
        metrics = Metrics(self._metrics[1 + worker if info else 0].numpy())
        policy = self.reader.policy(metrics, cancel=threading.Event())
        source = ShardSource(
            self.reader,
            policy,
            open_shards=self.open_shards,
            seed=(self.seed, epoch, layout.rank, worker, 1),
            on_error=self.on_error,
            progress=progress,
        )
        names = stages.InFlight()
        data = names.entering(self._samples(source, epoch, worker, num_workers, progress))
        counted = progress.done if progress is not None else _ignore

        def done(ids: Any) -> None:
            counted(ids)
            names.left(ids)

        # What runs between stages, made before the stages are chained: the skip of a count
        # state, and the replay point, before which a replay's placeholders go around stages.
        taps: dict[int, list[Callable[[Iterator[tuple[Any, Any]]], Iterator[tuple[Any, Any]]]]] = {}
        if skip:
            taps.setdefault(layout.skip_point()[0], []).append(partial(skip_delivered, count=skip, done=done))
        point = progress.point if progress is not None else None
        replay_at = layout.replay_point()[0] if point is not None else -1
        if point is not None:
            taps.setdefault(replay_at, []).append(partial(point.run, done=done))
        routed = point is not None and point.replaying and point.replay is not None and point.replay.placeholders
        context = stages.Context(self.seed, epoch, layout.rank, worker)
        for position, stage in enumerate(self.stages):
            for tap in taps.get(position, ()):
                data = tap(data)
            data = (route(stage) if routed and position < replay_at else stage).paired(data, context, done, names)
        for tap in taps.get(len(self.stages), ()):
            data = tap(data)
        yield from _timed(_deliver(data, done, metrics), metrics)

    def _samples(
        self, source: ShardSource, epoch: int, worker: int, num_workers: int, progress: Progress | None
    ) -> Iterator[tuple[int, Any]]:
        """What this worker reads: its plan's spans, or for plain WebDataset tars without a
        manifest, whole tars dealt round-robin to ranks x workers in the epoch's order."""
        if progress is not None:
            counts = self.reader.counts
            order, ends = self._orders.get(counts, self.seed, epoch, self.shuffle_shards, keep=False)
            spans = plan_spans(counts, order, progress.plan.rows, ends)
            del order, ends
            release_free_memory()  # the split's temporaries, so that a worker keeps only its share
            return source.spans(spans)
        tars = self.reader.list_tars()
        if not tars:
            raise DatasetNotFound(
                f"no .tar objects under {self.reader.location} to stream unindexed",
                bucket=self.reader.location.bucket,
                key=self.reader.location.key(""),
            )
        layout = self._layout()
        slots, slot = layout.world_size * num_workers, layout.rank * num_workers + worker
        order = shard_order(len(tars), self.seed, epoch, self.shuffle_shards)
        return source.tars([tars[k] for position, k in enumerate(order) if position % slots == slot])


def _failing(error: Exception) -> Iterator[Any]:
    raise error
    yield  # a generator: it raises at the first next()


def _ignore(ids: Any) -> None:
    pass


def _deliver(pairs: Iterator[tuple[Any, Any]], done: Callable[[Any], None], metrics: Metrics) -> Iterator[Any]:
    """The items; each one's samples count as delivered as it leaves (``metrics.samples``)."""
    for ids, item in pairs:
        done(ids)
        metrics.add(samples=_leaves(ids))
        yield item


def _leaves(ids: Any) -> int:
    """How many samples an item's ids name: one id, or a batch's (nested) list of them."""
    return sum(_leaves(i) for i in ids) if isinstance(ids, list) else 1


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
