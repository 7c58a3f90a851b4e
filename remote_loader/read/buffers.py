"""Memory of the prefetcher: range buffers kept for reuse."""

from __future__ import annotations

import threading

import numpy as np

from remote_loader.read.metrics import Metrics

_ROUND = 1 << 20  # range buffers are allocated in MiB steps, so they fit later ranges


class Buffers:
    """Range buffers kept for reuse, ``keep`` at most (``FetchConfig.free_ranges``): fresh
    memory costs a page fault per 4 KiB on first write.

    New buffers are uninitialised numpy arrays: a bytearray would be zeroed first, holding
    the GIL; an empty array takes its page faults in the socket reads, which release it.
    """

    def __init__(self, metrics: Metrics, keep: int) -> None:
        self.keep, self.metrics = keep, metrics
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._live = 0  # bytes of buffers allocated and not dropped: in flight, being read, or kept

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= size]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        buffer = np.empty(-(-size // _ROUND) * _ROUND, dtype=np.uint8)
        with self._lock:
            self._live += len(buffer)
            self.metrics.peak("peak_range_memory", self._live)
        return buffer

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)
            else:
                self._live -= len(buffer)


