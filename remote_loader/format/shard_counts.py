"""Samples per shard, as the split and lookups ask for them: ``RunCounts`` keeps runs of equal
counts (a manifest of version 3 stores them so: full shards make one run per upload task),
``ArrayCounts`` one value per shard (versions 1 and 2). Either answers without building an
array over every shard where runs suffice: the counts of some shards, the totals of blocks
of shards, and which shard holds a sample."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Counts(Protocol):
    """Samples per shard, shard ``i`` in manifest order."""

    def __len__(self) -> int: ...

    @property
    def total(self) -> int:
        """Samples in all shards."""

    def take(self, shards: np.ndarray) -> np.ndarray:
        """The counts of ``shards`` (manifest numbers), as int64."""

    def prefix(self, shards: np.ndarray) -> np.ndarray:
        """Samples in shards ``[0, s)`` for each ``s`` of ``shards`` (each in ``[0, len]``)."""

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard holding each of ``samples`` (in manifest order), and the sample's place in it."""


def block_totals(counts: Counts, rows: int) -> np.ndarray:
    """Samples in each block of ``rows`` shards: shards ``[b * rows, (b + 1) * rows)``, the last one shorter."""
    n = len(counts)
    if 0 < n <= rows:  # one block: no running sum over every shard (one count per shard holds it apart)
        return np.array([counts.total], dtype=np.int64)
    edges = np.minimum(np.arange(0, n + rows, rows, dtype=np.int64), n) if n else np.zeros(1, dtype=np.int64)
    return np.diff(counts.prefix(edges))


class ArrayCounts:
    """One count per shard (a manifest of version 1 or 2)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values.astype(np.int64)
        self._starts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.values)

    def __getstate__(self) -> dict[str, object]:
        return {"values": self.values, "_starts": None}

    @property
    def starts(self) -> np.ndarray:
        """Samples before each shard, and the total last (``len + 1`` values), made on first use."""
        if self._starts is None:
            self._starts = np.concatenate([[0], np.cumsum(self.values)])
        return self._starts

    @property
    def total(self) -> int:
        return int(self.values.sum())

    def take(self, shards: np.ndarray) -> np.ndarray:
        return self.values[shards]

    def prefix(self, shards: np.ndarray) -> np.ndarray:
        return self.starts[np.asarray(shards, dtype=np.int64)]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shards = np.searchsorted(self.starts, samples, side="right") - 1
        return shards, samples - self.starts[shards]


class RunCounts:
    """Runs of equal counts: ``lengths[r]`` shards of ``values[r]`` samples each, one run
    after another (a manifest of version 3). Memory follows the runs, not the shards."""

    def __init__(self, values: np.ndarray, lengths: np.ndarray) -> None:
        self.values = values.astype(np.int64)
        self.lengths = lengths.astype(np.int64)
        self.shard_ends = np.cumsum(self.lengths)  # shard number past each run
        self.sample_ends = np.cumsum(self.values * self.lengths)  # sample number past each run

    @classmethod
    def of(cls, counts: np.ndarray) -> RunCounts:
        """The runs of one count per shard."""
        counts = np.asarray(counts, dtype=np.int64)
        if not len(counts):
            return cls(counts, counts)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(counts)) + 1])
        return cls(counts[starts], np.diff(np.concatenate([starts, [len(counts)]])))

    def __len__(self) -> int:
        return int(self.shard_ends[-1]) if len(self.shard_ends) else 0

    @property
    def total(self) -> int:
        return int(self.sample_ends[-1]) if len(self.sample_ends) else 0

    def _run(self, shards: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.shard_ends, shards, side="right")

    def take(self, shards: np.ndarray) -> np.ndarray:
        return self.values[self._run(shards)]

    def prefix(self, shards: np.ndarray) -> np.ndarray:
        shards = np.asarray(shards, dtype=np.int64)
        run = np.minimum(self._run(shards), max(len(self.values) - 1, 0))
        if not len(self.values):
            return np.zeros(len(shards), dtype=np.int64)
        first_shard = self.shard_ends[run] - self.lengths[run]
        first_sample = self.sample_ends[run] - self.values[run] * self.lengths[run]
        return first_sample + (shards - first_shard) * self.values[run]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        run = np.searchsorted(self.sample_ends, samples, side="right")
        inside = samples - (self.sample_ends[run] - self.values[run] * self.lengths[run])
        first_shard = self.shard_ends[run] - self.lengths[run]
        return first_shard + inside // self.values[run], inside % self.values[run]
