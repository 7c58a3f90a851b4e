"""``upload_cv_dataset``: a torchvision-style dataset becomes shards plus a manifest in a bucket.

Samples are permuted with the seed, cut into tasks of consecutive permuted indices, and
each task runs in an executor (a process pool by default). The manifest is written last,
so a dataset is visible only when whole; a re-run of an interrupted upload with the same
arguments keeps the finished tasks' shards and writes the rest.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

import numpy as np

from remote_loader.checks import MOST_BYTES, one_line, require_bool, require_int
from remote_loader.config import RetryConfig
from remote_loader.errors import (
    ConfigError,
    OnError,
    StorageError,
    UploadConflict,
    UploadError,
)
from remote_loader.format import Manifest
from remote_loader.format.columns import MOST_SAMPLES_PER_SHARD
from remote_loader.format.shard import member_bytes
from remote_loader.storage import DEFAULT_PART_SIZE, Location, Store, as_store
from remote_loader.storage.retrying import Retry, RetryingStore
from remote_loader.storage.writer import check_part_size
from remote_loader.upload import claim, fingerprint, keeping, tasks
from remote_loader.upload.encode import EncodeOptions, encode_item
from remote_loader.upload.executors import Where
from remote_loader.upload.sources import load_source, uploaded_form
from remote_loader.upload.summary import UploadSummary
from remote_loader.upload.tasks import TaskSpec
from remote_loader.upload.verify import CheckSpec
from remote_loader.upload.video_classes import ClassVideos
from remote_loader.upload.watch import DEFAULT_STALL_TIMEOUT
from remote_loader.upload.written import Written

log = logging.getLogger("remote_loader")

_ESTIMATE_SAMPLES = 64
"""Samples encoded to judge the mean size: photographs' sizes vary by about a third, and 16
of them missed the mean by up to 12%, so every task of ~64 MB spilled a shard of ~1 MB."""


MAXSIZE_RANGE = (4096, MOST_BYTES)
"""The ``maxsize`` an upload takes: room for an index and a sample, and at most what a file can be."""
MAXCOUNT_RANGE = (1, MOST_SAMPLES_PER_SHARD)
"""The ``maxcount`` an upload takes: at most what a shard can hold (and the manifest record)."""


def _plan_task_size(dataset: Any, order: np.ndarray, options: EncodeOptions, maxsize: int, maxcount: int) -> int:
    """Samples per task: ``maxcount``, or fewer when ``maxsize`` binds, judged from a few samples.

    Encoding the first samples here also reports a dataset of the wrong shape at once, in
    this process, before any worker starts.
    """
    sizes = []
    for index in order[:_ESTIMATE_SAMPLES]:
        try:
            sizes.append(member_bytes(encode_item(tasks.read_item(dataset, int(index)), options, int(index))))
        except UploadError:
            continue  # judged again, with on_error, by the task that owns it
    if not sizes:
        return maxcount
    per_sample = float(np.mean(sizes)) * 1.1 + 64  # margin for size spread and index bytes
    return max(1, min(maxcount, int((maxsize - 4096) / per_sample)))


def upload_cv_dataset(
    ds: Any,
    *,
    client: Store | Any,
    bucket: str,
    base_folder: str,
    maxsize: float = 1e8,
    maxcount: int = 100_000,
    workers: int | None = None,
    seed: int = 0,
    image_format: str = "jpeg",
    quality: int = 90,
    on_error: str | OnError = "raise",
    shuffle: bool = True,
    executor: Executor | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    retry: RetryConfig | None = None,
    overwrite: bool = False,
    progress: bool = True,
    verify: bool = True,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
    frames_as_video: str | None = None,
) -> UploadSummary:
    """Pack a torchvision-style dataset into shards in ``s3://bucket/base_folder/``.

    Args:
        ds: ``len(ds)`` and ``ds[i]``, whatever it returns (docs/uploading.md says how each
            kind is stored); or a source spec naming one, an image-folder directory or
            ``"module:function"``, which a cluster's workers then build themselves.
        client: The store (see ``make_client``), or a boto3 S3 client or ``minio.Minio`` of
            your own (used as it is in this process; worker processes make their own client
            for its endpoint, with the credentials of their environment).
        bucket: Bucket to write to (must exist).
        base_folder: Key prefix of the dataset.
        maxsize: Maximum shard size in bytes.
        maxcount: Maximum samples per shard.
        workers: Encoding processes (default: CPU count); 0 encodes in this process.
        seed: Seed of the permutation applied before sharding.
        image_format: ``jpeg``, ``png`` or ``webp`` for in-memory images.
        quality: Encoding quality (1..100) for JPEG and WebP.
        on_error: ``"raise"`` (default) stops at the first bad sample; ``"skip"`` skips it
            and counts it in the manifest and the summary.
        shuffle: Permute samples before sharding (on by default).
        executor: Run tasks here instead of a new process pool, e.g. a Dask cluster's
            ``dask_client.get_executor()`` (not the ``Client``): each of its workers gets the
            dataset, or builds it from a source spec, once per upload; any other executor
            receives it with every task.
        part_size: Multipart part size in bytes.
        retry: How every request is retried (``RetryConfig``); a task that fails on an
            outage is written again whole.
        overwrite: Replace a dataset uploaded there: new shards beside the old, the manifest
            switched in one PUT, the old shards deleted after (a failure leaves it readable).
        progress: Show a progress bar.
        verify: Where shards are already uploaded (the dataset is there, or a run resumed),
            read every item they hold again in the workers and compare it with its digest: a
            dataset whose item differs is refused, an interrupted run's task written again.
            False compares the 128 sampled items only (said so): a fast resume of a huge upload.
        stall_timeout: Seconds one item may take in this process or a worker of the upload's
            own before the upload ends with an ``UploadError`` naming it (finished tasks are
            kept), warned of at half of it (at most 60 s); None waits for ever.
        frames_as_video: ``"h264"`` (lossy) or ``"lossless"``: frames (uint8 arrays and tensors
            of 1 or 3 channels, torchvision ``Video``s) stored as an H.264 video, read back as
            they were; None (the default) stores their values (docs/video.md).

    Returns:
        What was uploaded, with throughput.

    Raises:
        ConfigError: An argument is invalid (``executor`` a Dask ``Client``, say).
        UploadError: A sample is bad (naming its index), the dataset is empty, another dataset
            (or an item ``ds[i]`` that differs) is there, or an item outlasted ``stall_timeout``.
    """
    started = time.perf_counter()
    params, options = _parameters(maxsize=maxsize, maxcount=maxcount, workers=workers, seed=seed,
                                  image_format=image_format, quality=quality, on_error=on_error, shuffle=shuffle,
                                  overwrite=overwrite, progress=progress, bucket=bucket, base_folder=base_folder,
                                  frames_as_video=frames_as_video)
    running = Running(workers, _executor(executor), check_part_size(part_size), _stall_timeout(stall_timeout),
                      bool(require_bool("verify", verify)), overwrite, progress)
    return _upload(ds, *_location(client, bucket, base_folder), params, options, _retry(retry), started, running)


def _location(client: Any, bucket: str, base_folder: str) -> tuple[Store, Location]:
    """The store, and the dataset's location in it."""
    store, folder = as_store(client, bucket), base_folder.strip("/")
    return store, Location(bucket, folder, store.path_of(bucket, folder))



@dataclass(frozen=True)
class Running:
    """How an upload runs, apart from what it writes."""

    workers: int | None
    executor: Executor | None
    part_size: int
    stall_timeout: float | None
    verify: bool
    overwrite: bool
    progress: bool

    def where(self, source: str | None) -> Where:
        """Where the upload's jobs run: on ``workers`` processes (default: one per core), 0 in
        this process, or on the caller's executor (at least 1, to group its tasks)."""
        processes = (os.cpu_count() or 1) if self.workers is None else self.workers
        processes = processes if self.executor is None else max(1, processes)
        return Where(processes, self.executor, self.stall_timeout, self.progress, source)


def _executor(value: Any) -> Executor | None:
    """``executor`` checked: None, or an object with ``submit`` that is not a Dask ``Client``
    (whose ``submit`` returns Dask's futures, which ``concurrent.futures`` cannot wait for)."""
    dask_client = getattr(sys.modules.get("distributed"), "Client", None)  # never imported here for the check
    if isinstance(dask_client, type) and isinstance(value, dask_client):
        raise ConfigError(f"executor= got a {type(value).__module__}.{type(value).__qualname__} (a Dask client),"
                          " not an executor: pass client.get_executor()")
    if value is not None and not callable(getattr(value, "submit", None)):
        raise ConfigError(f"executor must be a concurrent.futures executor (with submit), got {type(value).__name__}")
    return value


def _stall_timeout(value: float | None) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ConfigError(f"stall_timeout must be a number of seconds > 0, or None, got {value!r}")
    return None if value is None else float(value)


def _length(ds: Any) -> int:
    """``len(ds)``; ConfigError for a dataset without one (an iterable dataset), UploadError
    quoting what its ``__len__`` raised, on one line."""
    if not hasattr(type(ds), "__len__"):
        raise ConfigError(f"the dataset ({type(ds).__name__}) has no len(): the upload reads a map-style dataset,"
                          " len(ds) and ds[i] (an iterable one has no index to resume by)")
    try:
        return len(ds)
    except Exception as exc:
        raise UploadError(f"len(ds) raised {type(exc).__name__}: {one_line(exc)}") from exc


def _upload(ds: Any, client: Store, location: Location, params: dict[str, Any], options: EncodeOptions,
            retry: RetryConfig, started: float, running: Running) -> UploadSummary:
    """The upload, its arguments checked: see what the prefix holds (the first request: a
    missing bucket, an endpoint that does not answer or keys it refuses are said before a
    source spec's dataset is built or any item read), open the dataset, claim the prefix (or
    resume this upload's interrupted run), write the tasks not yet done, then switch the
    manifest and clean up."""
    # Every request here is retried like a task's, so a 503 or a restart of the store after
    # hours of encoding does not end the upload at its manifest PUT.
    store = RetryingStore(client, Retry(retry, client))
    before = claim.Before.read(store, location)
    source = ds if isinstance(ds, str) else None
    ds = load_source(source) if source is not None else uploaded_form(ds)
    params["samples"] = num = _length(ds)
    if isinstance(ds, ClassVideos):
        params["video_clips"] = ds.clip_index.as_params()
    if num == 0:
        raise UploadError("the dataset is empty: nothing to upload")
    # The items, not only their settings: running the upload again over other data is not resuming it.
    params["items"] = fingerprint.items(partial(tasks.read_item, ds), partial(_encodes, options), num)
    if before.existing is not None and before.found is not None:
        if claim.same_upload(before.existing.params.get("upload"), params) and not running.overwrite:
            summary = keeping.kept_whole(ds, before.existing, claim.dataset_shards(store, location, before.found[0]),
                                         CheckSpec(client, location, retry), running.where(source), options,
                                         sampled=len(fingerprint.indices(num)), verify=running.verify,
                                         started=started)
            claim.tidy(store, location, before)  # what the upload's own clean-up could not remove
            return summary
        if not running.overwrite:
            there = claim.what_differs(before.existing.params.get("upload"), params)
            raise UploadError(f"{location} already holds {there}; pass overwrite=True (--overwrite) to replace it")
    order = np.random.default_rng(params["seed"]).permutation(num) if params["shuffle"] else np.arange(num)
    held = claim.hold(store, location, before, params, running.overwrite, lambda: _plan_task_size(
        ds, order, options, params["maxsize"], params["maxcount"]))
    spec = TaskSpec(client, location, options, params["maxsize"], params["maxcount"], OnError.of(params["on_error"]),
                    running.part_size, max(6, len(str(num - 1))), held.run, retry)
    writing = keeping.Writing(spec, claim.kept(store, location, held, num), order, held.task_size, running.verify)
    try:
        seconds = keeping.run_writing(ds, writing, running.where(source), num)
    except StorageError as exc:
        if exc.code != "NoSuchUpload":
            raise
        raise UploadConflict(
            f"{location}: this run's multipart uploads were aborted while it wrote them ({one_line(exc)}), as an"
            " upload with the same parameters does when it resumes a run it takes for interrupted: another upload"
            " of this dataset is likely running and will finish it; run this one again once it has ended (it keeps"
            " what is there)", location=str(location)) from None
    manifest, reasons = _manifest(writing.written, params, _class_names(ds), location)
    claim.finish(store, location, manifest, held, before)
    kept = writing.kept_numbers()
    return UploadSummary(
        location, manifest.num_samples, len(manifest.shards), manifest.num_bytes, manifest.skipped,
        time.perf_counter() - started, kept_shards=kept[0], skip_reasons=reasons, kept_samples=kept[1],
        kept_bytes=kept[2], writing_seconds=seconds, compared=writing.compared,
        sampled=len(fingerprint.indices(num)) if kept[0] else 0, verified=running.verify,
        rewritten=tuple(writing.rewritten),
    )


def _parameters(
    *,
    maxsize: float,
    maxcount: int,
    workers: int | None,
    seed: int,
    image_format: str,
    quality: int,
    on_error: str | OnError,
    shuffle: bool,
    overwrite: bool,
    progress: bool,
    bucket: str,
    base_folder: str,
    frames_as_video: str | None,
) -> tuple[dict[str, Any], EncodeOptions]:
    """The upload's parameters, checked: what a dataset records and an interrupted run is
    recognised by (``samples`` is added once the dataset is opened); and how it encodes."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own test of this
        raise ConfigError("upload_cv_dataset was called while a worker process was starting: with the spawn or"
                          " forkserver start method each worker imports your main script again; put the code that"
                          ' starts the upload under `if __name__ == "__main__":`')
    policy = OnError.of(on_error)
    maxcount = require_int("maxcount", maxcount, *MAXCOUNT_RANGE)
    low, high = MAXSIZE_RANGE
    if isinstance(maxsize, bool) or not isinstance(maxsize, (int, float)) or not low <= maxsize <= high:
        raise ConfigError(f"maxsize must be a number of bytes in {low}..{high}, got {maxsize!r}")  # not inf, not nan
    if workers is not None:
        require_int("workers", workers, 0)
    require_int("quality", quality, 1, 100)
    for name, flag in (("shuffle", shuffle), ("overwrite", overwrite), ("progress", progress)):
        require_bool(name, flag)
    if not isinstance(bucket, str) or not bucket:
        raise ConfigError(f"bucket must be a non-empty string, got {bucket!r}")
    if not isinstance(base_folder, str):
        raise ConfigError(f"base_folder must be a string, got {base_folder!r}")
    options = EncodeOptions(image_format=image_format, quality=quality, frames_as_video=frames_as_video)
    params = {
        "samples": 0,
        "seed": require_int("seed", seed, 0, 2**63 - 1),
        "shuffle": shuffle,
        "maxsize": int(maxsize),
        "maxcount": int(maxcount),
        "image_format": options.image_format,
        "quality": quality,
        "on_error": policy.value,
    }
    if frames_as_video is not None:  # recorded where set: an upload made before the option still matches
        params["frames_as_video"] = frames_as_video
    return params, options


def _encodes(options: EncodeOptions, item: Any, index: int) -> None:
    encode_item(item, options, index)


def _retry(retry: RetryConfig | None) -> RetryConfig:
    retry = RetryConfig() if retry is None else retry
    if not isinstance(retry, RetryConfig):
        raise ConfigError(f"retry must be a RetryConfig, got {type(retry).__name__}")
    return retry


def _manifest(
    written: Written, params: dict[str, Any], classes: list[str], location: Location
) -> tuple[Manifest, tuple[str, ...]]:
    """The dataset's manifest from every task's shards, and why samples were skipped (the first 100)."""
    reasons = written.reasons()
    for reason in reasons:
        log.warning("upload to %s skipped a sample: %s", location, reason)
    if not written.shards:
        raise UploadError(f"every sample was skipped ({len(written.skipped)}); nothing to upload")
    skipped = sorted(written.skipped)
    manifest = Manifest(
        shards=written.table(),
        fields=tuple(sorted(written.fields)),
        params={
            "upload": params,
            "upload_id": written.run,
            "classes": classes,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        skipped=len(skipped),
        skipped_indices=tuple(skipped),
    )
    return manifest, reasons


def _class_names(ds: Any) -> list[str]:
    """The dataset's class names: torchvision's ``classes`` (through the wrappers of
    ``transforms.v2`` and ``Subset``), or the names of a Hugging Face dataset's one
    ``ClassLabel`` feature; empty where there are none."""
    for _ in range(4):
        classes = getattr(ds, "classes", None)
        if isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) for c in classes):
            return list(classes)
        features = getattr(ds, "features", None)
        labels = [f.names for f in features.values() if type(f).__name__ == "ClassLabel"
                  and isinstance(getattr(f, "names", None), list)] if isinstance(features, Mapping) else []
        if len(labels) == 1 and all(isinstance(c, str) for c in labels[0]):
            return list(labels[0])
        ds = getattr(ds, "_dataset", None) or getattr(ds, "dataset", None)  # a wrapper's, a Subset's
        if ds is None:
            break
    return []
