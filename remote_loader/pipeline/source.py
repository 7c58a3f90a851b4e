"""The sample source of one worker: its spans fetched ahead, mixed across open shards.

``ShardSource`` is the one object the pipeline asks for samples: it cuts the ranges of a
worker's spans (or takes whole unindexed tars), has the prefetcher fetch them, and yields
their samples mixed across open ranges, each with its position in the epoch. It tells the
worker's ``Progress`` only what it skipped under ``on_error="skip"``; in a replayed run it
fetches nothing for ranges already delivered and emits placeholders for their samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from remote_loader.format import Sample
from remote_loader.pipeline.resume.progress import Progress
from remote_loader.pipeline.resume.replay import REPLAYED, Placeholder, Replay, ReplayedRange
from remote_loader.pipeline.split import Span
from remote_loader.read.fetch import Fetched, Job, Prefetcher
from remote_loader.read.reader import DatasetReader
from remote_loader.read.retry import RetryPolicy
from remote_loader.read.shards import IndexCache, OpenRange, RangePlan, TarRead, locate_span


@dataclass(frozen=True)
class Located:
    """What a fetched range holds, as the source opens it: its first sample's position in the
    epoch (-1 for an unindexed tar), how many samples it covers, and how to read it: a plan
    of the read layer's, or ``replayed``, samples ``[first, stop)`` already delivered."""

    position: int
    samples: int
    plan: RangePlan | None = None
    replayed: tuple[int, int] | None = None


def split_spans(reader: DatasetReader, spans: Iterable[Span], range_bytes: int, group: int) -> Iterator[Span]:
    """Cut spans into ranges of about ``range_bytes`` and interleave the ranges of each
    ``group`` consecutive spans, so a reader with ``group`` open ranges still mixes
    ``group`` shards while holding only one range of each. Lazy: it reads ``group`` spans
    at a time."""
    samples, sizes = reader.manifest.shards.samples, reader.manifest.shards.size
    spans = iter(spans)
    while block := list(itertools.islice(spans, group)):
        pieces = []
        for span in block:
            per_range = max(1, int(range_bytes * int(samples[span.shard]) // max(1, int(sizes[span.shard]))))
            pieces.append([Span(span.shard, a, min(a + per_range, span.end), span.position + a - span.start)
                           for a in range(span.start, span.end, per_range)])
        yield from (p[position] for position in range(max(len(p) for p in pieces)) for p in pieces if position < len(p))


def _located(cache: IndexCache, span: Span, on_error: str) -> tuple[int, int, Located]:
    start, end, plan = locate_span(cache, span.shard, span.start, span.end, on_error)
    return start, end, Located(span.position, len(span), plan)


def _replayed(span: Span, skipped: bool) -> tuple[int, int, Located]:
    return 0, 0, Located(span.position, len(span), replayed=(span.start, span.start if skipped else span.end))


def _whole(name: str, size: int) -> tuple[int, int, Located]:
    return 0, size, Located(-1, 0, TarRead(name))


def span_jobs(reader: DatasetReader, spans: Iterable[Span], policy: RetryPolicy, open_shards: int = 1,
              on_error: str = "raise", replay: Replay | None = None) -> Iterator[Job[Located]]:
    """Jobs fetching the samples of ``spans`` of an indexed dataset, in ranges of about
    ``range_bytes``, made as the prefetcher reaches them. A replayed run fetches nothing
    for a range whose samples were all delivered (``replay.py``)."""
    shards = reader.manifest.shards
    cache = IndexCache(reader, policy, keep=2 * open_shards + 4)
    for s in split_spans(reader, (s for s in spans if len(s)), policy.config.range_bytes, open_shards):
        key = reader.location.key(shards.names[s.shard])
        if replay is not None and replay.placeholders and not replay.any_live(s.position, s.position + len(s)):
            yield Job(key, partial(_replayed, s, replay.skipped_at_open(s.position)))
        else:
            # A shard's first sample lies just past its start: fetch from there while its index arrives.
            head = (0, int(shards.size[s.shard])) if s.start == 0 else None
            yield Job(key, partial(_located, cache, s, on_error), head)


def tar_jobs(reader: DatasetReader, tars: Sequence[tuple[str, int]]) -> list[Job[Located]]:
    """Jobs fetching whole unindexed tars ``(name, size)``."""
    return [Job(reader.location.key(name), partial(_whole, name, size)) for name, size in tars]


class ShardSource:
    """One worker's samples, each with its position (-1 for unindexed tars).

    Args:
        reader: The dataset.
        policy: The worker's requests (retrying store, metrics, cancel).
        open_shards: Ranges read at once, each next sample drawn from one of them.
        seed: Draws which open range gives the next sample.
        on_error: ``"skip"`` skips damaged samples and shards (counted, logged).
        progress: Told of every sample skipped; its replay, if any, replayed.
    """

    def __init__(self, reader: DatasetReader, policy: RetryPolicy, *, open_shards: int, seed: Sequence[int],
                 on_error: str = "raise", progress: Progress | None = None) -> None:
        self.reader, self.policy, self.open_shards, self.seed = reader, policy, open_shards, seed
        self.on_error, self.progress = on_error, progress
        self.replay = progress.replay if progress is not None else None

    def spans(self, spans: Iterable[Span]) -> Iterator[tuple[int, Sample | Placeholder]]:
        """The samples of ``spans`` of an indexed dataset, read in ranges of about ``range_bytes``."""
        return self._stream(span_jobs(self.reader, spans, self.policy, self.open_shards, self.on_error, self.replay))

    def tars(self, tars: Sequence[tuple[str, int]]) -> Iterator[tuple[int, Sample | Placeholder]]:
        """The samples of whole unindexed tars ``(name, size)``, each read sequentially."""
        return self._stream(tar_jobs(self.reader, tars))

    def _open(self, fetched: Fetched[Located]) -> tuple[Any, int]:
        """The range as a reading (``next``, ``stop``, ``done``, ``next_sample()``, ``close()``)
        and the position of its sample 0."""
        located = fetched.context
        if located.replayed is not None:
            first, stop = located.replayed
            return ReplayedRange(first, stop, fetched.release), located.position - first
        assert located.plan is not None
        reading = OpenRange(self.reader, fetched, located.plan, self.policy, self.on_error)
        return reading, located.position - reading.next

    def _stream(self, jobs: Iterable[Job[Located]]) -> Iterator[tuple[int, Sample | Placeholder]]:
        """The jobs' samples, each next one drawn from one of ``open_shards`` open ranges by
        the seed alone (never by fetch timing), with its position. Every sample of every range
        is yielded once, less those skipped under ``on_error="skip"``; a replayed run skips
        where its run skipped and yields ``REPLAYED`` for samples delivered before its state."""
        progress, replay = self.progress, self.replay
        rng = np.random.default_rng(list(self.seed))
        with Prefetcher(self.reader.location.bucket, jobs, self.policy, self.reader.round_trip) as prefetcher:
            fetched = iter(prefetcher)
            reading: list[Any] = []
            base: dict[int, int] = {}  # id(reading) -> the position of its sample 0
            exhausted = False
            try:
                while True:
                    while not exhausted and len(reading) < self.open_shards:
                        item = next(fetched, None)
                        if item is None:
                            exhausted = True
                            continue
                        opened, zero = self._open(item)
                        if opened.done:  # an indexed range skipped whole under on_error="skip"
                            if progress is not None and item.context.position >= 0:
                                progress.skipped(item.context.position, item.context.samples, at_open=True)
                            opened.close()
                            continue
                        reading.append(opened)
                        base[id(opened)] = zero
                    if not reading:
                        return
                    current = reading[int(rng.integers(len(reading)))] if len(reading) > 1 else reading[0]
                    first = current.next
                    position = base[id(current)] + first
                    skips = replay.skip_at(position) if replay is not None else 0
                    if skips:  # skipped in the run replayed: skipped again, whatever it reads now
                        current.next = min(current.stop, first + skips)
                        sample = None
                    else:
                        sample = current.next_sample()
                    if sample is None and progress is not None:
                        progress.skipped(position, current.next - first)
                    if current.done:
                        reading.remove(current)
                        del base[id(current)]
                        current.close()
                    if sample is not None:
                        if replay is not None and replay.placeholders and not replay.live(position):
                            sample = REPLAYED
                        yield position, sample
            finally:
                fetched.close()
