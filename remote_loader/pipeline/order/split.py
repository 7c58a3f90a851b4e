"""Which samples each rank and DataLoader worker reads in an epoch (pure, no I/O).

The epoch's shard order is drawn from (seed, epoch): a permutation of blocks of shards, each
block's shards permuted (``EpochOrder``). The shards, in that order, form one virtual
sequence of samples; ranks take contiguous ranges of it, and each
rank's workers take contiguous ranges of the rank's range. Ranges cut shards only at their
ends, so shards stay whole reads except at most one cut per boundary, and any number of
ranks x workers works, even more than there are shards.

Equalising (``equalize=True``): every rank gets ``ceil(N / world_size)`` samples; the
sequence wraps around, so the last ranks repeat the first ``(-N) % world_size`` samples
of the epoch's order. Without it, every sample is read exactly once and rank sizes differ
by at most one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from remote_loader.errors import ConfigError
from remote_loader.format.epoch_order import EpochOrder
from remote_loader.format.shard_counts import Counts


@dataclass(frozen=True)
class Span:
    """Samples ``[start, end)`` of shard ``shard`` (its position in the manifest); sample
    ``start`` sits at ``position`` in the epoch's virtual sequence."""

    shard: int
    start: int
    end: int
    position: int = 0

    def __len__(self) -> int:
        return self.end - self.start



class EpochOrders:
    """The last epoch's order asked for, kept.

    The main process asks when a dataset is made and at ``set_epoch``, so the DataLoader
    workers it forks next share those pages instead of each permuting every shard (at 1M
    shards of a version 2 manifest: ~20 ms and ~7 MB per worker). Not pickled: a spawned
    worker makes its own.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple[int, int | None, int, int, bool], EpochOrder] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_last": None}

    def prepare(self, counts: Counts, rows: int | None, seed: int, epoch: int, shuffle: bool) -> None:
        """Make ``epoch``'s order now and keep it: in the main process, before the DataLoader
        workers that read it fork (one whole block of a version 2 manifest made too)."""
        order = self.get(counts, rows, seed, epoch, shuffle)
        if order.whole and len(order.blocks):
            order.block(0)

    def get(self, counts: Counts, rows: int | None, seed: int, epoch: int, shuffle: bool,
            keep: bool = True) -> EpochOrder:
        """``epoch``'s order; kept for the next call unless ``keep`` is false (a worker reads each epoch once)."""
        key = (len(counts), rows, seed, epoch, shuffle)
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        order = EpochOrder(counts, rows, seed, epoch, shuffle)
        if keep:
            self._last = key, order
        return order


def laps(total: int, start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of a sequence of ``total`` that wraps around, as
    intervals of ``[0, total)``: the first is the primary read, any further ones repeat."""
    out = []
    while start < stop:
        first = start % total
        last = min(first + stop - start, total)
        out.append((first, last))
        start += last - first
    return out


class PlanSpans:
    """Spans covering the intervals ``rows`` of the virtual sequence, in that order, made
    anew at each iteration. Of one block of every shard (versions 1 and 2) only the order of
    the shards in the rows is kept (4 bytes a shard), so a worker's share of a million shards
    costs one small array, not an object per shard; of blocks (version 3), only which part of
    which block, each block's order made again as the iteration reaches it."""

    def __init__(self, order: EpochOrder, rows: Sequence[tuple[int, int]]) -> None:
        self.order, self.counts = order, order.counts
        pieces = [piece for first, last in rows for piece in order.pieces(first, last)]
        self.kept = [order.piece(*piece) for piece in pieces] if order.whole else None
        self.pieces = pieces

    def __iter__(self) -> Iterator[Span]:
        made = self.kept if self.kept is not None else (self.order.piece(*piece) for piece in self.pieces)
        return _lap_spans(self.counts, made)


_CHUNK = 4096


def _lap_spans(counts: Counts, kept: Iterable[tuple[np.ndarray, int, int, int]]) -> Iterator[Span]:
    """``kept``: (shards in order, position where the first begins, first and last position read)."""
    for shards, begin, first, last in kept:
        for k in range(0, len(shards), _CHUNK):
            chunk = shards[k : k + _CHUNK]
            sizes = counts.take(chunk)
            ends = (begin + np.cumsum(sizes)).tolist()
            for shard, size, end in zip(chunk.tolist(), sizes.tolist(), ends, strict=True):
                start = end - size
                low = max(first, start)
                yield Span(shard, low - start, min(last, end) - start, low)
            begin = ends[-1]


@dataclass(frozen=True)
class Plan:
    """What one worker reads: intervals ``rows`` of positions in order; ``extras`` are the
    positions it reads as repeats; ``run`` names the sequence divided (0: a whole epoch,
    else a checksum of the remainder resumed)."""

    rows: tuple[tuple[int, int], ...]
    extras: frozenset[int]
    run: int = 0


def divide(starts: np.ndarray, stops: np.ndarray, low: int, high: int, run: int = 0) -> Plan:
    """The plan reading positions ``[low, high)`` of the sequence made of the intervals
    ``[starts[i], stops[i])`` in order, wrapping around past its end."""
    ends = np.cumsum(stops - starts)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0 or low >= high:
        return Plan((), frozenset(), run)
    rows: list[tuple[int, int]] = []
    extras: set[int] = set()
    occurrence = low
    for first, last in laps(total, low, high):
        pieces = _pieces(starts, stops, ends, first, last)
        rows.extend(pieces)
        if occurrence >= total:  # a repeat: fewer than world_size samples in all
            extras.update(p for a, b in pieces for p in range(a, b))
        occurrence += last - first
    return Plan(tuple(rows), frozenset(extras), run)


def _pieces(starts: np.ndarray, stops: np.ndarray, ends: np.ndarray, first: int, last: int) -> list[tuple[int, int]]:
    """Positions of items ``[first, last)`` of the sequence of intervals (``ends``: their cumulative sizes)."""
    i, j = (int(k) for k in np.searchsorted(ends, [first, last - 1], side="right"))
    out = []
    for k in range(i, j + 1):
        begin = int(ends[k]) - int(stops[k] - starts[k])  # sequence index of the interval's first position
        a, b = max(first, begin), min(last, int(ends[k]))
        out.append((int(starts[k]) + a - begin, int(starts[k]) + b - begin))
    return out


def _bounds(total: int, parts: int, part: int) -> tuple[int, int]:
    return total * part // parts, total * (part + 1) // parts


def worker_bounds(total: int, *, rank: int, world_size: int, worker: int, num_workers: int,
                  equalize: bool, align: int = 1) -> tuple[int, int]:
    """Positions ``[low, high)`` of the epoch's virtual sequence that a worker reads (``high``
    may pass ``total`` when equalising: the sequence wraps around).

    With ``align``, every worker's share but the rank's last is a multiple of it: a
    pipeline that batches by ``align`` then yields as many batches whatever the number of
    workers, so its ``len()`` holds."""
    if not 0 <= rank < world_size or not 0 <= worker < num_workers:
        raise ConfigError(f"need 0 <= rank < world_size and 0 <= worker < num_workers; got {rank}/{world_size},"
                          f" {worker}/{num_workers}")
    if total == 0:
        return 0, 0
    if equalize:
        per_rank = -(-total // world_size)
        rank_start, rank_stop = rank * per_rank, (rank + 1) * per_rank
    else:
        rank_start, rank_stop = _bounds(total, world_size, rank)
    size = rank_stop - rank_start
    units = -(-size // align)
    low, high = _bounds(units, num_workers, worker)
    return rank_start + min(low * align, size), rank_start + min(high * align, size)


def rank_size(total: int, rank: int, world_size: int, equalize: bool) -> int:
    """Samples rank ``rank`` reads per epoch."""
    if equalize:
        return -(-total // world_size)
    low, high = _bounds(total, world_size, rank)
    return high - low
