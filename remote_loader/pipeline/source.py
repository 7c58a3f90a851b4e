"""The sample source of one worker: its spans fetched ahead, mixed across open shards.

``ShardSource`` is the one object the pipeline asks for samples: it plans the ranges of a
worker's spans (or whole unindexed tars), has the prefetcher fetch them, and yields their
samples mixed across open ranges, each with its position in the epoch, telling the
worker's ``Progress`` what it took, cut, opened and emitted. The functions below are its
pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from functools import partial

import numpy as np

from remote_loader.format import Sample
from remote_loader.pipeline.position import Progress
from remote_loader.pipeline.split import Span
from remote_loader.read.fetch import Job, Prefetcher
from remote_loader.read.reader import DatasetReader
from remote_loader.read.retry import RetryPolicy
from remote_loader.read.shards import (
    REPLAYED,
    IndexCache,
    OpenRange,
    Placeholder,
    RangePlan,
    Replayed,
    TarRead,
    locate_span,
)


def _whole(name: str, size: int) -> tuple[int, int, RangePlan]:
    return 0, size, TarRead(name)


def _replayed(span: Span, skipped: bool) -> tuple[int, int, RangePlan]:
    return 0, 0, Replayed(span.shard, span.start, span.start if skipped else span.end)


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
              on_error: str = "raise", progress: Progress | None = None) -> Iterator[Job[RangePlan]]:
    """Jobs fetching the samples of ``spans`` of an indexed dataset, in ranges of about
    ``range_bytes``, made as the prefetcher reaches them. A replayed run fetches nothing
    for a range whose samples were all delivered (``replay.py``)."""
    shards = reader.manifest.shards
    cache = IndexCache(reader, policy, keep=2 * open_shards + 4)
    replay = progress.replay if progress is not None else None
    for s in split_spans(reader, (s for s in spans if len(s)), policy.config.range_bytes, open_shards, progress):
        key = reader.location.key(shards.names[s.shard])
        if replay is not None and replay.placeholders and not replay.any_live(s.position, s.position + len(s)):
            yield Job(key, partial(_replayed, s, replay.skipped_at_open(s.position)))
        else:
            # A shard's first sample lies just past its start: fetch from there while its index arrives.
            head = (0, int(shards.size[s.shard])) if s.start == 0 else None
            yield Job(key, partial(locate_span, cache, s.shard, s.start, s.end, on_error), head)


def tar_jobs(reader: DatasetReader, tars: Sequence[tuple[str, int]]) -> list[Job[RangePlan]]:
    """Jobs fetching whole unindexed tars ``(name, size)``."""
    return [Job(reader.location.key(name), partial(_whole, name, size)) for name, size in tars]


def stream_positions(
    reader: DatasetReader,
    jobs: Iterable[Job[RangePlan]],
    *,
    policy: RetryPolicy,
    open_shards: int,
    seed: Sequence[int],
    on_error: str = "raise",
    progress: Progress | None = None,
) -> Iterator[tuple[int, Sample | Placeholder]]:
    """Yield the samples the ``jobs`` fetch, each with its position in the epoch (-1
    without ``progress``, which learns of every range opened and sample emitted), drawing
    each next sample from one of ``open_shards`` ranges.

    Which open range gives the next sample is drawn from ``seed``, so the order depends on
    the seed alone, never on fetch timing. Every sample of every range is yielded once
    (less those skipped under ``on_error="skip"``, which are counted and logged). A
    replayed run skips where its run skipped and yields ``REPLAYED`` for samples delivered
    before its state (``replay.py``).
    """
    replay = progress.replay if progress is not None else None
    rng = np.random.default_rng(list(seed))
    with Prefetcher(reader.location.bucket, jobs, policy) as prefetcher:
        fetched = iter(prefetcher)
        reading: list[OpenRange] = []
        exhausted = False
        try:
            while True:
                while not exhausted and len(reading) < open_shards:
                    item = next(fetched, None)
                    if item is None:
                        exhausted = True
                        continue
                    opened = OpenRange(reader, item, policy, on_error)
                    base = progress.opening() - opened.next if progress is not None else -1  # of its sample 0
                    if opened.done:  # an indexed range skipped whole under on_error="skip"
                        if progress is not None:
                            progress.skipped(base + opened.next, opened.stop - opened.next, at_open=True)
                        opened.close()
                        continue
                    reading.append(opened)
                    if progress is not None:
                        progress.opened(opened, base)
                if not reading:
                    return
                current = reading[int(rng.integers(len(reading)))] if len(reading) > 1 else reading[0]
                first = current.next
                skips = replay.skip_at(progress.next_position(current)) if replay is not None and progress else 0
                if skips:  # skipped in the run replayed: skipped again, whatever it reads now
                    current.next = min(current.stop, first + skips)
                    sample = None
                else:
                    sample = current.next_sample()
                position = progress.position(current) if progress is not None else -1
                if sample is None and progress is not None:
                    progress.skipped(position - (current.next - 1 - first), current.next - first)
                if current.done:
                    reading.remove(current)
                    if progress is not None:
                        progress.closed(current)
                    current.close()
                if sample is not None:
                    if replay is not None and replay.placeholders and not replay.live(position):
                        sample = REPLAYED
                    if progress is not None:
                        progress.emitted(position)
                    yield position, sample
        finally:
            fetched.close()


class ShardSource:
    """One worker's samples, each with its position (-1 for unindexed tars).

    Args:
        reader: The dataset.
        policy: The worker's requests (retrying store, metrics, cancel).
        open_shards: Ranges read at once, each next sample drawn from one of them.
        seed: Draws which open range gives the next sample.
        on_error: ``"skip"`` skips damaged samples and shards (counted, logged).
        progress: Told of every range cut and opened and every sample emitted.
    """

    def __init__(self, reader: DatasetReader, policy: RetryPolicy, *, open_shards: int, seed: Sequence[int],
                 on_error: str = "raise", progress: Progress | None = None) -> None:
        self.reader, self.policy, self.open_shards, self.seed = reader, policy, open_shards, seed
        self.on_error, self.progress = on_error, progress

    def spans(self, spans: Iterable[Span]) -> Iterator[tuple[int, Sample | Placeholder]]:
        """The samples of ``spans`` of an indexed dataset, read in ranges of about ``range_bytes``."""
        jobs = span_jobs(self.reader, spans, self.policy, self.open_shards, self.on_error, self.progress)
        return self._stream(jobs)

    def tars(self, tars: Sequence[tuple[str, int]]) -> Iterator[tuple[int, Sample | Placeholder]]:
        """The samples of whole unindexed tars ``(name, size)``, each read sequentially."""
        return self._stream(tar_jobs(self.reader, tars))

    def _stream(self, jobs: Iterable[Job[RangePlan]]) -> Iterator[tuple[int, Sample | Placeholder]]:
        return stream_positions(self.reader, jobs, policy=self.policy, open_shards=self.open_shards, seed=self.seed,
                                on_error=self.on_error, progress=self.progress)
