"""Storage: one small interface over S3 (boto3 or minio) and local directories."""

from remote_loader.storage.base import DEFAULT_PART_SIZE, ObjectInfo, ObjectWriter, Store
from remote_loader.storage.factory import Location, make_client, open_location, parse_location
from remote_loader.storage.local import LocalStore
from remote_loader.storage.s3_boto3 import Boto3Store
from remote_loader.storage.s3_minio import MinioStore

__all__ = [
    "DEFAULT_PART_SIZE",
    "Boto3Store",
    "LocalStore",
    "Location",
    "MinioStore",
    "ObjectInfo",
    "ObjectWriter",
    "Store",
    "make_client",
    "open_location",
    "parse_location",
]
