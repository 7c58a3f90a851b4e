"""The epoch's shard order, as docs/FORMAT.md pins it: every reader of a dataset, streaming
or random access, in any language, draws the same order from (seed, epoch)."""

from __future__ import annotations

import numpy as np


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's shard order: a permutation drawn from (seed, epoch), or manifest order."""
    if not shuffle:
        return np.arange(num_shards)
    return np.random.default_rng([seed, epoch]).permutation(num_shards)
