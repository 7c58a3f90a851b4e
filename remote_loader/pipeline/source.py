"""The sample source of one worker: its spans fetched ahead, mixed across open shards."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np

from remote_loader.format import Sample
from remote_loader.pipeline.position import Progress
from remote_loader.pipeline.split import Span
from remote_loader.read.fetch import Job, Prefetcher
from remote_loader.read.reader import DatasetReader
from remote_loader.read.retry import RetryPolicy
from remote_loader.read.shards import IndexCache, OpenRange, locate_span


def _whole(name: str, size: int) -> tuple[int, int, Any]:
    return 0, size, name


def split_spans(reader: DatasetReader, spans: Iterable[Span], range_bytes: int, group: int,
                progress: Progress | None = None) -> Iterator[Span]:
    """Cut spans into ranges of about ``range_bytes`` and interleave the ranges of each
    ``group`` consecutive spans, so a reader with ``group`` open ranges still mixes
    ``group`` shards while holding only one range of each. Lazy: it reads ``group`` spans
    at a time, and tells ``progress`` what it took and the ranges it cut."""
    samples, sizes = reader.manifest.shards.samples, reader.manifest.shards.size
    spans = iter(spans)
    while block := list(itertools.islice(spans, group)):
        pieces = []
        for span in block:
            per_range = max(1, int(range_bytes * int(samples[span.shard]) // max(1, int(sizes[span.shard]))))
            pieces.append([Span(span.shard, a, min(a + per_range, span.end), span.position + a - span.start)
                           for a in range(span.start, span.end, per_range)])
        ordered = [p[position] for position in range(max(len(p) for p in pieces)) for p in pieces if position < len(p)]
        if progress is not None:
            progress.took(sum(len(span) for span in block), [(r.position, len(r)) for r in ordered])
        yield from ordered


def span_jobs(reader: DatasetReader, spans: Iterable[Span], policy: RetryPolicy, open_shards: int = 1,
              on_error: str = "raise", progress: Progress | None = None) -> Iterator[Job]:
    """Jobs fetching the samples of ``spans`` of an indexed dataset, in ranges of about
    ``range_bytes``, made as the prefetcher reaches them."""
    shards = reader.manifest.shards
    cache = IndexCache(reader, policy, keep=2 * open_shards + 4)
    for s in split_spans(reader, (s for s in spans if len(s)), policy.config.range_bytes, open_shards, progress):
        yield Job(reader.location.key(shards.names[s.shard]), partial(locate_span, cache, s.shard, s.start, s.end, on_error))


def tar_jobs(reader: DatasetReader, tars: Sequence[tuple[str, int]]) -> list[Job]:
    """Jobs fetching whole unindexed tars ``(name, size)``."""
    return [Job(reader.location.key(name), partial(_whole, name, size)) for name, size in tars]


def stream_positions(
    reader: DatasetReader,
    jobs: Iterable[Job],
    *,
    policy: RetryPolicy,
    open_shards: int,
    seed: Sequence[int],
    on_error: str = "raise",
    progress: Progress | None = None,
) -> Iterator[tuple[int, Sample]]:
    """Yield the samples the ``jobs`` fetch, each with its position in the epoch (-1
    without ``progress``, which learns of every range opened and sample emitted), drawing
    each next sample from one of ``open_shards`` ranges.

    Which open range gives the next sample is drawn from ``seed``, so the order depends on
    the seed alone, never on fetch timing. Every sample of every range is yielded once
    (less those skipped under ``on_error="skip"``, which are counted and logged).
    """
    rng = np.random.default_rng(list(seed))
    with Prefetcher(reader.location.bucket, jobs, policy) as prefetcher:
        fetched = iter(prefetcher)
        reading: list[OpenRange] = []
        bases: dict[OpenRange, int] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(reading) < open_shards:
                    item = next(fetched, None)
                    if item is None:
                        exhausted = True
                        continue
                    opened = OpenRange(reader, item, policy, on_error)
                    base = progress.opening() - opened.next if progress is not None else -1
                    if opened.done:
                        opened.close()
                    else:
                        reading.append(opened)
                        bases[opened] = base
                        if progress is not None:
                            progress.opened(opened, base)
                if not reading:
                    return
                current = reading[int(rng.integers(len(reading)))] if len(reading) > 1 else reading[0]
                sample = current.next_sample()
                position = bases[current] + current.next - 1 if progress is not None else -1
                if current.done:
                    reading.remove(current)
                    bases.pop(current, None)
                    if progress is not None:
                        progress.closed(current)
                    current.close()
                if sample is not None:
                    policy.metrics.add(samples=1)
                    if progress is not None:
                        progress.emitted(position)
                    yield position, sample
        finally:
            fetched.close()
