"""``RemoteDataset``: stream an uploaded dataset into PyTorch, split across ranks and workers."""

from __future__ import annotations

import copy
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from remote_loader.checks import require_bool, require_int
from remote_loader.config import (
    MAX_WORKERS,
    MOST_EPOCH,
    CacheConfig,
    FetchConfig,
    current_world,
    distributed_world,
    fetch_config,
)
from remote_loader.errors import ConfigError, DatasetChanged, OnError, ResumeError
from remote_loader.pipeline.device import DaliClipDecoder, DeviceDecoder, check_device, clip_place
from remote_loader.pipeline.device import collate as device_collate
from remote_loader.pipeline.order.delivery import Mixing
from remote_loader.pipeline.order.split import rank_size
from remote_loader.pipeline.overwrite import NEXT_PASS, FollowsUploads
from remote_loader.pipeline.sources.indexed import Indexed
from remote_loader.pipeline.sources.tars import Unindexed
from remote_loader.pipeline.stages import chain as stages
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.collate import collate as collate_samples
from remote_loader.pipeline.stages.joint import structured_fields
from remote_loader.pipeline.stages.video import VideoClip
from remote_loader.pipeline.stages.views import default_conversion, owned, pickle_views_as_bytes
from remote_loader.pipeline.state import resume
from remote_loader.pipeline.state.epochs import EpochClock
from remote_loader.pipeline.state.resume import Handover, Layout
from remote_loader.pipeline.state.stream import Data, WorkerStream
from remote_loader.pipeline.state.uploads import Uploads
from remote_loader.read import DatasetReader, Metrics
from remote_loader.read.heap import keep_large_blocks_apart
from remote_loader.storage import Store, check_connection, open_location


class RemoteDataset(FollowsUploads, IterableDataset):
    """Samples of an uploaded dataset, in a fresh shard order every epoch.

    Each epoch the shard order is drawn from (seed, epoch); ranks and then DataLoader
    workers take contiguous ranges of it (see ``pipeline/order/split.py``). Each worker fetches
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
            how long a failing store is retried). Not given, a DataLoader worker that decodes
            on the CPU or runs your functions fetches under a budget of at most 32 MiB and
            keeps no free range buffer (``FetchConfig.for_decoding``): it takes samples no
            faster than it decodes them, and its memory is what a node's many workers add up.
        verify: Check every member's crc32 (on by default). Bytes that fail are fetched
            again up to ``fetch.refetch_attempts`` times.
        on_error: For a sample whose bytes stay corrupt: ``"raise"`` CorruptSampleError
            naming shard and key, or ``"skip"`` it and count it in ``metrics.skipped``. With
            ``unindexed``, a tar that cannot be read is skipped whole, counted as one.
        unindexed: Stream the ``.tar`` objects under the prefix as plain WebDataset tars,
            without a manifest (whole tars dealt to ranks and workers; no resume, no
            equalising). Without it, a prefix with no manifest raises ``DatasetNotFound``.
        cache_dir: A directory on a local disk where shards are kept once fetched and read from
            again, in this epoch or a later one, shared by the node's ranks and workers (one
            fetch a node): docs/cache.md. Default ``REMOTE_LOADER_CACHE_DIR``; none without it
            (``""`` turns off one the environment names).
        cache_bytes: The most bytes the cache holds, all datasets together (an int, or
            ``"500G"``, ``"64GiB"``); default ``REMOTE_LOADER_CACHE_BYTES``, else what leaves
            a tenth of the disk free.
        cache_verify: Check every member read from the cache against its crc32, every epoch
            (default ``REMOTE_LOADER_CACHE_VERIFY``, else off: a shard is checked whole as it
            enters the cache and read as it is while its file is unchanged; docs/cache.md).
            It implies ``verify``: the store's bytes are checked too.
        views: Give each member as a read-only ``memoryview`` rather than ``bytes``: from a
            shard in the node's cache, a view of the file mapped, with no copy (a pipeline
            that hands its bytes to a decoder, or counts them, saves a copy of every sample:
            docs/cache.md); elsewhere a view of the member's own copy. A view that leaves a
            DataLoader worker arrives as ``bytes`` (crossing copies it), and so does one that
            meets torch's default conversion (which would take it for a sequence of ints).
        **connection: ``endpoint_url``, ``access_key``, ``secret_key``, ``region``,
            ``backend``, with a URL.

    Examples:
        >>> ds = (RemoteDataset(client, "bucket", "imagenet").shuffle(1000)
        ...       .decode("pil").to_tuple("jpg;png", "cls").map_tuple(preproc, None).batched(64))
    """

    _inherited_world: tuple[int, int] | None = None  # a copy pickled by a version without it has none

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
        on_error: str | OnError = "raise",
        unindexed: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | str | None = None,
        cache_verify: bool | None = None,
        views: bool = False,
        **connection: Any,
    ) -> None:
        check_connection(RemoteDataset, connection, isinstance(client, str))
        if isinstance(client, str):
            client, location = open_location(client, **connection)
            bucket, base_folder = location.bucket, location.base_folder
        self.on_error = OnError.of(on_error)
        if bucket is None or base_folder is None:
            raise ConfigError("RemoteDataset needs (client, bucket, base_folder) or an s3:// URL")
        open_shards = require_int("open_shards", open_shards, 1)
        seed = require_int("seed", seed, 0, 2**63 - 1)
        require_bool("shuffle_shards", shuffle_shards)
        require_bool("equalize", equalize, optional=True)
        require_bool("verify", verify)
        require_bool("unindexed", unindexed)
        require_bool("views", views)
        if rank is not None or world_size is not None:
            rank, world_size = current_world(rank, world_size)
        self.fetch = fetch_config(fetch)
        self._fetch_given = fetch is not None
        self.reader = DatasetReader(client, bucket, base_folder, verify=verify, fetch=self.fetch,
                                    cache=CacheConfig.of(cache_dir, cache_bytes, verify_reads=cache_verify),
                                    views=views)
        self.reader.after_change = NEXT_PASS
        self.unindexed = unindexed
        self._data: Data = (Unindexed(self.reader, self.on_error) if unindexed
                            else Indexed(self.reader, self.on_error))
        self.seed, self.shuffle_shards = seed, shuffle_shards
        self.mixing = Mixing(open_shards)  # what the source's order mixes: open shards, then shuffle()'s buffer
        self.rank, self.world_size, self.equalize = rank, world_size, equalize
        self._inherited_world = None  # the world of the process that pickled this one
        self.stages: list[stages.Stage] = []
        self._metrics = Metrics.table(1 + MAX_WORKERS)  # row 0: this process; row 1 + w: worker w
        self._epochs = EpochClock()
        self._uploads = Uploads()  # an overwrite seen by any of its processes, for the passes after it
        self._handover = Handover()  # the state loaded last, for the iterations that resume from it
        self._live: WorkerStream | None = None  # this process's latest stream, which gives its state
        self._check: Future[None] | None = None  # the latest pass's manifest check, until that pass takes its answer
        self._loaded_state: Any = None  # the state load_state_dict was given last, for the stages chained after it
        self.fell_back = False
        """Whether ``decode(device="auto")`` found no GPU and decodes on the CPU, in the workers."""
        self._data.prepare(seed, 0, shuffle_shards)

    def __copy__(self) -> RemoteDataset:
        """A shallow copy with its own view of what it loaded and no live stream, sharing the
        numbers in shared memory, as a forked worker does."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._handover, clone._live, clone._check = copy.copy(self._handover), None, None
        return clone

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_live"] = state["_check"] = None  # a stream, and a thread's answer, stay in their process
        if self.rank is None and get_worker_info() is None:  # a spawned DataLoader worker has no process group:
            state["_inherited_world"] = distributed_world()  # it takes this process's world, as it is now
        return state

    @property
    def metrics(self) -> Metrics:
        """Counters of this pipeline's loading, summed over this process and its DataLoader
        workers (their counters live in shared memory): cheap to read every N steps."""
        return Metrics.total(self._metrics)

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration follows: until ``set_epoch`` is called,
        each iteration takes the next one by itself (see ``set_epoch``)."""
        return self._epochs.epoch

    @property
    def states_loaded(self) -> int:
        """How many states ``load_state_dict`` loaded in the main process, as every copy of this
        dataset sees it: a DataLoader of ``loader()`` whose persistent workers started at another
        count refuses its next pass (the workers would not resume from it)."""
        return self._handover.loads()

    def __repr__(self) -> str:
        return f"RemoteDataset({self.reader.location}, stages={len(self.stages)}, epoch={self.epoch})"

    # ------------------------------------------------------------------ the chain

    def _with(self, stage: stages.Stage | None) -> RemoteDataset:
        self._current()
        clone = copy.copy(self)
        clone.stages = [*self.stages, *([stage] if stage is not None else [])]
        clone._metrics = Metrics.table(1 + MAX_WORKERS)
        clone._epochs, clone._handover = EpochClock(self.epoch, auto=self._epochs.auto), Handover()
        clone._uploads = Uploads()
        if self._loaded_state is not None and self._handover.owed() is not None:
            # A state loaded before the chain call: loaded again, as the chain counts its items.
            clone.load_state_dict(self._loaded_state)
        return clone

    def shuffle(self, bufsize: int, initial: int | None = None) -> RemoteDataset:
        """Mix samples in a buffer of ``bufsize`` (output starts at ``initial``, default ``min(bufsize, 100)``).

        The buffer sits at the source, whatever its place among ``decode``, ``map`` and
        ``to_tuple``: it mixes samples as they come from storage, so it holds their encoded
        bytes (copied out of the fetched ranges, or with ``views`` views of the cache's
        mapped files), and those stages, which treat each sample
        alone, give the same results. It comes before ``select`` and ``batched``, once.
        """
        bufsize, first = stages.check_shuffle(bufsize, initial)
        if self.mixing.bufsize:
            raise ConfigError(f"this pipeline shuffles already (shuffle({self.mixing.bufsize})): give shuffle once")
        if not stages.Chain.of(self.stages).one_to_one():
            raise ConfigError("shuffle mixes samples at the source: put it before select and batched")
        clone = self._with(None)
        clone.mixing = Mixing(self.mixing.open_shards, bufsize, first)
        return clone

    def decode(self, mode: str | Callable[..., Any] = "pil", *, min_size: int | None = None,
               threads: int = 0, device: str = "cpu", batched: bool = False,
               cpu_fallback: bool = False, video: VideoClip | None = None) -> RemoteDataset:
        """Decode images (``pil``, ``rgb8``, ``torchrgb``, ``raw`` or a callable) and labels.

        ``min_size``: JPEGs are decoded at a reduced scale (1/2, 1/4, 1/8) whose shorter side
        stays at least ``min_size`` pixels; much faster when the model input is small.
        ``threads``: decode on this many threads (order kept, 1024 at most); libjpeg-turbo and
        Pillow release the GIL, so one process fills several cores.
        ``device``: ``"cuda"`` (or ``"cuda:N"``) decodes a ``RandomResizedCrop``'s JPEGs on
        the GPU, in whole batches, in the main process: each worker only draws each sample's
        crop (the same crops as on the CPU), ``batched`` gathers them, and ``loader()`` hands
        out batches decoded on the device (docs/gpu.md). ``"auto"``: the GPU where there is
        one (and the ``gpu`` extra), else the CPU. ``batched=True`` with ``device="cpu"`` runs
        the batched path on nvImageCodec's CPU backend. ``cuda`` means this process's
        current GPU (``torch.cuda.current_device()``, the rank's under torchrun): set it
        first. Which decoder works there is found now, and a GPU stage that would decode on
        the CPU raises ``ConfigError`` unless ``cpu_fallback=True``.
        ``video``: a ``VideoClip`` decodes a clip of each video field (mp4, mov, mkv, webm,
        avi) in the workers, its frames drawn from (seed, epoch, key) (docs/video.md); with
        its ``device``, the workers draw the clips and DALI decodes them in this process
        (``loader()``); without it, videos stay their files' bytes.
        """
        require_bool("batched", batched)
        require_bool("cpu_fallback", cpu_fallback)
        if batched or device not in ("cpu", "auto"):  # before a device is probed for it
            stages.require_crop(mode, repr(device))
        if isinstance(video, VideoClip) and video.device is not None:
            clip_place(video.device)  # DALI and the device there, checked now
        self._require_form("decode", ("dict", None), "decodes the fields of dict samples: put it before to_tuple"
                           " and batched")
        if batched or device not in ("cpu", "auto"):
            self._require_unstructured(device)
        place = check_device(device, batched, cpu_fallback, mode if isinstance(mode, RandomResizedCrop) else None)
        clone = self._with(stages.Decode(mode, min_size, threads, device=place, on_error=self.on_error, video=video))
        if self.on_error.skips:  # a sample that does not decode is left out, counted (a worker's, on a device)
            clone = clone._with(stages.DropUndecodable())
        clone.fell_back = self.fell_back or (device == "auto" and place is None)
        return clone

    def _require_unstructured(self, device: Any) -> None:
        """ConfigError where the manifest says the samples are structured (``0.jpg``,
        ``1.boxes.npy``): decoding on a device crops classification samples only. Said now,
        not by a DataLoader worker at the first sample."""
        structured = structured_fields(self._field_names() or ())
        if structured:
            raise ConfigError(f"decode(device={device!r}) crops classification samples (an image and its label);"
                              f" this dataset's samples have the fields {stages.listed(structured)}: decode them with"
                              " RandomResizedCrop on the CPU, which crops their targets with their images")

    def to_tuple(self, *fields: str) -> RemoteDataset:
        """Samples become tuples of these fields (``"jpg;png"``: the first present); one
        string of several names, ``to_tuple("jpg;png cls")``, as in WebDataset, works too.

        A name is a field as the samples hold it: ``jpg``, ``cls``, or a structured sample's
        ``0.jpg``, ``1.boxes.npy`` (``remote-loader info`` lists them), and ``__key__``. Names
        are checked now against the fields the manifest lists, where the stages before keep
        samples' fields as they are (``decode``, ``select``): a ``ConfigError`` names the
        fields there are.
        """
        stage = stages.ToTuple(fields)
        self._require_form("to_tuple", ("dict", "batch", None), "picks fields of dict samples: give it once,"
                           " before map_tuple")
        stage.check(self._field_names(), self.reader.location)
        return self._with(stage)

    def _form(self) -> stages.Form:
        """What the samples are at the end of the chain so far (``stages.Form``)."""
        form: stages.Form = "dict"
        for stage in self.stages:
            form = stage.form(form)
        return form

    def _require_form(self, call: str, takes: tuple[stages.Form, ...], does: str) -> None:
        """ConfigError, now, where ``call`` cannot take the samples the chain so far makes."""
        form = self._form()
        if form not in takes:
            made = f"tuples of {form}" if isinstance(form, int) else "batches" if form == "batch" else "dicts"
            raise ConfigError(f"{call} {does}; here the samples are {made}")

    def _field_names(self) -> frozenset[str] | None:
        """The field names the samples hold at the end of the chain so far (``__key__`` and
        ``__shard__`` among them); None where that is not known before they stream."""
        listed = () if self.unindexed else self.reader.manifest.fields
        names: frozenset[str] | None = frozenset((*listed, "__key__", "__shard__")) if listed else None
        for stage in self.stages:
            names = stage.fields(names)
        return names

    def map(self, fn: Callable[[Any], Any], *, threads: int = 0) -> RemoteDataset:
        """Apply ``fn`` to every sample, on ``threads`` threads if given (order kept, 1024 at most).

        Threads pay off for code that releases the GIL (Pillow's resize, torch ops,
        numpy on large arrays); pure-Python code belongs in DataLoader worker processes.
        """
        return self._with(stages.Map(fn, threads))

    def map_tuple(self, *fns: Callable[[Any], Any] | None) -> RemoteDataset:
        """Apply ``fns[i]`` to element ``i`` of each tuple (None keeps it)."""
        stage = stages.MapTuple(fns)
        self._require_form("map_tuple", (None, "batch", len(fns)), f"applies {len(fns)} functions to the elements of"
                           f" tuples of {len(fns)}: put to_tuple with as many fields before it")
        return self._with(stage)

    def select(self, predicate: Callable[[Any], bool]) -> RemoteDataset:
        """Keep samples for which ``predicate`` is true."""
        return self._with(stages.Select(predicate))

    def batched(
        self, batchsize: int, collation_fn: Callable[[list[Any]], Any] | None = None, partial: bool = True
    ) -> RemoteDataset:
        """Group samples into batches, collated by ``collation_fn`` (default:
        ``remote_loader.collate``, which stacks a sample's fields as torch's default_collate
        does and keeps targets that are dicts or lists per sample; after ``decode(device=...)``,
        torch's default_collate, which also gathers the images to decode)."""
        deferred = any(s.on_device() for s in self.stages)
        collate = collation_fn or (device_collate if deferred else collate_samples)
        return self._with(stages.Batched(batchsize, collate, partial))

    def batch_decoder(self) -> DeviceDecoder | None:
        """What decodes this pipeline's batches on a device, in the main process, when it
        has ``decode(..., device=...)``; None otherwise. ``loader()`` and
        ``decode_batches()`` use it."""
        found = next(filter(None, (s.on_device() for s in self.stages)), None)
        if found is None:
            return None
        maker, place = found
        metrics = Metrics(self._metrics[0].numpy())
        if isinstance(maker, VideoClip):  # clips, which DALI decodes
            assert maker.crop is not None
            return DaliClipDecoder(maker.crop, clip_place(place), maker.frames, maker.layout, on_error=self.on_error,
                                   metrics=metrics)
        return DeviceDecoder(maker, place, on_error=self.on_error, metrics=metrics)

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
        epoch = require_int("epoch", epoch, 0, MOST_EPOCH)  # what a state saved of it may hold
        self._handover.check_epoch(epoch)
        self._uploads.epoch_set()
        self._epochs.set_epoch(epoch)
        self._current()
        self._data.prepare(self.seed, epoch, self.shuffle_shards)

    def _layout(self) -> Layout:
        """This rank's place in the world now, with the dataset and the stages."""
        inherited = self._inherited_world if get_worker_info() is not None else None  # a spawned worker's
        rank, world_size = current_world(self.rank, self.world_size, inherited)
        equalize = world_size > 1 if self.equalize is None else self.equalize
        return Layout(self.reader, self.seed, self.shuffle_shards, rank, world_size, equalize, self.mixing,
                      tuple(self.stages))

    @property
    def classes(self) -> list[str]:
        """The class names recorded at upload (class ``i`` is ``classes[i]``), empty where none
        were (and for unindexed tars)."""
        self._current()
        return self._data.classes

    def __len__(self) -> int:
        """Items this rank yields per epoch (batches, after ``batched``), whatever the number
        of DataLoader workers. A TypeError where that cannot be known in advance: after
        ``select`` (it depends on the samples) and for unindexed tars."""
        self._current()
        total = self._data.samples()
        layout = self._layout()
        count = layout.chain.outputs(rank_size(total, layout.rank, layout.world_size, layout.equalize))
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
        if not self._data.resumable:
            raise ResumeError("checkpoints need an indexed dataset: run remote-loader index on it")
        if consumed is not None:
            consumed = require_int("state_dict's consumed (items this epoch)", consumed, 0)
            num_workers = require_int("state_dict's num_workers", num_workers, 0, MAX_WORKERS)
            epoch = self._epochs.current
            return resume.count_state(self._layout(), epoch, consumed, num_workers,
                                      self._handover.counted_before(epoch))
        if self._live is not None:
            return dict(self._live.get_state())
        info = get_worker_info()
        if info is None and self._epochs.in_workers:
            raise ResumeError("this dataset's iteration runs in DataLoader workers, which this process cannot ask:"
                              " use torchdata's StatefulDataLoader and its state_dict(), or pass consumed= and"
                              " num_workers= for a plain DataLoader")
        worker, workers = (info.id, info.num_workers) if info else (0, 1)  # the next iteration's, before it starts
        own = self._handover.own_epoch()
        return self._stream(self._epochs.epoch if own is None else own, worker, workers).get_state()

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

        A state with nothing left of its epoch, loaded where another epoch is set, is used
        up: the epoch set stays. Load before the DataLoader starts its workers.
        """
        self._load(state, own=False)

    def load_own_state(self, state: Any) -> None:
        """Resume this process's next iteration from ``state``, the state of its own iteration,
        as a DataLoader worker that torchdata's StatefulDataLoader restores does: that
        iteration follows the state's epoch, whatever epoch is set, and the iterations after
        it follow the epoch set (or, without ``set_epoch``, the epochs after the state's). A
        state with nothing left of its epoch is loaded as ``load_state_dict`` loads it.
        ``loader(ds, stateful=True)`` without workers loads its state so.
        """
        self._load(state, own=True)

    def _load(self, state: Any, own: bool) -> None:
        if not self._data.resumable:
            raise ResumeError("resume needs an indexed dataset: run remote-loader index on it")
        self._current()  # a state of an upload since replaced is refused
        info = get_worker_info()
        own = own or info is not None  # a worker's state is its own: held for its next iteration only
        worker = (info.id, info.num_workers) if info else (0, 1) if own else None
        loaded = resume.load(self._layout(), state, worker)
        if own and info is None and loaded.finished:  # nothing of its epoch left: no pass of its own
            self._load(state, own=False)
            return
        self._handover.hold(loaded, in_worker=own)
        if own:
            self._live, self._loaded_state = None, None
            return
        if loaded.finished and not self._epochs.auto and self._epochs.epoch != loaded.epoch:
            # Nothing of its epoch left, and another epoch set (torchdata without workers loads
            # the state as the next pass begins, after set_epoch): used up, the epoch set stays.
            self._handover.check_epoch(self._epochs.epoch)
        else:  # the next iteration takes the state's epoch, or the next where it was finished
            self._epochs.seek(loaded.epoch, loaded.finished)
        self._live, self._loaded_state = None, state

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        # The stream is made now, so that a StatefulDataLoader asking for the state before the
        # first item gets this iteration's; an error waits for the first next(), where
        # DataLoader workers report it (one raised here ends a persistent worker).
        self._live = None
        converted = self.reader.views and default_conversion(sys._getframe(1))
        try:
            return self._begin(converted)
        except Exception as error:  # noqa: BLE001 - raised unchanged at the first next()
            return _failing(error)

    def _begin(self, converted: bool = False) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        if num_workers > MAX_WORKERS:
            raise ConfigError(f"RemoteDataset supports up to {MAX_WORKERS} DataLoader workers, got {num_workers}")
        # once: the main process may set the next one while this runs
        epoch = self._epochs.begin(info, own=self._handover.own_epoch())
        reader = self.reader
        try:
            followed = self._follow(epoch, info is not None)
            reader, check = self.reader, self._check_current(followed)
            stream = self._stream(epoch, worker, num_workers, take=True)
        except DatasetChanged:
            self._saw(reader)
            raise
        self._live = stream
        items = iter(stream)
        if converted:
            items = map(owned, items)  # torch's default conversion would take a view for a sequence of ints
        if reader.views and info is not None:
            pickle_views_as_bytes()  # what leaves the worker crosses as bytes: crossing copies it anyway
        if info is not None and not stages.streams_bytes(self.stages):
            keep_large_blocks_apart()  # a decoding worker's large temporaries do not stay in its heap once freed
        return self._watched(items, reader, check)

    def _decodes_on_cpu(self) -> bool:
        """Whether a worker of this pipeline takes its samples at the rate it decodes them on
        the CPU (or runs the user's functions), with no ``fetch`` given: its budget is then
        ``FetchConfig.for_decoding``'s."""
        return not self._fetch_given and not stages.streams_bytes(self.stages) \
            and not any(stage.on_device() for stage in self.stages)

    def _stream(self, epoch: int, worker: int, num_workers: int, take: bool = False) -> WorkerStream:
        """Worker ``worker``'s stream of ``epoch``, reset to where it starts (a loaded state
        applies once: ``take`` marks it used). Without ``take``, for ``state_dict()``, a load
        that persistent workers missed is not refused here: torchdata asks a worker for its
        state as a pass begins, and an error there ends the worker (the pass reports it)."""
        layout = self._layout()
        loaded = self._handover.applying(epoch, worker, peek=not take)
        entry = resume.entry(layout, loaded, epoch, worker, num_workers) if self._data.resumable else None
        metrics = Metrics(self._metrics[1 + worker if get_worker_info() else 0].numpy())
        decoding = get_worker_info() is not None and self._decodes_on_cpu()  # a smaller budget, fetch not given
        session = self.reader.session(metrics, cancel=threading.Event(),
                                      fetch=self.reader.fetch.for_decoding() if decoding else None)
        stream = WorkerStream(self._data, layout, epoch, worker, num_workers, metrics, session).reset(entry)
        if take:
            self._handover.applied(loaded, worker)
        return stream


def _failing(error: Exception) -> Iterator[Any]:
    try:
        raise error
    finally:
        del error  # the error's traceback holds this frame: it must not hold the error
    yield  # a generator: it raises at the first next()
