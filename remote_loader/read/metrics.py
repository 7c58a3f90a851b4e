"""Counters of one process's loading, safe to update from many threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metrics:
    """Counters of one process's loading; ``as_dict()`` gives a snapshot.

    Attributes:
        gets: GET requests made (ranged parts and indexes), retries included.
        bytes: Bytes received.
        retries: Requests repeated after a transient fault or a failed checksum.
        wait_seconds: Time the consumer waited for storage.
        user_seconds: Time spent in the pipeline's stages (decode, user code).
        samples: Samples produced by the source.
        skipped: Samples skipped by ``on_error="skip"`` (corrupt bytes, a damaged or missing shard).
        peak_buffered: Most bytes of ranges fetched or being fetched and not yet handed
            to the reader (bounded by ``FetchConfig.prefetch_bytes``).
        peak_range_memory: Most bytes of range buffers alive at once: in flight, being
            read, or kept for reuse (see ``FetchConfig`` for the bound).
    """

    gets: int = 0
    bytes: int = 0
    retries: int = 0
    wait_seconds: float = 0.0
    user_seconds: float = 0.0
    samples: int = 0
    skipped: int = 0
    peak_buffered: int = 0
    peak_range_memory: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def peak(self, name: str, value: float) -> None:
        """Raise counter ``name`` to ``value`` if it is higher."""
        with self._lock:
            setattr(self, name, max(getattr(self, name), value))

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __getstate__(self) -> dict[str, Any]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]
