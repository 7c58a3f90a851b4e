"""A worker's delivery order in an epoch, on integers: which position comes out when (pure, no I/O).

A worker reads its plan (intervals of positions, ``split.py``) as spans of shards, in plan
order. Its *source order* mixes ``open_shards`` spans at a time: the spans are taken in
groups of that many, and each group's reads are a uniform random interleaving of its spans,
each span read front to back (so a shard is read in sequence, in ranges). The *delivery
order* passes the source order through a shuffle buffer of ``bufsize`` (output from
``initial`` on): each output is drawn uniformly from the buffer.

Both depend on the seed, the epoch, the worker and its plan, never on the bytes, on fetch
timing, or on how ranges are cut: so the positions a worker had delivered after ``n`` outputs
are known from ``n`` alone, and a resumed worker regenerates its order and goes on from
output ``n`` (``fast_forward``) without reading what came before.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from remote_loader.pipeline.order.intervals import merge
from remote_loader.pipeline.order.split import Span

T = TypeVar("T")

_DRAWS = 1024  # uniforms drawn at once: one per output, the same values however they are drawn
_END = object()


@dataclass(frozen=True)
class Mixing:
    """What a worker's delivery order depends on besides its plan and seeds: the spans read
    at once, and the shuffle buffer (``bufsize`` 0: none)."""

    open_shards: int
    bufsize: int = 0
    initial: int = 0

    def as_list(self) -> list[int]:
        return [self.open_shards, self.bufsize, self.initial]


@dataclass
class Group:
    """Spans read at once: read ``t`` of the group takes the next sample of ``spans[labels[t]]``."""

    index: int
    spans: list[Span]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def positions(self) -> np.ndarray:
        """The position each read of the group takes."""
        out = np.empty(len(self.labels), dtype=np.int64)
        for slot, span in enumerate(self.spans):
            mask = self.labels == slot
            out[mask] = np.arange(span.position, span.position + len(span), dtype=np.int64)
        return out

    def cursors(self, reads: int) -> np.ndarray:
        """How many samples of each span the group's first ``reads`` reads took."""
        return np.bincount(self.labels[:reads], minlength=len(self.spans))


def groups(spans: Iterable[Span], open_shards: int, seed: Sequence[int], first: int = 0) -> Iterator[Group]:
    """The source order: ``spans`` in groups of ``open_shards``, each group's reads a uniform
    random interleaving drawn from ``(*seed, group index)``; from group ``first`` on."""
    live = (s for s in spans if len(s))
    for _ in itertools.islice(live, first * open_shards):
        pass
    for index in itertools.count(first):
        block = list(itertools.islice(live, open_shards))
        if not block:
            return
        labels = np.repeat(np.arange(len(block), dtype=np.int32), [len(s) for s in block])
        if len(block) > 1:
            np.random.default_rng([*seed, index]).shuffle(labels)
        yield Group(index, block, labels)


def worker_seeds(seed: int, epoch: int, rank: int, worker: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The seeds of a worker's source order and of its shuffle buffer."""
    seed &= 2**64 - 1
    return (seed, epoch, rank, worker, 1), (seed, epoch, rank, worker, 2)


class Shuffler:
    """The shuffle buffer: for each sample in, up to two more while it holds fewer than
    ``bufsize``; once it holds ``initial``, one out per sample in, drawn uniformly; at the
    end it drains. Every sample comes out exactly once. One uniform of the seed's stream is
    drawn per output, so a buffer can be restored at any output from its items and its
    output count (``resumed``).

    Args:
        bufsize: Most samples held.
        initial: Samples held before the first output.
        seed: The buffer's random stream.
        items: What it holds already, in order (a restored buffer).
        outputs: Outputs given before (a restored buffer).
    """

    def __init__(self, bufsize: int, initial: int, seed: Sequence[int], items: Iterable[Any] = (),
                 outputs: int = 0) -> None:
        self.bufsize, self.initial = bufsize, initial
        self.items: list[Any] = list(items)
        self.outputs = outputs
        self.reads = 0  # items taken from the source by ``run``
        bits = np.random.PCG64(np.random.SeedSequence(list(seed)))  # what default_rng(seed) makes
        bits.advance(outputs)  # one uniform per output
        self._rng = np.random.Generator(bits)

    def run(self, source: Iterator[T]) -> Iterator[T]:
        """The items of ``source`` (an iterator) in the buffer's order, after what it holds.
        One loop fills and drains (``source`` ended: nothing more comes in), the draw inline:
        it runs once per sample."""
        items, bufsize, initial, rng = self.items, self.bufsize, self.initial, self._rng
        draws: list[float] = []
        k = 0
        taken = self.reads
        for item in itertools.chain(source, itertools.repeat(_END)):
            if item is not _END:
                items.append(item)
                taken += 1
                if len(items) < bufsize:  # filling: up to two more (once full, one in, one out)
                    for _ in range(2):
                        if len(items) >= bufsize:
                            break
                        extra = next(source, _END)
                        if extra is _END:
                            break
                        items.append(extra)
                        taken += 1
                self.reads = taken
                if len(items) < initial:
                    continue
            elif not items:
                return
            if k == len(draws):
                draws, k = rng.random(_DRAWS).tolist(), 0
            n = len(items)
            pick = min(int(draws[k] * n), n - 1)
            k += 1
            items[pick], items[-1] = items[-1], items[pick]
            self.outputs += 1
            yield items.pop()


def ranges_in_need(group: Group, offset: int, bounds: Sequence[Sequence[int]]) -> list[tuple[int, int, int, int]]:
    """The group's ranges from its read ``offset`` on, in the order its reads first need them:
    ``(read, slot, first, stop)``. ``bounds[s]`` cuts what slot ``s`` has left to read (from
    where the reads before ``offset`` left it to its span's end) into ranges: their
    boundaries, sample numbers of its shard. A reader that opens a slot's next range whenever
    the slot has read its last one opens them in this order."""
    rest = group.labels[offset:]
    cursors = group.cursors(offset)
    needed = []
    for slot, span in enumerate(group.spans):
        cuts = bounds[slot]
        if cuts[0] != span.start + int(cursors[slot]) or cuts[-1] != span.end:
            raise ValueError(f"the ranges of slot {slot} cut {cuts[0]}..{cuts[-1]}, not what it has left to read,"
                             f" {span.start + int(cursors[slot])}..{span.end}")
        reads = np.flatnonzero(rest == slot)
        needed += [(int(reads[a - cuts[0]]), slot, a, b) for a, b in itertools.pairwise(cuts)]
    needed.sort()
    return needed


def read_positions(groups_: Iterable[Group]) -> Iterator[int]:
    """The source order as positions, one group at a time."""
    for group in groups_:
        yield from group.positions().tolist()


@dataclass
class Point:
    """Where a worker's delivery order stands after ``outputs`` outputs: ``reads`` samples
    read from its source, the next of them in group ``group``, which starts after
    ``group_start`` reads; and the positions the shuffle buffer holds, in its order."""

    outputs: int
    reads: int
    group: int
    group_start: int
    held: list[int] = field(default_factory=list)


def fast_forward(spans: Iterable[Span], mixing: Mixing, seeds: tuple[Sequence[int], Sequence[int]],
                 outputs: int) -> Point:
    """The point after ``outputs`` outputs of the delivery order (fewer if the order is
    shorter). ``seeds``: the source order's and the shuffle buffer's."""
    last: list[Any] = [0, 0, 0]  # the group being read: its index, reads before it, its length

    def reads() -> Iterator[int]:
        start = 0
        for group in groups(spans, mixing.open_shards, seeds[0]):
            last[:] = [group.index, start, len(group)]
            yield from read_positions([group])
            start += len(group)

    if mixing.bufsize:
        shuffler = Shuffler(mixing.bufsize, mixing.initial, seeds[1])
        done = sum(1 for _ in itertools.islice(shuffler.run(reads()), outputs))
        taken, held = shuffler.reads, list(shuffler.items)
    else:
        done = taken = sum(1 for _ in itertools.islice(reads(), outputs))
        held = []
    index, start, length = last
    if taken == start + length and length:  # the group was read whole: the next read opens the next
        index, start = index + 1, taken
    return Point(done, taken, index, start, held)


def undelivered_at(point: Point, spans: Iterable[Span], rows: Sequence[tuple[int, int]], open_shards: int,
                   seed: Sequence[int]) -> list[tuple[int, int]]:
    """The positions of a plan (``rows``, read as ``spans``) not delivered at ``point``, as
    merged intervals: what the shuffle buffer holds, the rest of the group being read, and
    the rest of the plan."""
    out = [(p, p + 1) for p in point.held]
    end = point.reads
    if point.group_start < point.reads:  # mid-way through a group
        group = next(groups(spans, open_shards, seed, first=point.group))
        cursors = group.cursors(point.reads - point.group_start).tolist()
        out += [(s.position + c, s.position + len(s)) for s, c in zip(group.spans, cursors, strict=True)]
        end = point.group_start + len(group)
    return merge(out + plan_after(rows, end))


def plan_after(rows: Sequence[tuple[int, int]], skip: int) -> list[tuple[int, int]]:
    """The intervals of positions of a plan (``rows``, in order) after its first ``skip``."""
    out = []
    for a, b in rows:
        if skip >= b - a:
            skip -= b - a
            continue
        out.append((a + skip, b))
        skip = 0
    return out
