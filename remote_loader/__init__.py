"""remote_loader: train vision models on datasets in S3-compatible object storage."""

from typing import TYPE_CHECKING, Any

from remote_loader.config import CacheConfig, FetchConfig, RetryConfig, StorageConfig, rank_cores
from remote_loader.errors import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    CorruptSampleError,
    CorruptShard,
    DatasetChanged,
    DatasetNotFound,
    DecodeError,
    EndpointUnreachable,
    FormatError,
    IndexOutOfBounds,
    InvalidRange,
    ObjectNotFound,
    OnError,
    PreconditionFailed,
    RemoteLoaderError,
    ResumeError,
    StorageError,
    TransientStorageError,
    TruncatedShard,
    UnsupportedVersion,
    UploadConflict,
    UploadError,
)
from remote_loader.read import DatasetReader, Metrics
from remote_loader.storage import LocalStore, Store, make_client
from remote_loader.upload import ImageFolder, UploadSummary, VideoFolder, upload_cv_dataset

if TYPE_CHECKING:
    from remote_loader.mapstyle.dataset import RemoteMapDataset
    from remote_loader.mapstyle.samplers import LocalitySampler, UniformSampler
    from remote_loader.mapstyle.video_clips import RemoteVideoClips
    from remote_loader.pipeline.dataset import RemoteDataset
    from remote_loader.pipeline.run.loader import decode_batches, loader
    from remote_loader.pipeline.stages.augment import RandomResizedCrop
    from remote_loader.pipeline.stages.collate import collate
    from remote_loader.pipeline.stages.restore import restore
    from remote_loader.pipeline.stages.video import VideoClip

__version__ = "0.1.0"

# The datasets need torch, which takes about a second to import: they load on first use, so
# the command line and uploads start at once.
_LAZY = {
    "RandomResizedCrop": "remote_loader.pipeline.stages.augment",
    "VideoClip": "remote_loader.pipeline.stages.video",
    "RemoteDataset": "remote_loader.pipeline.dataset",
    "loader": "remote_loader.pipeline.run.loader",
    "decode_batches": "remote_loader.pipeline.run.loader",
    "restore": "remote_loader.pipeline.stages.restore",
    "collate": "remote_loader.pipeline.stages.collate",
    "RemoteMapDataset": "remote_loader.mapstyle",
    "LocalitySampler": "remote_loader.mapstyle",
    "UniformSampler": "remote_loader.mapstyle",
    "RemoteVideoClips": "remote_loader.mapstyle",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'remote_loader' has no attribute {name!r}")

__all__ = [
    "AccessDenied",
    "BucketNotFound",
    "ConfigError",
    "CorruptSampleError",
    "CorruptShard",
    "DatasetChanged",
    "DatasetNotFound",
    "DatasetReader",
    "DecodeError",
    "EndpointUnreachable",
    "CacheConfig",
    "FetchConfig",
    "FormatError",
    "ImageFolder",
    "IndexOutOfBounds",
    "InvalidRange",
    "LocalStore",
    "LocalitySampler",
    "Metrics",
    "ObjectNotFound",
    "OnError",
    "PreconditionFailed",
    "RandomResizedCrop",
    "RemoteDataset",
    "RemoteLoaderError",
    "ResumeError",
    "RetryConfig",
    "RemoteMapDataset",
    "RemoteVideoClips",
    "StorageConfig",
    "StorageError",
    "Store",
    "TransientStorageError",
    "TruncatedShard",
    "UnsupportedVersion",
    "UploadConflict",
    "UploadError",
    "UniformSampler",
    "VideoClip",
    "VideoFolder",
    "UploadSummary",
    "__version__",
    "collate",
    "decode_batches",
    "loader",
    "make_client",
    "rank_cores",
    "restore",
    "upload_cv_dataset",
]
