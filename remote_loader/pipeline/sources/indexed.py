"""An indexed dataset (``Indexed``) and the sample source of one of its workers
(``ShardSource``): its plan's shards fetched ahead in ranges and read in its delivery order
(``delivery.py``): groups of ``open_shards`` spans interleaved, then the shuffle buffer.

The source is the one stateful part of a pipeline. It counts its outputs (a skipped sample is an
output that yields nothing), keeps the positions of the latest ones, and says at any output
which positions are not yet delivered (``undelivered``). Given a count of outputs to start
from (a checkpoint's), it regenerates its order up to there on integers and fetches only what
the shuffle buffer held at that point, then goes on as the uninterrupted run would have.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from remote_loader.errors import OnError
from remote_loader.format import Sample
from remote_loader.pipeline.order.delivery import (
    Group,
    Mixing,
    Point,
    Shuffler,
    fast_forward,
    groups,
    plan_after,
    ranges_in_need,
    undelivered_at,
    worker_seeds,
)
from remote_loader.pipeline.order.intervals import merge
from remote_loader.pipeline.order.split import EpochOrders, PlanSpans, Span
from remote_loader.pipeline.state.resume import Entry, Layout
from remote_loader.read.fetch import Fetched, Job, Prefetcher, fetch_head
from remote_loader.read.heap import release_free_memory
from remote_loader.read.reader import DatasetReader
from remote_loader.read.session import ReadSession
from remote_loader.read.shards import DAMAGE, IndexCache, OpenRange, RangePlan, locate_span

_EARLY_HEADS = 4  # shards whose first bytes are fetched before their indexes have come, per iteration
_GAP = 2  # samples of a shard between two a resumed buffer needs that are fetched with them (one GET, not two)


@dataclass(frozen=True)
class GroupReads:
    """A group's reads from read ``offset`` on, and the ranges they open, in the order the
    reads need them (``delivery.ranges_in_need``: ``(read, slot, first, stop)``, ``read``
    counted from ``offset``). The one plan of a group: its jobs are made from ``ranges`` in
    this order, and its reads open the fetched ranges as ``ranges`` says, so the two cannot
    disagree."""

    group: Group
    offset: int
    ranges: list[tuple[int, int, int, int]]


@dataclass(frozen=True)
class Piece:
    """What a fetched range is for: a range of a group's plan (``reads``), or samples a
    resumed shuffle buffer held (``wanted``: pairs of the sample in its shard and its index
    in the buffer)."""

    plan: RangePlan
    reads: GroupReads | None = None
    wanted: tuple[tuple[int, int], ...] = ()


def _locate(cache: IndexCache, shard: int, first: int, stop: int, on_error: OnError, reads: GroupReads | None,
            wanted: tuple[tuple[int, int], ...] = ()) -> tuple[int, int, Piece]:
    start, end, plan = locate_span(cache, shard, first, stop, on_error)
    return start, end, Piece(plan, reads, wanted)


class ShardSource:
    """One worker's samples of an indexed dataset, in its delivery order.

    Args:
        reader: The dataset.
        session: The worker's requests (retrying store, metrics, cancel).
        spans: Makes the spans of the worker's plan, in order (called once more when resuming).
        rows: The plan's intervals of positions, in order (for ``undelivered``).
        mixing: Spans read at once, and the shuffle buffer.
        seeds: The source order's and the shuffle buffer's.
        locate: Positions -> (shards, samples in them): where a resumed buffer's samples lie.
        on_error: ``"skip"`` skips damaged samples and shards (counted, logged).
        delivered: Outputs given before (a resume): the order goes on from there.
    """

    def __init__(self, reader: DatasetReader, session: ReadSession, *, spans: Callable[[], Iterable[Span]],
                 rows: Sequence[tuple[int, int]], mixing: Mixing, seeds: tuple[Sequence[int], Sequence[int]],
                 locate: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], on_error: OnError = OnError.RAISE,
                 delivered: int = 0) -> None:
        self.reader, self.session, self.spans, self.rows = reader, session, spans, rows
        self.mixing, self.seeds, self.locate, self.on_error = mixing, seeds, locate, on_error
        self.point = fast_forward(spans(), mixing, seeds, delivered) if delivered else Point(0, 0, 0, 0)
        self.cache = IndexCache(reader, session, keep=2 * mixing.open_shards + 4)
        self._ring: deque[int] = deque()  # positions of outputs from ``_base`` on
        self._base = self.point.outputs
        self._skips: list[list[int]] = []  # runs [output, count] of outputs that were skipped samples
        self._group: Group | None = None
        self._group_start = self.point.group_start
        self._next: list[int] = []  # per slot of the group being read, the position of its next read
        self._shuffler: Shuffler | None = None
        self._started = False

    # ------------------------------------------------------------------ what it says

    @property
    def outputs(self) -> int:
        """Outputs given so far this epoch (a skipped sample counts)."""
        return self._base + len(self._ring)

    def output_of(self, emitted: int) -> int:
        """Outputs given up to and including the ``emitted``-th sample yielded in this
        iteration (1-based; 0 for none): skipped samples before it count."""
        if emitted <= 0:
            return self.point.outputs
        output = self.point.outputs + emitted - 1
        for first, count in self._skips:
            if first <= output:
                output += count
            else:
                break
        return output + 1

    @property
    def emitted(self) -> int:
        """Samples yielded in this iteration."""
        return self.outputs - self.point.outputs - sum(count for _, count in self._skips)

    def describe(self, emitted: int) -> str | None:
        """The ``emitted``-th sample yielded in this iteration (1-based), for a message:
        its key and shard, while its position is kept."""
        position = self.position(self.output_of(emitted) - 1)
        if position is None:
            return None
        shards, samples = self.locate(np.array([position], dtype=np.int64))
        shard, sample = int(shards[0]), int(samples[0])
        name = self.reader.manifest.shards[shard].name
        index = self.cache.cached(shard)
        return f"sample {index.keys[sample]!r} of {name}" if index is not None else f"sample {sample} of {name}"

    def position(self, output: int) -> int | None:
        """The position of output ``output`` (0-based), while it is kept (not yet trimmed)."""
        k = output - self._base
        return self._ring[k] if 0 <= k < len(self._ring) else None

    def trim(self, delivered: int) -> None:
        """Forget the positions of outputs before ``delivered``: they are delivered for good."""
        for _ in range(min(delivered - self._base, len(self._ring))):
            self._ring.popleft()
            self._base += 1

    def undelivered(self, delivered: int) -> list[tuple[int, int]]:
        """Positions of the plan not among the first ``delivered`` outputs, as merged
        intervals: outputs after those, what the shuffle buffer holds, and what is unread."""
        if not self._started:
            return self.at_entry()
        out = [(p, p + 1) for p in itertools.islice(self._ring, max(0, delivered - self._base), None)]
        if self._shuffler is not None:
            out += [(p, p + 1) for p, _ in self._shuffler.items]
        end = self._group_start
        if self._group is not None:
            out += [(p, s.position + len(s)) for p, s in zip(self._next, self._group.spans, strict=True)]
            end += len(self._group)
        return merge(out + plan_after(self.rows, end))

    def at_entry(self) -> list[tuple[int, int]]:
        """The positions not delivered where this iteration enters its plan (``order.undelivered_at``)."""
        return undelivered_at(self.point, self.spans(), self.rows, self.mixing.open_shards, self.seeds[0])

    # ------------------------------------------------------------------ what it fetches

    def _jobs(self) -> Iterator[Job[Piece]]:
        yield from self._held_jobs()
        point = self.point
        ahead = groups(self.spans(), self.mixing.open_shards, self.seeds[0], first=point.group)
        group = next(ahead, None)
        heads = _EARLY_HEADS
        while group is not None:
            # Ranges are cut from the indexes: this group's are fetched at once, in parallel,
            # and the next group's while this one is read.
            self.cache.prefetch(span.shard for span in group.spans)
            following = next(ahead, None)
            if following is not None:
                self.cache.prefetch(span.shard for span in following.spans)
            offset = point.reads - point.group_start if group.index == point.group else 0
            early = self._early_heads(group, offset, heads)
            heads -= len(early)
            yield from self._group_jobs(group, offset, early)
            group = following

    def _early_heads(self, group: Group, offset: int, most: int) -> dict[int, Any]:
        """While the indexes a group's ranges are cut from are on their way (the first group's,
        in practice), the first bytes of the shards it starts reading at their first sample,
        which lies just past the shard's start: ``most`` of them, by slot. The one place that
        decides which ranges start early (the fetcher takes ``Job.early`` as it comes)."""
        shards = self.reader.manifest.shards
        cursors = group.cursors(offset).tolist()
        early: dict[int, Any] = {}
        for slot, (span, cursor) in enumerate(zip(group.spans, cursors, strict=True)):
            if len(early) < most and span.start + cursor == 0 and self.cache.cached(span.shard) is None:
                entry = shards[span.shard]
                shard = self.reader.shard(entry)
                if not self.session.holds(shard):  # a cached shard is read from its file: no head to fetch
                    early[slot] = fetch_head(self.session, self.reader.location.bucket, shard, 0, entry.size)
        return early

    def _group_jobs(self, group: Group, offset: int, early: dict[int, Any]) -> list[Job[Piece]]:
        """The group's ranges from read ``offset`` on, in the order its reads first need them;
        a slot's first range takes the head ``early`` holds for it."""
        shards = self.reader.manifest.shards
        cursors = group.cursors(offset).tolist()
        bounds = [self._cuts(span, span.start + cursor) for span, cursor in zip(group.spans, cursors, strict=True)]
        reads = GroupReads(group, offset, ranges_in_need(group, offset, bounds))
        jobs = []
        for _, slot, first, stop in reads.ranges:
            shard = group.spans[slot].shard
            jobs.append(Job(self.reader.shard(shards[shard]),
                            partial(_locate, self.cache, shard, first, stop, self.on_error, reads),
                            early.pop(slot, None) if first == 0 else None))
        return jobs

    def _cuts(self, span: Span, first: int) -> list[int]:
        """Where the ranges of samples ``[first, span.end)`` of the span's shard begin and end:
        each at most ``range_bytes`` of it, or one sample larger than that (its index says)."""
        try:
            index = self.cache.get(span.shard)
        except DAMAGE:  # one range: locating it reports the damage, or skips the shard
            return [first, span.end]
        return index.cuts(first, span.end, self.session.config.range_bytes)

    def _held_jobs(self) -> list[Job[Piece]]:
        """Jobs fetching the samples a resumed shuffle buffer held: per shard, runs of them
        (two a few samples apart share a GET), each at most a range long."""
        if not self.point.held:
            return []
        shards, samples = (a.tolist() for a in self.locate(np.array(self.point.held, dtype=np.int64)))
        self.cache.prefetch(set(shards))
        manifest = self.reader.manifest.shards
        runs: list[tuple[int, list[tuple[int, int]]]] = []
        for k in sorted(range(len(shards)), key=lambda k: (shards[k], samples[k])):
            shard, sample = shards[k], samples[k]
            if runs and runs[-1][0] == shard and sample - runs[-1][1][-1][0] <= _GAP + 1 \
                    and self._cuts(Span(shard, runs[-1][1][0][0], sample + 1), runs[-1][1][0][0])[1] > sample:
                runs[-1][1].append((sample, k))  # within the range that starts at the run's first sample
            else:
                runs.append((shard, [(sample, k)]))
        return [Job(self.reader.shard(manifest[shard]),
                    partial(_locate, self.cache, shard, run[0][0], run[-1][0] + 1, self.on_error, None, tuple(run)))
                for shard, run in runs]

    # ------------------------------------------------------------------ what it yields

    def __iter__(self) -> Iterator[Sample]:
        """The samples, in the delivery order from output ``delivered`` on."""
        bucket = self.reader.location.bucket
        with Prefetcher(bucket, self._jobs(), self.session, self.reader.round_trip) as prefetcher:
            fetched = iter(prefetcher)
            try:
                held = self._read_held(fetched)
                reads = self._reads(fetched)
                if self.mixing.bufsize:
                    self._shuffler = Shuffler(self.mixing.bufsize, self.mixing.initial, self.seeds[1], held,
                                              self.point.outputs)
                    outputs: Iterator[tuple[int, Sample | None]] = self._shuffler.run(reads)
                else:
                    outputs = reads
                # Started once a resumed buffer's samples are in it: an error or Ctrl-C while they
                # are read leaves the state as it entered (``at_entry``), which counts them.
                self._started = True
                yield from self._emit(outputs)
            finally:
                fetched.close()

    def _emit(self, outputs: Iterator[tuple[int, Sample | None]]) -> Iterator[Sample]:
        ring, skips = self._ring, self._skips
        for position, sample in outputs:
            ring.append(position)
            if sample is None:
                output = self._base + len(ring) - 1
                if skips and skips[-1][0] + skips[-1][1] == output:
                    skips[-1][1] += 1
                else:
                    skips.append([output, 1])
                continue
            yield sample

    def _read_held(self, fetched: Iterator[Fetched[Piece]]) -> list[tuple[int, Sample | None]]:
        """What a resumed shuffle buffer held, read from the first ranges fetched, in its order."""
        held = self.point.held
        out: list[Any] = [None] * len(held)
        remaining = len(held)
        while remaining:
            item = next(fetched)
            piece = item.context
            reading = OpenRange(self.reader, item, piece.plan, self.session, self.on_error)
            try:
                for sample_index, k in piece.wanted:
                    reading.next = sample_index  # the samples between are not wanted
                    out[k] = (held[k], reading.next_sample())
                    remaining -= 1
            finally:
                reading.close()
        return out

    def _reads(self, fetched: Iterator[Fetched[Piece]]) -> Iterator[tuple[int, Sample | None]]:
        """``(position, sample)`` in the source order; None for a sample skipped. Each group
        comes with its first range, whose ``GroupReads`` says at which read each of the
        group's ranges opens: the ranges arrive in that order, the order its jobs were made in."""
        start = self.point.group_start
        item = next(fetched, None)
        while item is not None:
            reads = item.context.reads
            assert reads is not None  # a resumed buffer's ranges come first, all taken by _read_held
            group, ranges = reads.group, reads.ranges
            cursors = group.cursors(reads.offset).tolist()
            nexts = [s.position + c for s, c in zip(group.spans, cursors, strict=True)]
            readers: list[OpenRange | None] = [None] * len(group.spans)
            self._group, self._group_start, self._next = group, start, nexts
            opened = 0
            try:
                for read, slot in enumerate(group.labels[reads.offset:].tolist()):
                    if opened < len(ranges) and ranges[opened][0] == read:  # this read opens its slot's next range
                        if readers[slot] is not None:
                            readers[slot].close()
                        fetched_range = item if item is not None else next(fetched)
                        readers[slot] = OpenRange(self.reader, fetched_range, fetched_range.context.plan, self.session,
                                                  self.on_error)
                        item, opened = None, opened + 1
                    position = nexts[slot]
                    sample = readers[slot].next_sample()  # what stops it here (Ctrl-C) leaves the position unread
                    nexts[slot] = position + 1
                    yield position, sample
            finally:
                for reading in readers:
                    if reading is not None:
                        reading.close()
            start += len(group)
            self._group, self._group_start, self._next = None, start, []
            item = next(fetched, None)


# --------------------------------------------------------------------------- the dataset it reads


class Indexed:
    """An indexed dataset (a manifest): its epochs split by positions, its iterations resumable."""

    resumable = True

    def __init__(self, reader: DatasetReader, on_error: OnError) -> None:
        self.reader, self.on_error = reader, on_error
        _ = reader.counts  # read now, so forked DataLoader workers share its arrays; DatasetNotFound
        self.rows = reader.manifest.shards.rows  # blocks of the epoch's order (None: one block)
        self.orders = EpochOrders()  # shared by the pipeline's copies

    @property
    def classes(self) -> list[str]:
        return self.reader.classes

    def samples(self) -> int:
        return len(self.reader)

    def prepare(self, seed: int, epoch: int, shuffle: bool) -> None:
        self.orders.prepare(self.reader.counts, self.rows, seed, epoch, shuffle)

    def source(self, layout: Layout, epoch: int, worker: int, num_workers: int, entry: Entry | None,
               session: ReadSession) -> ShardSource:
        if entry is None:
            raise ValueError("an indexed dataset's source starts from an Entry (WorkerStream.reset makes one)")
        plan = entry.plan
        counts, seed, shuffle = self.reader.counts, layout.seed, layout.shuffle
        spans = PlanSpans(self.orders.get(counts, self.rows, seed, epoch, shuffle, keep=False), plan.rows)
        release_free_memory()  # the split's temporaries, so that a worker keeps only its share

        def where(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # a resumed buffer's samples (rare)
            return self.orders.get(counts, self.rows, seed, epoch, shuffle, keep=False).locate(positions)

        return ShardSource(self.reader, session, spans=lambda: spans, rows=plan.rows, mixing=layout.mixing,
                           seeds=worker_seeds(seed, epoch, layout.rank, worker), locate=where,
                           on_error=self.on_error, delivered=entry.delivered)
