"""Counters of loading, safe to update from many threads, readable from the main process.

A ``Metrics`` keeps its counters in a numpy row. ``Metrics.table(rows)`` makes rows in
shared memory before DataLoader workers start: each worker counts in its own row, and the
main process reads the sum of all rows (``Metrics.total``) at any time, during an epoch
or after it, for the cost of adding a few numbers.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

FIELDS = ("gets", "bytes", "retries", "wait_seconds", "user_seconds", "samples", "skipped", "peak_buffered",
          "peak_range_memory", "gets_in_flight", "cached_bytes")
_INDEX = {name: i for i, name in enumerate(FIELDS)}
_SAMPLES = _INDEX["samples"]
_PEAKS = ("peak_buffered", "peak_range_memory", "gets_in_flight")
_FLOATS = ("wait_seconds", "user_seconds")


class Metrics:
    """Counters of loading; attributes read them, ``as_dict()`` gives a snapshot.

    Attributes:
        gets: GET requests made (ranged parts and indexes), retries included.
        bytes: Bytes received.
        retries: Requests repeated after a transient fault or a failed checksum.
        wait_seconds: Time the consumer waited for storage.
        user_seconds: Time spent in the pipeline's stages (decode, user code).
        samples: Samples the pipeline delivered (counted as its items leave it; with
            DataLoader workers, as they reach the DataLoader, which holds up to
            ``prefetch_factor`` items per worker before your loop takes them).
        skipped: Samples skipped by ``on_error="skip"`` (corrupt bytes, a damaged or missing shard, an
            image that does not decode).
        peak_buffered: Most bytes of ranges fetched or being fetched and not yet handed
            to the reader (bounded by ``FetchConfig.prefetch_bytes``).
        peak_range_memory: Most bytes of range buffers alive at once: in flight, being
            read, or kept for reuse (see ``FetchConfig`` for the bound).
        gets_in_flight: The most ranged GETs the fetcher let run at once: it starts low
            and reaches further while the consumer waits for bytes (``Prefetcher``).
        cached_bytes: Bytes read from the node's shard cache (``cache_dir``) instead of the
            store; ``gets`` and ``bytes`` count only what went to the store, fills included.

    Peaks are per process; summed over workers they are the most any one held.
    """

    def __init__(self, row: np.ndarray | None = None, **initial: float) -> None:
        self._row = np.zeros(len(FIELDS), dtype=np.float64) if row is None else row
        self._lock = threading.Lock()
        for name, value in initial.items():
            self._row[_INDEX[name]] = value

    @staticmethod
    def table(rows: int) -> torch.Tensor:
        """Rows of counters in shared memory: make them before DataLoader workers start."""
        import torch  # only datasets make tables: the CLI and uploads need not load torch

        return torch.zeros(rows, len(FIELDS), dtype=torch.float64).share_memory_()

    @classmethod
    def total(cls, table: torch.Tensor) -> Metrics:
        """A snapshot of the sums of a table's rows (the most of any row, for peaks)."""
        values = table.numpy()
        row = values.sum(axis=0)
        for name in _PEAKS:
            row[_INDEX[name]] = values[:, _INDEX[name]].max(initial=0)
        return cls(row.copy())

    def __getattr__(self, name: str) -> Any:
        if name in _INDEX:
            value = float(self._row[_INDEX[name]])
            return value if name in _FLOATS else int(value)
        raise AttributeError(name)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._row[_INDEX[name]] += value

    def count_samples(self, samples: int) -> None:
        """Add to ``samples`` without the lock: only the thread consuming a pipeline counts them."""
        self._row[_SAMPLES] += samples

    def peak(self, name: str, value: float) -> None:
        """Raise counter ``name`` to ``value`` if it is higher."""
        with self._lock:
            index = _INDEX[name]
            self._row[index] = max(self._row[index], value)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIELDS}

    def __repr__(self) -> str:
        return f"Metrics({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"

    def __getstate__(self) -> dict[str, Any]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]
