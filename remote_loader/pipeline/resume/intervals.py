"""Sets of sample positions as sorted, merged intervals ``(start, stop)``."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

import numpy as np


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged union of intervals."""
    out: list[list[int]] = []
    for a, b in sorted((a, b) for a, b in intervals if a < b):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted positions as intervals of consecutive ones."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and p == out[-1][1]:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]


def without(intervals: list[tuple[int, int]], points: Iterable[int]) -> list[tuple[int, int]]:
    """``intervals`` (sorted, disjoint) less ``points``."""
    out = list(intervals)
    for p in sorted(set(points)):
        starts = [a for a, _ in out]
        k = int(np.searchsorted(starts, p, side="right")) - 1
        if k >= 0 and out[k][0] <= p < out[k][1]:
            a, b = out[k]
            out[k : k + 1] = [x for x in ((a, p), (p + 1, b)) if x[0] < x[1]]
    return out


def contains(intervals: list[tuple[int, int]], p: int) -> bool:
    k = int(np.searchsorted([a for a, _ in intervals], p, side="right")) - 1
    return k >= 0 and intervals[k][0] <= p < intervals[k][1]


class PositionSet:
    """A growing set of positions as sorted, disjoint intervals, to which positions are added
    one or a run at a time: cheap when they arrive roughly in order, as a worker's deliveries
    do (its size follows the holes a shuffle buffer leaves, not the positions added)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []

    def add(self, start: int, stop: int) -> None:
        """Add positions ``[start, stop)``, merging with the intervals they overlap or touch."""
        if start >= stop:
            return
        first = bisect_left(self._stops, start)  # the first interval ending at or after ``start``
        last = bisect_right(self._starts, stop)  # past the last one starting at or before ``stop``
        if first < last:
            start, stop = min(start, self._starts[first]), max(stop, self._stops[last - 1])
        self._starts[first:last] = [start]
        self._stops[first:last] = [stop]

    def complement(self, intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``intervals`` (sorted, disjoint) less this set."""
        out = []
        for a, b in intervals:
            k = bisect_right(self._stops, a)  # the intervals ending after ``a`` may cut [a, b)
            while a < b:
                if k >= len(self._starts) or self._starts[k] >= b:
                    out.append((a, b))
                    break
                if self._starts[k] > a:
                    out.append((a, self._starts[k]))
                a = max(a, self._stops[k])
                k += 1
        return out
