"""The parts of an object's byte range arriving, each once: whole, or with the error that
stopped it. One range fetched ahead for a reader (``read/fetch.py``'s ``Fetched``) and one
shard fetched into the node's cache (``read/shard_fill.py``) are both read this way: a
reader waits only for the parts that hold the bytes it needs."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable


class Arrivals:
    """Parts of the range ``[bounds[0], end)``, part ``k`` starting at ``bounds[k]``."""

    def __init__(self, bounds: list[int], end: int) -> None:
        self.bounds, self.end = bounds, end
        self._events = [threading.Event() for _ in bounds]
        self.errors: list[BaseException | None] = [None] * len(bounds)

    def __len__(self) -> int:
        return len(self.bounds)

    def arrive(self, k: int, error: BaseException | None = None) -> None:
        """Part ``k`` arrived whole (``error`` None), or will not (its error)."""
        if error is not None:
            self.errors[k] = error
        self._events[k].set()

    def settled(self, k: int) -> bool:
        """Whether part ``k`` has arrived, or failed."""
        return self._events[k].is_set()

    def holding(self, start: int, end: int) -> range:
        """The parts that hold bytes ``[start, end)`` (none for an empty span)."""
        if end <= start:
            return range(0)
        return range(max(0, bisect.bisect_right(self.bounds, start) - 1), bisect.bisect_right(self.bounds, end - 1))

    def stop(self, k: int) -> int:
        """Where part ``k`` ends."""
        return self.bounds[k + 1] if k + 1 < len(self.bounds) else self.end

    def wait(self, k: int, poll: float, check: Callable[[], None]) -> BaseException | None:
        """Block until part ``k`` settles, calling ``check`` (which may raise) every ``poll``
        seconds meanwhile; its error, or None where it arrived whole."""
        while not self._events[k].wait(poll):
            check()
        return self.errors[k]
