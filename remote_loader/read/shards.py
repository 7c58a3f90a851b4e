"""Samples out of fetched shard ranges: indexes (cached), checksum refetch, damaged shards.

A range is read while its parts arrive. Bytes failing their checksum are fetched again;
what stays damaged, or a shard that is missing, raises, or with ``on_error="skip"`` is
skipped, counted and logged. Before blaming damage, the manifest is read again: a dataset
overwritten under the reader raises ``DatasetChanged`` instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from remote_loader.errors import CorruptSampleError, CorruptShard, InvalidRange, ObjectNotFound, TruncatedShard
from remote_loader.format import Sample, ShardEntry, ShardIndex, ShardView
from remote_loader.format.tar import scan_tar
from remote_loader.read.fetch import Fetched, fetch_range
from remote_loader.read.reader import DatasetReader
from remote_loader.read.retry import RetryPolicy

log = logging.getLogger("remote_loader")

DAMAGE = (CorruptShard, ObjectNotFound)
"""What ``on_error="skip"`` skips: bytes that stay corrupt, a shard or index that is gone."""


def fetch_index(reader: DatasetReader, entry: ShardEntry, policy: RetryPolicy) -> ShardIndex:
    """Fetch a shard's index with one ranged GET; again if its bytes fail their checksum.

    Raises DatasetChanged if the index is missing or damaged because the dataset was replaced.
    """
    try:
        return reader.read_index(entry, policy)
    except DAMAGE as error:
        reader.check_unchanged(error)
        raise


class IndexCache:
    """Shard indexes fetched on first use and kept in an LRU of ``keep`` (thread-safe)."""

    def __init__(self, reader: DatasetReader, policy: RetryPolicy, keep: int) -> None:
        self.reader, self.policy, self.keep = reader, policy, keep
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, shard: int) -> ShardIndex | None:
        """The shard's index if it is kept, else None (nothing is fetched)."""
        with self._lock:
            return self._indexes.get(shard)

    def get(self, shard: int) -> ShardIndex:
        with self._lock:
            if shard in self._indexes:
                self._indexes.move_to_end(shard)
                return self._indexes[shard]
        index = fetch_index(self.reader, self.reader.manifest.shards[shard], self.policy)
        with self._lock:
            self._indexes[shard] = index
            while len(self._indexes) > self.keep:
                self._indexes.popitem(last=False)
        return index


def truncated(name: str, error: InvalidRange) -> TruncatedShard:
    """The error of a shard that ended before a range its index names: the store answered
    with fewer bytes than asked for, so the object is shorter than the manifest says."""
    return TruncatedShard(f"shard {name} is shorter than its index says ({error}): it was truncated or replaced",
                          name=name)


def own(sample: Sample) -> Sample:
    """Copy a sample's fields out of the range buffer, which is reused once the range is read."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def read_run(
    reader: DatasetReader, shard: int, index: ShardIndex, positions: list[int], policy: RetryPolicy
) -> list[Sample]:
    """Samples ``positions`` (sorted) of one shard with one GET, fetched again while their
    bytes fail their checksums (up to ``refetch_attempts`` fetches)."""
    entry = reader.manifest.shards[shard]
    first, stop = positions[0], positions[-1] + 1
    start, end = index.start(first, stop), index.extent(first, stop)
    key = reader.location.key(entry.name)

    def parse(data: bytes) -> list[Sample]:
        view = ShardView(data, index, name=entry.name, verify=reader.verify, base=start, first=first, stop=stop)
        return [own(view.sample(j)) for j in positions]

    def fetch() -> bytes:
        try:
            return fetch_range(policy, reader.location.bucket, key, start, end)
        except InvalidRange as error:
            raise truncated(entry.name, error) from None

    try:
        return policy.refetch(fetch, parse)
    except DAMAGE as error:
        reader.check_unchanged(error)
        raise


class _Opened(NamedTuple):
    view: ShardView | None
    shard_index: ShardIndex | None  # None: nothing to refetch a sample by (an unindexed tar, or nothing to read)
    shard: int
    next: int
    stop: int


@dataclass(frozen=True)
class SpanRead:
    """Samples ``[first, stop)`` of shard number ``shard``, located with its index."""

    shard: int
    entry: ShardEntry
    first: int
    stop: int
    index: ShardIndex

    def open(self, fetched: Fetched[Any], reader: DatasetReader, wait: Callable[[int | None], None]) -> _Opened:
        view = ShardView(
            fetched.buffer,
            self.index,
            name=self.entry.name,
            verify=reader.verify,
            base=fetched.start,
            first=self.first,
            stop=self.stop,
        )
        return _Opened(view, self.index, self.shard, self.first, self.stop)


@dataclass(frozen=True)
class TarRead:
    """A whole unindexed WebDataset tar, indexed from its bytes once they are in."""

    name: str

    def open(self, fetched: Fetched[Any], reader: DatasetReader, wait: Callable[[int | None], None]) -> _Opened:
        wait(None)
        index, _ = scan_tar(lambda start, end: memoryview(fetched.buffer)[start:end], self.name, len(fetched.buffer))
        return _Opened(ShardView(fetched.buffer, index, name=self.name, verify=False), None, -1, 0, len(index))


@dataclass(frozen=True)
class Skipped:
    """A range whose shard could not be read, skipped under ``on_error="skip"``."""

    name: str
    samples: int
    reason: str

    def open(self, fetched: Fetched[Any], reader: DatasetReader, wait: Callable[[int | None], None]) -> _Opened:
        return _Opened(None, None, -1, 0, 0)


RangePlan = SpanRead | TarRead | Skipped
"""What a fetched range holds and how to read it: each kind opens itself."""


def skip(what: str, samples: int, error: BaseException, policy: RetryPolicy) -> None:
    """Count and log samples skipped under ``on_error="skip"``."""
    policy.metrics.add(skipped=samples)
    log.warning("skipped %s (%d sample%s): %s", what, samples, "" if samples == 1 else "s", error)


class OpenRange:
    """A range being read while its parts arrive, opened as its plan says (``SpanRead``, ``TarRead``, ``Skipped``).

    ``next_sample()`` gives the range's samples in order, fetching damaged ones again;
    with ``on_error="skip"`` it returns None for one it skipped (all the rest of the range
    if the shard is gone).
    """

    def __init__(
        self, reader: DatasetReader, fetched: Fetched[Any], plan: RangePlan, policy: RetryPolicy, on_error: str
    ) -> None:
        self.reader, self.fetched, self.policy, self.on_error = reader, fetched, policy, on_error
        self.view, self.index, self.shard, self.next, self.stop = plan.open(fetched, reader, self._wait)

    @property
    def done(self) -> bool:
        return self.next >= self.stop

    def _wait(self, upto: int | None) -> None:
        waited = time.perf_counter()
        self.fetched.wait(upto)
        self.policy.metrics.add(wait_seconds=time.perf_counter() - waited)

    def next_sample(self) -> Sample | None:
        j = self.next
        self.next += 1
        assert self.view is not None  # a range with samples to read has a view of them
        try:
            if self.index is not None:
                self._wait(self.index.extent(j, j + 1))
            return own(self.view.sample(j))
        except CorruptSampleError:
            pass
        except (ObjectNotFound, InvalidRange) as error:  # the shard went away under us, or shrank
            self.reader.check_unchanged(error)
            damage = truncated(self.view.name, error) if isinstance(error, InvalidRange) else error
            if self.on_error != "skip":
                raise damage from None
            skip(f"the rest of shard {self.view.name}", self.stop - j, damage, self.policy)
            self.next = self.stop
            return None
        assert self.index is not None  # unindexed tars are not verified
        try:
            return read_run(self.reader, self.shard, self.index, [j], self.policy)[0]
        except DAMAGE as error:
            if self.on_error != "skip":
                raise
            skip(f"sample {self.view.index.keys[j]!r} of {self.view.name}", 1, error, self.policy)
            return None

    def close(self) -> None:
        self.view = None  # no view of the buffer may outlive it
        self.fetched.release()


def locate_span(cache: IndexCache, shard: int, first: int, stop: int, on_error: str) -> tuple[int, int, RangePlan]:
    """The byte range of samples ``[first, stop)`` of a shard, from its cached index; with
    ``on_error="skip"``, an empty range standing for a shard whose index cannot be read."""
    entry = cache.reader.manifest.shards[shard]
    try:
        index = cache.get(shard)
    except DAMAGE as error:
        if on_error != "skip":
            raise
        skip(f"shard {entry.name}", stop - first, error, cache.policy)
        return 0, 0, Skipped(entry.name, stop - first, str(error))
    return index.start(first, stop), index.extent(first, stop), SpanRead(shard, entry, first, stop, index)
