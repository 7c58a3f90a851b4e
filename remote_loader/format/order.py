"""The epoch's shard order, as docs/FORMAT.md pins it: every reader of a dataset, streaming
or random access, in any language, draws the same order from (seed, epoch)."""

from __future__ import annotations

import numpy as np


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
