"""Random access: ``RemoteMapDataset`` gives any sample with one ranged GET (or a batch of
them, merged), and its samplers order an epoch in memory that follows the shards, not the
samples."""

from remote_loader.mapstyle.dataset import RemoteMapDataset
from remote_loader.mapstyle.samplers import LocalitySampler, UniformSampler

__all__ = ["LocalitySampler", "RemoteMapDataset", "UniformSampler"]
