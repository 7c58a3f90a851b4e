"""Reading again the items of shards an upload would keep, and comparing each with the digest
its shard's index recorded as it was uploaded (``fingerprint.item_digest``).

A run that keeps shards (the dataset is there already, or an interrupted run of this upload
is resumed) hands them to its worker processes as check tasks: each reads its shards'
indexes, reads every item they hold again (``ds[i]``, not encoded, not written), and stops
at the first whose digest differs. What a changed item means is the caller's business.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from remote_loader.checksum import crc32
from remote_loader.config import RetryConfig
from remote_loader.errors import CorruptShard
from remote_loader.format import ShardEntry, ShardIndex
from remote_loader.storage import Location, Store
from remote_loader.storage.retrying import Cancelled, Retry
from remote_loader.upload.fingerprint import matches
from remote_loader.upload.originals import read_watching
from remote_loader.upload.tasks import read_item, run_group
from remote_loader.upload.watch import Reading, Slots

_REPORT_EVERY = 16


@dataclass(frozen=True)
class CheckSpec:
    """Where the shards to check are, and how their indexes are read."""

    store: Store
    location: Location
    retry: RetryConfig = field(default_factory=RetryConfig)


@dataclass(frozen=True)
class Checked:
    """What the check of one task's shards found.

    Attributes:
        task_id: The task (or, for a whole dataset, the shard's position) checked.
        samples: Samples its shards hold.
        compared: Those read again and compared with their digests.
        changed: The first item whose digest differs, or None.
    """

    task_id: int
    samples: int
    compared: int
    changed: int | None = None


def check_tasks(spec: CheckSpec, group: Sequence[tuple[int, Sequence[ShardEntry]]], dataset: Any = None,
                progress: Any = None, slots: Slots | None = None, stop: threading.Event | None = None) -> list[Checked]:
    """Check the tasks ``group``, ``(task id, its shards)`` pairs, ``TASKS_AT_ONCE`` at a time
    on daemon threads; what each found, in order. Arguments as ``tasks.write_tasks`` takes
    them; a check stops at its next item once ``slots`` says the run is stopping."""
    return run_group(check_task, spec, group, dataset, progress, slots, stop)


def check_task(spec: CheckSpec, task_id: int, entries: Sequence[ShardEntry], dataset: Any, progress: Any,
               stop: threading.Event, slots: Slots | None, turn: Any = None) -> Checked:
    """Read every item of ``entries`` again and compare its digest with the one its shard
    recorded (``ds[i]`` in ``turn``, as ``tasks.write_task`` calls it)."""
    if slots is not None and slots.stopped:
        raise Cancelled(f"the check of task {task_id} did not start: the upload is stopping")
    watching = nullcontext(Reading(None, None, turn=turn, stop=stop)) if slots is None else \
        slots.task(task_id, turn, stop)
    with watching as reading:
        samples = compared = 0
        for entry in entries:
            index = _index(spec, entry, stop)
            samples += len(index)
            if index.digests is None:  # written before uploads recorded digests: nothing to compare with
                if progress is not None:
                    progress.put((len(index), 0))
                continue
            changed = _compare(index, dataset, progress, stop, slots, reading)
            if changed is not None:
                if progress is not None:
                    progress.put((-compared, 0))  # the bar counts the task again as it is written again
                return Checked(task_id, samples, compared, changed)
            compared += len(index)
        return Checked(task_id, samples, compared)


def _compare(index: ShardIndex, dataset: Any, progress: Any, stop: threading.Event, slots: Slots | None,
             reading: Reading) -> int | None:
    """The first of ``index``'s samples whose item reads again to another digest, or None."""
    counted = 0
    for i, key in enumerate(index.keys):
        if stop.is_set() or (slots is not None and slots.stopped):
            raise Cancelled("the check stopped: the upload is stopping")
        item_index = int(key)
        with reading.item(item_index):
            item, originals = read_watching(partial(read_item, dataset, reading=reading), item_index)
            same = matches(index.digest(i), item, originals.match, item_index)
        if not same:
            if progress is not None:
                progress.put((-counted, 0))
            return item_index
        if progress is not None and (i + 1) % _REPORT_EVERY == 0:
            progress.put((_REPORT_EVERY, 0))
            counted += _REPORT_EVERY
    if progress is not None:
        progress.put((len(index) - counted, 0))
    return None


def _index(spec: CheckSpec, entry: ShardEntry, stop: threading.Event) -> ShardIndex:
    """The index of the shard ``entry``: one ranged GET, checked against the manifest's crc32."""
    if entry.index_name:
        raise CorruptShard(f"shard {entry.name} has its index apart: not a shard of an upload", name=entry.name)
    key = spec.location.key(entry.name)
    retry = Retry(spec.retry, spec.store, cancel=stop)
    data = retry.call(lambda: spec.store.get_range(spec.location.bucket, key, entry.index_offset,
                                                   entry.index_offset + entry.index_size))
    if crc32(data) != entry.index_crc:
        raise CorruptShard(f"the index of shard {entry.name} fails its crc32 check", name=entry.name)
    return ShardIndex.decode(data, data_end=entry.data_end, name=entry.name)
