"""The unit of parallel upload work: permuted sample indices in, finished shard objects out.

A task runs in any ``concurrent.futures`` executor, beside one other task of its process: it
encodes its samples, streams each shard to the store with a multipart upload, and records
its manifest entries in a small task object, so a re-run of an interrupted upload keeps the
shards already finished.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import msgpack
import numpy as np

from remote_loader.checks import one_line
from remote_loader.config import RetryConfig
from remote_loader.errors import OnError, RemoteLoaderError, UploadError
from remote_loader.format import ShardEntry, ShardWriter
from remote_loader.format.index import MAX_FIELDS, require, unpack
from remote_loader.storage import Location, ObjectWriter, Store
from remote_loader.storage.daemon import in_daemon_thread, map_on_daemon_threads, wait_result
from remote_loader.storage.retrying import Cancelled, Retry
from remote_loader.upload.encode import EncodeOptions, encode_item
from remote_loader.upload.fingerprint import item_digest
from remote_loader.upload.originals import read_watching
from remote_loader.upload.sources import is_file_backed, resolve
from remote_loader.upload.watch import UNWATCHED, Reading, Slots

T = TypeVar("T")

STATE_DIR = "_upload"
_REPORT_EVERY = 16
_REPEATS = 3  # failed attempts in a row a task may make, answered for but no further on, each timed afresh

TASKS_AT_ONCE = 2
"""Tasks one process writes at once, each on a thread of its own. Encoding holds the GIL, so
they take turns at it; but while one task waits for its last shard's parts and the request
that completes it, the other encodes, instead of the process idling between tasks."""

# Set only in the worker processes of a pool the uploader owns (by ``init_worker``), so the
# dataset is sent once per process rather than with every task. Tasks run in the caller's
# process never read them: they get their dataset and progress as arguments, so two uploads
# in one process share nothing.
_worker_dataset: Any = None
_worker_progress: Any = None
_worker_slots: Slots | None = None


def init_worker(dataset: Any, progress: Any, slots: Slots | None = None) -> None:
    """Process-pool initializer (in a pool's worker process only): keep the dataset, the
    progress queue and the table of what each task reads for later tasks, run torch's
    operations on this thread, and end this process when the upload's process ends."""
    global _worker_dataset, _worker_progress, _worker_slots
    _worker_dataset, _worker_progress, _worker_slots = dataset, progress, slots
    _one_torch_thread()
    _exit_with_parent()


def worker_context(dataset: Any, progress: Any, slots: Slots | None) -> tuple[Any, Any, Slots | None]:
    """The dataset, progress sink and table a call works with: its arguments, or, in a pool
    whose initializer set them (``dataset`` None), this worker's."""
    if dataset is None:
        return _worker_dataset, _worker_progress, _worker_slots
    return resolve(dataset), progress, slots


def _one_torch_thread() -> None:
    """One thread for torch's operations in this worker, as DataLoader's workers do, where
    the dataset brought torch in. A forked worker inherits torch's OpenMP thread pool as
    the upload's process left it, after ``ds[i]`` there had started it, without its threads:
    its first parallel operation (``ToTensor``'s division) waited for them for ever. The
    upload runs one worker per core; torch is never imported for a dataset without it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _exit_with_parent() -> None:
    """End this worker as soon as the process that started it is gone, however it went
    (SIGKILL, out of memory): an orphaned worker would go on encoding and uploading for
    nobody. A thread waits on multiprocessing's parent sentinel, a pipe that reads as
    closed once the parent's end of it is gone: no polling, on every start method."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)  # nothing of this process's work can be delivered any more

    threading.Thread(target=watch, name="remote-loader-parent-watch", daemon=True).start()


def shard_name(run: str, task_id: int, part: int) -> str:
    """Object name (relative to the dataset folder) of part ``part`` of task ``task_id``.

    ``run`` identifies the upload: shards of a new upload never take the names of a
    dataset still in place, so an overwrite writes beside the old dataset.
    """
    return f"shard-{run}-{task_id:06d}-{part:03d}.tar"


def task_record_key(location: Location, run: str, task_id: int) -> str:
    """Key of the record a finished task of upload ``run`` leaves for resuming."""
    return location.key(f"{STATE_DIR}/{run}/task-{task_id:06d}.msgpack")


@dataclass(frozen=True)
class TaskSpec:
    """What every task of one upload shares."""

    store: Store
    location: Location
    options: EncodeOptions
    maxsize: int
    maxcount: int
    on_error: OnError
    part_size: int
    key_width: int
    run: str
    retry: RetryConfig = field(default_factory=RetryConfig)


@dataclass
class TaskResult:
    """What one task produced."""

    task_id: int
    entries: list[ShardEntry]
    fields: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        """The items the task took care of: written, or skipped."""
        return sum(e.samples for e in self.entries) + len(self.skipped)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "task": self.task_id,
                "entries": [e.as_row() for e in self.entries],
                "fields": self.fields,
                "skipped": self.skipped,
                "reasons": self.reasons[:100],
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes, name: str) -> TaskResult:
        raw = unpack(data, what="task record", name=name)
        rows = require(raw, "entries", list, what="task record", name=name)
        return cls(
            task_id=require(raw, "task", int, what="task record", name=name),
            entries=[ShardEntry(*row) for row in rows],
            fields=require(raw, "fields", list, what="task record", name=name),
            skipped=require(raw, "skipped", list, what="task record", name=name),
            reasons=require(raw, "reasons", list, what="task record", name=name),
        )


def read_item(dataset: Any, index: int, reading: Reading = UNWATCHED) -> Any:
    """Return ``dataset[index]``, or the file path behind it for a file-backed image folder;
    ``ds[i]`` is called in ``reading``'s turn (``Reading.turn``): one task thread of a process
    at a time. A task told to stop as it waits for its turn gets ``Cancelled`` as it is: the
    item failed at nothing (``on_error="skip"`` would skip it, and the task keep its record)."""
    if is_file_backed(dataset):
        return dataset.samples[index]
    with reading.turn():
        try:
            return dataset[index]
        except RemoteLoaderError:
            raise
        except Exception as exc:
            raise UploadError(f"sample {index}: ds[{index}] raised {type(exc).__name__}: {one_line(exc)}",
                              index=index) from exc


class _ShardSequence:
    """Writes one task's shards in turn, starting a new one when the next sample would not fit.

    A full shard is committed on a thread while the next one fills: its last parts travel
    while the next samples are encoded, instead of the encoder waiting for them and for the
    request that completes the upload. One commit runs at a time, so at most two shards'
    parts are in memory; a commit's error raises at the next shard's end or at ``close``.
    """

    def __init__(self, spec: TaskSpec, task_id: int) -> None:
        self.spec = spec
        self.task_id = task_id
        self.writers: list[ObjectWriter] = []  # every shard's upload, to tell how far the store answered
        self.entries: list[ShardEntry] = []
        self.fields: set[str] = set()
        self.fields_in_shard: set[str] = set()  # the open shard's, at most MAX_FIELDS
        self._upload: ObjectWriter | None = None
        self._shard: ShardWriter | None = None
        self._committing: Future[None] | None = None  # the previous shard's commit

    @property
    def acknowledged(self) -> int:
        """Bytes of this task's shards the store answered for."""
        return sum(writer.acknowledged for writer in self.writers)

    @property
    def size(self) -> int:
        """Bytes of this task's shards so far: the closed ones' and the open one's."""
        return sum(e.size for e in self.entries) + (self._shard.size if self._shard is not None else 0)

    def add(self, key: str, fields: dict[str, bytes], index: int, digest: bytes | None = None) -> None:
        spec = self.spec
        if len(fields) > MAX_FIELDS:
            raise UploadError(f"sample {index} has {len(fields)} fields; a shard holds at most {MAX_FIELDS}"
                              " (each array, tensor or image inside a target is a field)", index=index)
        if self._shard is not None and (
            len(self._shard) >= spec.maxcount or self._shard.projected_size(key, fields) > spec.maxsize
            or len(self.fields_in_shard | fields.keys()) > MAX_FIELDS
        ):
            self._finish()
        if self._shard is None:
            name = shard_name(spec.run, self.task_id, len(self.entries))
            self._upload = spec.store.open_writer(spec.location.bucket, spec.location.key(name),
                                                  part_size=spec.part_size)
            self.writers.append(self._upload)
            self._shard = ShardWriter(self._upload.write)
            self.fields_in_shard = set()
        projected = self._shard.projected_size(key, fields)
        if projected > spec.maxsize:
            size = sum(len(v) for v in fields.values())
            raise UploadError(
                f"sample {index} is {size} bytes, too large for a shard of maxsize={spec.maxsize} bytes (a shard of it"
                f" alone is {projected} with its tar headers and index)", index=index
            )
        self._shard.add(key, fields, digest)
        self.fields.update(fields)
        self.fields_in_shard.update(fields)

    def _end_shard(self) -> ObjectWriter | None:
        """Close the open shard and list it; its writer, to commit (None if it held no sample)."""
        if self._shard is None or self._upload is None or not len(self._shard):
            self._abort_open()  # none open, or one opened for a sample then skipped as too large
            return None
        summary = self._shard.close()
        self.entries.append(
            ShardEntry.from_summary(shard_name(self.spec.run, self.task_id, len(self.entries)), summary)
        )
        upload, self._shard, self._upload = self._upload, None, None
        return upload

    def _finish(self) -> None:
        """End the open shard and commit it on a thread, once the commit before it is done."""
        upload = self._end_shard()
        self._wait_committed()
        if upload is not None:
            self._committing = in_daemon_thread(upload.commit, "remote-loader-commit")

    def _wait_committed(self) -> None:
        committing, self._committing = self._committing, None
        if committing is not None:
            wait_result(committing)

    def close(self, record: Callable[[], None] | None = None) -> None:
        """Finish the open shard and commit it, and wait for every commit. ``record`` (the
        task's record, which lists this shard) is sent while the commits complete, a round
        trip saved per task: a resumed upload trusts a record only for shards listed with
        their recorded sizes."""
        upload = self._end_shard()
        recording = None if record is None else in_daemon_thread(record, "remote-loader-record")
        if upload is not None:
            upload.commit()
        self._wait_committed()
        if recording is not None:
            wait_result(recording)

    def _abort_open(self, *, interrupted: bool = False) -> None:
        if self._upload is not None:
            self._upload.abort(interrupted=interrupted)
        self._shard = self._upload = None

    def abort(self, *, interrupted: bool = False) -> None:
        """Abort the open shard; a commit under way is waited for (its outcome no longer
        matters: the task is written again whole), except on Ctrl-C."""
        self._abort_open(interrupted=interrupted)
        committing, self._committing = self._committing, None
        if committing is not None and not interrupted:
            with suppress(Exception):
                wait_result(committing)


def write_tasks(
    spec: TaskSpec, group: Sequence[tuple[int, Sequence[int] | np.ndarray]], dataset: Any = None, progress: Any = None,
    slots: Slots | None = None, stop: threading.Event | None = None,
) -> list[TaskResult]:
    """Write the tasks ``group``, ``(task id, sample indices)`` pairs, ``TASKS_AT_ONCE`` at a
    time on daemon threads; their results, in order.

    After an error no other task starts; the tasks already running finish (a re-run keeps
    them), then the error raises, or at the outage deadline if one of them is still stuck
    (a hung store, a dataset that blocks): it is told to stop and left to end. On Ctrl-C
    they stop at their next sample and abort their open shard on their own threads, which
    the caller does not wait for.

    Args:
        spec: Settings shared by every task of the upload.
        group: The tasks; each task's number names its shards and its record.
        dataset: The dataset, a ``Shipped`` token for it on a Dask worker, or None in a
            pool whose initializer already set it.
        progress: Where (samples, bytes) counts go (``put``, from any thread); None in a
            pool whose initializer set its queue.
        slots: Where each task says which item it reads (``watch.Slots``), and whether to
            start no new task; None: unwatched (or, in a pool, the initializer's).
        stop: Set by the caller to stop the tasks at their next sample (Ctrl-C in the
            thread that waits for this call); they are stopped so as this call ends too.
    """
    return run_group(write_task, spec, group, dataset, progress, slots, stop)


def run_group(one: Callable[..., T], spec: Any, group: Sequence[tuple[int, Any]], dataset: Any, progress: Any,
              slots: Slots | None, stop: threading.Event | None) -> list[T]:
    """``one(spec, task id, its work, dataset, progress, stop, slots, turn)`` for each task of
    ``group``, ``TASKS_AT_ONCE`` at a time on daemon threads, in this process or a pool's
    worker (``worker_context``): their results, in order (``write_tasks`` says what an error
    does). ``turn`` is a lock of the group's own, held around each ``ds[i]``: the tasks call it
    one at a time, as a DataLoader worker does, and encode at once."""
    dataset, progress, slots = worker_context(dataset, progress, slots)
    stop = threading.Event() if stop is None else stop
    turn = threading.Lock()  # the group's tasks call ds[i] in turns (watch.Reading.turn)
    try:
        return map_on_daemon_threads(
            lambda task: one(spec, task[0], task[1], dataset, progress, stop, slots, turn),
            list(group), TASKS_AT_ONCE, "remote-loader-task", settle=spec.retry.outage_deadline,
        )
    finally:
        stop.set()  # a task still running: Ctrl-C


def write_task(
    spec: TaskSpec,
    task_id: int,
    indices: Sequence[int] | np.ndarray,
    dataset: Any,
    progress: Any = None,
    stop: threading.Event | None = None,
    slots: Slots | None = None,
    turn: Any = None,
) -> TaskResult:
    """Encode the samples ``indices`` of ``dataset`` (in that, permuted, order) into shards;
    upload them and the task's record. Set ``stop`` to end it at its next sample; a task
    told by ``slots`` to start no new one does not start; ``turn``, a lock held around each
    ``ds[i]``, shared with the tasks beside it (``run_group``)."""
    dataset = resolve(dataset)
    if slots is not None and slots.stopped:
        raise Cancelled(f"task {task_id} did not start: the upload is stopping")
    # The whole task is the unit of retry, its task record included: its shards are written
    # again under the same names. Its requests go to the store itself, so retries do not nest.
    retry = Retry(spec.retry, spec.store, cancel=threading.Event() if stop is None else stop)
    attempts = _Attempts(spec, task_id)
    if slots is None:
        unwatched = Reading(None, None, turn=turn, stop=retry.cancel)
        return retry.call(partial(_write_task, attempts, indices, dataset, progress, retry.cancel, unwatched),
                          afresh=attempts.afresh)
    with slots.task(task_id, turn, retry.cancel) as reading:
        return retry.call(partial(_write_task, attempts, indices, dataset, progress, retry.cancel, reading),
                          afresh=attempts.afresh)


class _Attempts:
    """A task's attempts: each one's shards, and the most bytes of them the store answered for
    in any, which says whether a failed attempt restarts the outage clock (``Retry.call``'s
    ``afresh``): one the store answered for some of did, unless it is the ``_REPEATS``-th in a
    row to get no further than the furthest (a fault at the same point every time, which then
    gives up at the deadline); one it answered nothing for did not (an outage)."""

    def __init__(self, spec: TaskSpec, task_id: int) -> None:
        self.spec, self.task_id = spec, task_id
        self.latest: _ShardSequence | None = None
        self.furthest = 0
        self.repeats = 0  # attempts in a row, answered for, that got no further than the furthest

    def start(self) -> _ShardSequence:
        self.latest = _ShardSequence(self.spec, self.task_id)
        return self.latest

    def afresh(self) -> bool:
        """Whether the latest attempt, failed, times the task's outage afresh."""
        reached = 0 if self.latest is None else self.latest.acknowledged
        if reached > self.furthest:
            self.furthest, self.repeats = reached, 0
            return True
        if reached == 0 or self.repeats >= _REPEATS:
            return False
        self.repeats += 1  # a fault earlier on than the last one, the store answering before it
        return True


def _write_task(
    attempts: _Attempts, indices: Sequence[int] | np.ndarray, dataset: Any, progress: Any, stop: threading.Event,
    reading: Reading,
) -> TaskResult:
    spec, task_id = attempts.spec, attempts.task_id
    result = TaskResult(task_id=task_id, entries=[])
    shards = attempts.start()
    pending_samples = reported = 0  # bytes: the shards' own, as the summary counts them
    try:
        for raw_index in indices:
            if stop.is_set() or reading.interrupted:
                raise Cancelled(f"task {task_id} stopped: its process was interrupted")
            index = int(raw_index)
            try:
                with reading.item(index):
                    item, originals = read_watching(partial(read_item, dataset, reading=reading), index)
                    fields = encode_item(item, spec.options, index, originals)
                    digest = item_digest(item, originals.match, index)  # after encoding: its images matched once
                shards.add(f"{index:0{spec.key_width}d}", fields, index, digest)
            except UploadError as exc:
                if not spec.on_error.skips:
                    raise
                result.skipped.append(index)
                result.reasons.append(str(exc))
                fields = {}
            pending_samples += 1
            if pending_samples >= _REPORT_EVERY and progress is not None:
                progress.put((pending_samples, shards.size - reported))
                pending_samples, reported = 0, shards.size
        result.entries, result.fields = shards.entries, sorted(shards.fields)  # the last entry joins at close
        shards.close(
            record=lambda: spec.store.put(
                spec.location.bucket, task_record_key(spec.location, spec.run, task_id), result.encode()
            )
        )
    except BaseException as error:
        shards.abort(interrupted=not isinstance(error, Exception))
        raise
    if progress is not None:
        progress.put((pending_samples, shards.size - reported))
    return result
