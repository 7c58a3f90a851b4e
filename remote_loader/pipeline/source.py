"""The sample source of one worker: its spans fetched ahead, mixed across open shards."""

from __future__ import annotations

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


def _locate(reader: DatasetReader, entry: ShardEntry, span: Span, config: FetchConfig, metrics: Metrics) -> tuple[int, int, Any]:
    """Fetch the shard's index and return the byte range of the span's samples."""
    index = fetch_index(reader, entry, config, metrics)
    return index.start(span.start, span.end), index.extent(span.start, span.end), (entry, span, index)


def _sample(reader: DatasetReader, current: _Open, config: FetchConfig, metrics: Metrics, on_error: str) -> Sample | None:
    """The next sample of ``current``; bytes failing their checksum are fetched again alone.

    Returns None for a sample still corrupt after ``config.max_attempts`` with
    ``on_error="skip"`` (counted in ``metrics.skipped``); raises CorruptSampleError otherwise.
    """
    j = current.next
    current.next += 1
    try:
        return current.view.sample(j)
    except CorruptSampleError as error:
        last = error
    index, name = current.view.index, current.view.name
    start, end = index.start(j, j + 1), index.extent(j, j + 1)
    for _ in range(config.max_attempts - 1):
        metrics.add(retries=1)
        data = fetch_range(reader.client, reader.location.bucket, reader.location.key(name), start, end, config, metrics)
        try:
            return ShardView(data, index, name=name, base=start, first=j, stop=j + 1).sample(j)
        except CorruptSampleError as error:
            last = error
    if on_error == "skip":
        metrics.add(skipped=1)
        return None
    raise last


def _whole(name: str, size: int) -> tuple[int, int, Any]:
    return 0, size, name


class _Open:
    """A fetched span being read; a whole unindexed tar is indexed from its bytes here."""

    def __init__(self, fetched: Fetched, verify: bool) -> None:
        self.fetched = fetched
        if isinstance(fetched.context, str):  # an unindexed WebDataset tar
            name = fetched.context
            index, _ = scan_tar(lambda start, end: memoryview(fetched.buffer)[start:end], name, len(fetched.buffer))
            self.view = ShardView(fetched.buffer, index, name=name, verify=False)
            self.next, self.stop = 0, len(index)
            return
        entry, span, index = fetched.context
        self.view = ShardView(fetched.buffer, index, name=entry.name, verify=verify, base=fetched.start,
                              first=span.start, stop=span.end)
        self.next, self.stop = span.start, span.end


def span_jobs(reader: DatasetReader, spans: Sequence[Span], config: FetchConfig, metrics: Metrics) -> list[Job]:
    """Jobs fetching the samples of ``spans`` of an indexed dataset."""
    shards = reader.manifest.shards
    return [
        Job(reader.location.key(shards[s.shard].name), partial(_locate, reader, shards[s.shard], s, config, metrics))
        for s in spans
        if len(s)
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
                    reading.append(_Open(item, reader.verify))
            if not reading:
                return
            current = reading[int(rng.integers(len(reading)))] if len(reading) > 1 else reading[0]
            sample = _sample(reader, current, config, metrics, on_error)
            if current.next == current.stop:
                reading.remove(current)
            if sample is not None:
                metrics.add(samples=1)
                yield sample
