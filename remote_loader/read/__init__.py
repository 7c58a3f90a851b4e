"""The read path: requests through a retrying store, ranged-GET prefetch under a byte
budget, shard indexes and their cache, checksum refetch, and metrics."""

from remote_loader.read.fetch import Fetched, Job, Prefetcher
from remote_loader.read.metrics import Metrics
from remote_loader.read.reader import DatasetReader, ShardReport
from remote_loader.read.session import ReadSession

__all__ = ["DatasetReader", "Fetched", "Job", "Metrics", "Prefetcher", "ReadSession", "ShardReport"]
