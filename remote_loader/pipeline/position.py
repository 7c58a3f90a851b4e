"""Checkpoints by position: what of one worker's epoch is not yet delivered, and how the
rest of an epoch stopped on R ranks x W workers is divided among R' x W'.

Every sample of an epoch has a position, its place in the epoch's virtual sequence (the
shards in the epoch's order; see ``split.py``). A worker reads a *plan*: intervals of
positions, in order. Under ``equalize`` the sequence wraps, so a few reads repeat samples
another worker reads first; those positions are the plan's *extras*.

While a worker iterates, its ``Progress`` knows where every undelivered sample is: in the
rest of the plan not yet cut into ranges, in ranges cut but not yet opened, in the open
ranges after their read position, or emitted by the source and not yet out of the
pipeline (in the shuffle buffer, a stage's threads or a partial batch). Its state lists
those as merged intervals, so its size grows with ``open_shards`` and the shuffle buffer,
never with the dataset.

The states of every worker of every rank together give the rest of the epoch (gathered
in ``states.py``): the union of what each has not delivered, less the samples whose extra
read was delivered. That set, in position order, is divided among the new ranks and
workers as an epoch's sequence is. A state also records its run, so that the worker
itself can replay it exactly (``replay.py``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from remote_loader.pipeline.intervals import contains, merge, runs, without
from remote_loader.pipeline.replay import Record, Replay
from remote_loader.pipeline.split import laps

STATE_VERSION = 2
MARK = "remote_loader_state"
"""The key that marks a worker's position state (its value is the state's version)."""


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


class Progress:
    """Where one worker's iteration stands. The cutter (on the prefetcher's thread) reports
    what it took from the plan and cut into ranges; the source, on the consumer's thread,
    reports the ranges it opens and the samples it emits; the pipeline's end, the samples
    delivered or dropped."""

    def __init__(self, plan: Plan, header: dict[str, Any], replay: Replay | None = None, recorded: bool = True) -> None:
        self.plan, self.header = plan, header
        self.replay = replay  # a replayed run (replay.py); its state is the loaded one until the replay ends
        self.replaying = replay is not None
        self.recorded = recorded  # whether states record the run for a replay (not after a count-based skip)
        self._lock = threading.Lock()
        self._taken = 0  # samples of the plan the cutter took
        self._cut: deque[tuple[int, int]] = deque()  # (position, samples) of ranges cut, not yet opened
        self._open: dict[Any, int] = {}  # open range -> position of its sample 0
        self._pending: set[int] = set()  # emitted by the source, not yet delivered
        self._passing: deque[Any] = deque()  # ids past the replay point, not yet finished
        self._items = 0  # items finished past the replay point
        self._skips: list[tuple[int, int, bool]] = []  # (position, samples, at_open) skipped under on_error="skip"

    def took(self, samples: int, ranges: Sequence[tuple[int, int]]) -> None:
        """The cutter took ``samples`` of the plan and cut them into ``ranges`` ``(position, samples)``."""
        with self._lock:
            self._cut.extend(ranges)
            self._taken += samples

    def opening(self) -> int:
        """The position of the first sample of the next range cut, which the source opens now."""
        with self._lock:
            return self._cut.popleft()[0]

    def opened(self, reading: Any, base: int) -> None:
        """The source opened a range (any object with ``next`` and ``stop`` sample numbers)
        whose sample 0 is at position ``base``."""
        self._open[reading] = base

    def position(self, reading: Any) -> int:
        """The position of the sample an open range gave last."""
        return self._open[reading] + reading.next - 1

    def next_position(self, reading: Any) -> int:
        """The position of the sample an open range gives next."""
        return self._open[reading] + reading.next

    def skipped(self, position: int, samples: int, at_open: bool = False) -> None:
        """The source skipped ``samples`` from ``position`` (a whole range when it opened)."""
        self._skips.append((position, samples, at_open))

    def closed(self, reading: Any) -> None:
        """The source read a range to its end."""
        self._open.pop(reading, None)

    def emitted(self, position: int) -> None:
        """The source gave the pipeline the sample at ``position``."""
        self._pending.add(position)

    def passed(self, ids: Any) -> None:
        """An item passed the replay point (the end of the last shuffle or batched)."""
        self._passing.append(ids)

    def finished(self) -> None:
        """An item finished at the replay point (a replay dropped it there)."""
        self._items += 1

    def done(self, ids: int | list[Any]) -> None:
        """Samples delivered (or dropped by a stage): an item's id, or a batch's ids."""
        if self._passing and self._passing[0] == ids:  # items past the replay point finish in order
            self._passing.popleft()
            self._items += 1
        self._discard(ids)

    def _discard(self, ids: int | list[Any]) -> None:
        if isinstance(ids, int):
            self._pending.discard(ids)
        else:
            for i in ids:
                self._discard(i)

    def remaining(self) -> list[tuple[int, int]]:
        """Positions of the plan not yet delivered, as sorted merged intervals."""
        with self._lock:
            cut = list(self._cut)
            taken = self._taken
        parts = list(_rest(self.plan.rows, taken))
        parts += [(p, p + n) for p, n in cut]
        parts += [(base + r.next, base + r.stop) for r, base in self._open.items()]
        parts += runs(self._pending)
        return merge(parts)

    def state(self) -> dict[str, Any]:
        if self.replay is not None and self.replaying:  # nothing new delivered yet: the state loaded
            return encode(self.header, self.replay.undelivered, self.plan.extras, self.replay.record)
        record = Record(self.plan.rows, self._items, tuple(self._skips)) if self.recorded else None
        return encode(self.header, self.remaining(), self.plan.extras, record)


def _rest(rows: Sequence[tuple[int, int]], taken: int) -> Iterable[tuple[int, int]]:
    for a, b in rows:
        if taken >= b - a:
            taken -= b - a
            continue
        yield a + taken, b
        taken = 0


def encode(header: dict[str, Any], remaining: list[tuple[int, int]], extras: Iterable[int],
           record: Record | None = None) -> dict[str, Any]:
    """A worker's state: its header, the positions it has not delivered, its extras apart
    (each with whether it was delivered), and the record of its run (``replay.py``)."""
    extras = sorted(extras)
    flags = [0 if contains(remaining, e) else 1 for e in extras]
    kept = without(remaining, extras)
    return {MARK: STATE_VERSION, **header,
            "remaining": [x for interval in kept for x in interval],
            "extras": [x for pair in zip(extras, flags) for x in pair],
            **(record.encode() if record is not None else {})}
