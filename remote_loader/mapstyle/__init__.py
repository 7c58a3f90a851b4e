"""Random access: ``RemoteMapDataset`` gives any sample with one ranged GET (or a batch of
them, merged), and its samplers order an epoch in memory that follows the shards, not the
samples; ``RemoteVideoClips`` gives the clips of a torchvision video class uploaded as its
videos' files."""

from remote_loader.mapstyle.dataset import RemoteMapDataset
from remote_loader.mapstyle.samplers import LocalitySampler, UniformSampler
from remote_loader.mapstyle.video_clips import RemoteVideoClips

__all__ = ["LocalitySampler", "RemoteMapDataset", "RemoteVideoClips", "UniformSampler"]
