"""``LocalitySampler``: random order for a map-style dataset that keeps batches to few shards."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from remote_loader.config import require_int
from remote_loader.pipeline.split import current_world
from remote_loader.pipeline.mapstyle import RemoteMapDataset
from remote_loader.pipeline.split import shard_order


class LocalitySampler(Sampler[int]):
    """Each epoch: shuffle the shards, then shuffle samples within windows of ``window`` shards.

    A batch then draws from about ``window`` shards instead of from ``batch`` shards, so
    ``RemoteMapDataset.__getitems__`` merges its samples into fewer, larger GETs. Larger
    windows mix better and cost more GETs per batch; ``window`` = number of shards is a
    uniform shuffle. The epoch's order is split into equal contiguous parts, one per rank
    (the last part wraps around to the start, repeating fewer than ``world_size`` samples).

    Args:
        shard_sizes: Samples per shard in manifest order (``[s.samples for s in
            ds.reader.manifest.shards]``), or a ``RemoteMapDataset``.
        window: Shards whose samples are mixed together.
        seed: Seed of every epoch's order.
        rank: This rank; default from torch.distributed or ``RANK``.
        world_size: Number of ranks; default from torch.distributed or ``WORLD_SIZE``.
    """

    def __init__(
        self,
        shard_sizes: Sequence[int] | RemoteMapDataset,
        *,
        window: int = 4,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        sizes = shard_sizes.reader.counts if isinstance(shard_sizes, RemoteMapDataset) else list(shard_sizes)
        window = require_int("window", window, 1)
        seed = require_int("seed", seed, 0, 2**63 - 1)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.window, self.seed, self.epoch = window, seed, 0
        self.rank, self.world_size = current_world(rank, world_size)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows."""
        self.epoch = require_int("epoch", epoch, 0)

    def __len__(self) -> int:
        return -(-int(self.sizes.sum()) // self.world_size)

    def order(self) -> np.ndarray:
        """The whole epoch's order of sample indices (before the split across ranks)."""
        rng = np.random.default_rng([self.seed, self.epoch, 1])
        shards = shard_order(len(self.sizes), self.seed, self.epoch)
        parts = []
        for w in range(0, len(shards), self.window):
            group = shards[w : w + self.window]
            indices = np.concatenate([np.arange(self.starts[s], self.starts[s] + self.sizes[s]) for s in group])
            parts.append(rng.permutation(indices))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        per_rank = len(self)
        positions = np.arange(self.rank * per_rank, (self.rank + 1) * per_rank) % max(1, len(order))
        return iter(order[positions].tolist())
