"""remote_loader: train vision models on datasets in S3-compatible object storage."""

from remote_loader.config import FetchConfig, StorageConfig
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
    PreconditionFailed,
    RemoteLoaderError,
    StorageError,
    TransientStorageError,
    UnsupportedVersion,
    UploadConflict,
    UploadError,
)
from remote_loader.pipeline.augment import RandomResizedCrop
from remote_loader.pipeline.dataset import RemoteDataset
from remote_loader.pipeline.mapstyle import RemoteMapDataset
from remote_loader.pipeline.sampler import LocalitySampler
from remote_loader.read import DatasetReader, Metrics
from remote_loader.storage import LocalStore, Store, make_client
from remote_loader.upload import ImageFolder, UploadSummary, upload_cv_dataset

__version__ = "0.1.0"

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
    "FetchConfig",
    "FormatError",
    "ImageFolder",
    "IndexOutOfBounds",
    "InvalidRange",
    "LocalStore",
    "LocalitySampler",
    "Metrics",
    "ObjectNotFound",
    "PreconditionFailed",
    "RandomResizedCrop",
    "RemoteDataset",
    "RemoteLoaderError",
    "RemoteMapDataset",
    "StorageConfig",
    "StorageError",
    "Store",
    "TransientStorageError",
    "UnsupportedVersion",
    "UploadConflict",
    "UploadError",
    "UploadSummary",
    "__version__",
    "make_client",
    "upload_cv_dataset",
]
