"""The epoch's shard order, as docs/FORMAT.md pins it: every reader of a dataset, streaming
or random access, in any language, draws the same order from (seed, epoch)."""

from __future__ import annotations

from functools import partial

import numpy as np

from remote_loader.format.shard_counts import Counts, block_totals
from remote_loader.kept import Kept


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's shard order: a permutation drawn from (seed, epoch), or manifest order."""
    if not shuffle:
        return np.arange(num_shards)
    return np.random.default_rng([seed, epoch]).permutation(num_shards)


def block_shards(block: int, rows: int, num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Block ``block``'s shards (``[block * rows, (block + 1) * rows)``, the last block shorter)
    in the epoch's order of a manifest read by pages (version 3): a permutation drawn from
    (seed, epoch, 1, block), or manifest order. The blocks themselves follow
    ``shard_order(number of blocks, seed, epoch, shuffle)``."""
    first = block * rows
    size = min(rows, num_shards - first)
    if not shuffle:
        return np.arange(first, first + size)
    return first + np.random.default_rng([seed, epoch, 1, block]).permutation(size)


class EpochOrder:
    """One epoch's shard order, as blocks: the order of the blocks, and each block's shards in
    order, made when a block is first asked for and kept for the next few.

    A manifest read by pages (version 3) is ordered in blocks of its page's rows: the blocks
    in ``shard_order(blocks, seed, epoch)``, each block's shards in ``block_shards``'s order,
    so a rank's share is a run of blocks and it reads the pages of those blocks only. Versions
    1 and 2 are one block of every shard in ``shard_order(shards, seed, epoch)``: the order
    saved states were taken with.
    """

    def __init__(self, counts: Counts, rows: int | None, seed: int, epoch: int, shuffle: bool) -> None:
        n = len(counts)
        self.counts, self.seed, self.epoch, self.shuffle = counts, seed, epoch, shuffle
        self.whole = rows is None
        self.rows = max(n, 1) if rows is None else rows
        blocks = -(-n // self.rows)
        self.blocks = np.arange(blocks) if self.whole else shard_order(blocks, seed, epoch, shuffle)
        self.sizes = block_totals(counts, self.rows)[self.blocks]
        self.ends = np.cumsum(self.sizes)  # the position past each block, in the epoch's order
        self.total = int(self.ends[-1]) if blocks else 0
        self._index_type = np.int32 if n < 2**31 else np.int64
        self._made: Kept[int, tuple[np.ndarray, np.ndarray]] = Kept(self.kept_blocks)

    kept_blocks = 4
    """Blocks whose order is kept once made (the iteration goes block after block)."""

    def block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k``-th block of the epoch: its shards in order, and the position past each."""
        return self._made.get(k, partial(self._block, k))

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        n, b = len(self.counts), int(self.blocks[k])
        if self.whole:
            shards = shard_order(n, self.seed, self.epoch, self.shuffle)
        else:
            shards = block_shards(b, self.rows, n, self.seed, self.epoch, self.shuffle)
        shards = shards.astype(self._index_type)
        ends = int(self.ends[k] - self.sizes[k]) + np.cumsum(self.counts.take(shards))
        return shards, ends

    def pieces(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """Positions ``[first, last)`` as pieces within one block each: (the block's place ``k``
        in the epoch's order, and the piece's first and last position)."""
        if first >= last:
            return []
        k0, k1 = (int(k) for k in np.searchsorted(self.ends, [first, last - 1], side="right"))
        return [(k, max(first, int(self.ends[k] - self.sizes[k])), min(last, int(self.ends[k])))
                for k in range(k0, k1 + 1)]

    def piece(self, k: int, first: int, last: int) -> tuple[np.ndarray, int, int, int]:
        """A piece made: (the shards holding positions ``[first, last)`` of block ``k``, in
        order; the position where the first of them begins; ``first``; ``last``)."""
        shards, ends = self.block(k)
        i, j = (int(x) for x in np.searchsorted(ends, [first, last - 1], side="right"))
        begin = int(ends[i]) - int(self.counts.take(shards[i : i + 1])[0])
        return shards[i : j + 1].copy(), begin, first, last

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard (its number in the manifest) and the sample in it at each of ``positions``."""
        positions = np.asarray(positions, dtype=np.int64)
        blocks = np.searchsorted(self.ends, positions, side="right")
        shards = np.empty(len(positions), dtype=np.int64)
        samples = np.empty(len(positions), dtype=np.int64)
        for k in np.unique(blocks).tolist():
            chosen = blocks == k
            order, ends = self.block(k)
            i = np.searchsorted(ends, positions[chosen], side="right")
            shards[chosen] = order[i]
            samples[chosen] = positions[chosen] - (ends[i] - self.counts.take(order[i]))
        return shards, samples
