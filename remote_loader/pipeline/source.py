"""The sample source of one worker: its spans fetched ahead, mixed across open shards."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np

from remote_loader.config import FetchConfig
from remote_loader.errors import CorruptSampleError, CorruptShard
from remote_loader.fetch import Fetched, Job, Metrics, Prefetcher, fetch_range
from remote_loader.format import Sample, ShardEntry, ShardIndex, ShardView
from remote_loader.indexer import scan_tar
from remote_loader.pipeline.split import Span
from remote_loader.reader import DatasetReader


def fetch_index(reader: DatasetReader, entry: ShardEntry, config: FetchConfig, metrics: Metrics) -> ShardIndex:
    """Fetch a shard's index with one ranged GET; again if its bytes fail their checksum."""
    key, start, end = reader.index_range(entry)
    for attempt in range(1, config.max_attempts + 1):
        data = fetch_range(reader.client, reader.location.bucket, key, start, end, config, metrics)
        try:
            return reader.parse_index(entry, data)
        except CorruptShard:
            if attempt == config.max_attempts:
                raise
            metrics.add(retries=1)
    raise AssertionError("unreachable")


def _sample(reader: DatasetReader, current: _Open, config: FetchConfig, metrics: Metrics, on_error: str) -> Sample | None:
    """The next sample of ``current``; bytes failing their checksum are fetched again alone.

    Returns None for a sample still corrupt after ``config.max_attempts`` with
    ``on_error="skip"`` (counted in ``metrics.skipped``); raises CorruptSampleError otherwise.
    """
    j = current.next
    current.next += 1
    current.arrived(j)
    try:
        return own(current.view.sample(j))
    except CorruptSampleError as error:
        last = error
    index, name = current.view.index, current.view.name
    start, end = index.start(j, j + 1), index.extent(j, j + 1)
    for _ in range(config.max_attempts - 1):
        metrics.add(retries=1)
        data = fetch_range(reader.client, reader.location.bucket, reader.location.key(name), start, end, config, metrics)
        try:
            return own(ShardView(data, index, name=name, base=start, first=j, stop=j + 1).sample(j))
        except CorruptSampleError as error:
            last = error
    if on_error == "skip":
        metrics.add(skipped=1)
        return None
    raise last


def own(sample: Sample) -> Sample:
    """Copy a sample's fields out of the range buffer, which is reused once the range is read."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def _whole(name: str, size: int) -> tuple[int, int, Any]:
    return 0, size, name


class _Open:
    """A span being read while its parts arrive; a whole unindexed tar is indexed from its bytes here."""

    def __init__(self, fetched: Fetched, verify: bool, metrics: Metrics) -> None:
        self.fetched, self.metrics = fetched, metrics
        self.index: ShardIndex | None = None
        if isinstance(fetched.context, str):  # an unindexed WebDataset tar
            self._wait(None)
            name = fetched.context
            index, _ = scan_tar(lambda start, end: memoryview(fetched.buffer)[start:end], name, len(fetched.buffer))
            self.view = ShardView(fetched.buffer, index, name=name, verify=False)
            self.next, self.stop = 0, len(index)
            return
        entry, span, self.index = fetched.context
        self.view = ShardView(fetched.buffer, self.index, name=entry.name, verify=verify, base=fetched.start,
                              first=span.start, stop=span.end)
        self.next, self.stop = span.start, span.end

    def _wait(self, upto: int | None) -> None:
        waited = time.perf_counter()
        self.fetched.wait(upto)
        self.metrics.add(wait_seconds=time.perf_counter() - waited)

    def arrived(self, j: int) -> None:
        """Block until sample ``j``'s bytes are in the buffer."""
        if self.index is not None:
            self._wait(self.index.extent(j, j + 1))


class IndexCache:
    """Shard indexes fetched on first use and kept in an LRU of ``keep`` (thread-safe)."""

    def __init__(self, reader: DatasetReader, config: FetchConfig, metrics: Metrics, keep: int) -> None:
        self.reader, self.config, self.metrics, self.keep = reader, config, metrics, keep
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, shard: int) -> ShardIndex:
        with self._lock:
            if shard in self._indexes:
                self._indexes.move_to_end(shard)
                return self._indexes[shard]
        index = fetch_index(self.reader, self.reader.manifest.shards[shard], self.config, self.metrics)
        with self._lock:
            self._indexes[shard] = index
            while len(self._indexes) > self.keep:
                self._indexes.popitem(last=False)
        return index


def _locate_cached(cache: IndexCache, span: Span) -> tuple[int, int, Any]:
    """Return the byte range of the span's samples, from the shard's cached index."""
    index = cache.get(span.shard)
    entry = cache.reader.manifest.shards[span.shard]
    return index.start(span.start, span.end), index.extent(span.start, span.end), (entry, span, index)


def split_spans(reader: DatasetReader, spans: Sequence[Span], range_bytes: int, group: int) -> list[Span]:
    """Cut spans into ranges of about ``range_bytes`` and interleave the ranges of each
    ``group`` consecutive spans, so a reader with ``group`` open ranges still mixes
    ``group`` shards while holding only one range of each."""
    shards = reader.manifest.shards
    pieces: list[list[Span]] = []
    for span in spans:
        entry = shards[span.shard]
        per_range = max(1, int(range_bytes * entry.samples // max(1, entry.size)))
        pieces.append([Span(span.shard, a, min(a + per_range, span.end)) for a in range(span.start, span.end, per_range)])
    out: list[Span] = []
    for first in range(0, len(pieces), group):
        block = pieces[first : first + group]
        for position in range(max((len(p) for p in block), default=0)):
            out.extend(p[position] for p in block if position < len(p))
    return out


def span_jobs(
    reader: DatasetReader, spans: Sequence[Span], config: FetchConfig, metrics: Metrics, open_shards: int = 1
) -> list[Job]:
    """Jobs fetching the samples of ``spans`` of an indexed dataset, in ranges of about ``config.range_bytes``."""
    shards = reader.manifest.shards
    cache = IndexCache(reader, config, metrics, keep=2 * open_shards + 4)
    return [
        Job(reader.location.key(shards[s.shard].name), partial(_locate_cached, cache, s))
        for s in split_spans(reader, [s for s in spans if len(s)], config.range_bytes, open_shards)
    ]


def tar_jobs(reader: DatasetReader, tars: Sequence[tuple[str, int]]) -> list[Job]:
    """Jobs fetching whole unindexed tars ``(name, size)``."""
    return [Job(reader.location.key(name), partial(_whole, name, size)) for name, size in tars]


def stream_samples(
    reader: DatasetReader,
    jobs: Sequence[Job],
    *,
    config: FetchConfig,
    metrics: Metrics,
    open_shards: int,
    seed: Sequence[int],
    on_error: str = "raise",
) -> Iterator[Sample]:
    """Yield the samples the ``jobs`` fetch, drawing each next sample from one of ``open_shards`` ranges.

    Which open range gives the next sample is drawn from ``seed``, so the order depends on
    the seed alone, never on fetch timing. Every sample of every range is yielded once.
    """
    rng = np.random.default_rng(list(seed))
    with Prefetcher(reader.client, reader.location.bucket, jobs, config, metrics) as prefetcher:
        fetched = iter(prefetcher)
        reading: list[_Open] = []
        exhausted = False
        while True:
            while not exhausted and len(reading) < open_shards:
                item = next(fetched, None)
                if item is None:
                    exhausted = True
                else:
                    reading.append(_Open(item, reader.verify, metrics))
            if not reading:
                return
            current = reading[int(rng.integers(len(reading)))] if len(reading) > 1 else reading[0]
            sample = _sample(reader, current, config, metrics, on_error)
            if current.next == current.stop:
                reading.remove(current)
                current.view = None  # type: ignore[assignment]  # no view of the buffer may outlive it
                current.fetched.release()
            if sample is not None:
                metrics.add(samples=1)
                yield sample
