"""The shard, index and manifest format: pure encoding and decoding, no I/O."""

from remote_loader.format.index import INDEX_MEMBER, INDEX_VERSION, ShardIndex
from remote_loader.format.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    UPLOAD_STATE,
    Manifest,
    ShardEntry,
    ShardTable,
)
from remote_loader.format.shard import Sample, ShardSummary, ShardView, ShardWriter, check_key

__all__ = [
    "INDEX_MEMBER",
    "INDEX_VERSION",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "Sample",
    "ShardEntry",
    "ShardIndex",
    "ShardSummary",
    "ShardTable",
    "ShardView",
    "ShardWriter",
    "UPLOAD_STATE",
    "check_key",
]
