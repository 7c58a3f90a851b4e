"""Sets of sample positions as sorted, merged intervals ``(start, stop)``."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged union of intervals (in numpy: a state asks for a thousand at each step)."""
    pairs = np.array([x for x in intervals if x[0] < x[1]], dtype=np.int64).reshape(-1, 2)
    if len(pairs) < 2:
        return [(int(a), int(b)) for a, b in pairs.tolist()]
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    reach = np.maximum.accumulate(pairs[:, 1])
    first = np.flatnonzero(np.concatenate(([True], pairs[1:, 0] > reach[:-1])))
    return list(zip(pairs[first, 0].tolist(), np.maximum.reduceat(pairs[:, 1], first).tolist(), strict=True))


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
    """Whether ``p`` lies in one of ``intervals`` (sorted, disjoint)."""
    k = int(np.searchsorted([a for a, _ in intervals], p, side="right")) - 1
    return k >= 0 and intervals[k][0] <= p < intervals[k][1]
