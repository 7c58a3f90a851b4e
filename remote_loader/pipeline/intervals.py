"""Sets of sample positions as sorted, merged intervals ``(start, stop)``."""

from __future__ import annotations

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
