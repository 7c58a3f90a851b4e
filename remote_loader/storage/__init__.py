"""Storage: one interface (``Store``: reads, writes, listing) over S3 (boto3 or minio) and
local directories, and ``RetryingStore``, the retry policy every request goes through."""

from typing import Any

from remote_loader.storage.base import DEFAULT_PART_SIZE, ObjectInfo, ObjectWriter, Store
from remote_loader.storage.factory import (
    Location,
    as_store,
    check_connection,
    make_client,
    open_location,
    parse_location,
)
from remote_loader.storage.local import LocalStore
from remote_loader.storage.s3_boto3 import Boto3Store

__all__ = [
    "DEFAULT_PART_SIZE",
    "Boto3Store",
    "LocalStore",
    "Location",
    "MinioStore",
    "ObjectInfo",
    "ObjectWriter",
    "Store",
    "as_store",
    "make_client",
    "check_connection",
    "open_location",
    "parse_location",
]


def __getattr__(name: str) -> Any:
    if name == "MinioStore":  # the minio SDK is imported only by those who use it
        from remote_loader.storage.s3_minio import MinioStore

        return MinioStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
