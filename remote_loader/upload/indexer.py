"""Index existing WebDataset tar shards in place, so both datasets read them.

Each ``*.tar`` under a prefix is read once, sequentially in ranged parts (bounded
memory): its headers give each member's offset and size, its data each member's crc32.
The index goes to a new object next to the shard (``<shard>.index``) and a manifest lists
the shards; the original objects are never modified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from remote_loader.errors import UploadError
from remote_loader.format import MANIFEST_NAME, Manifest, ShardEntry, ShardTable
from remote_loader.format.checksum import crc32
from remote_loader.format.tar import scan_tar
from remote_loader.storage import Location, Store

INDEX_SUFFIX = ".index"


@dataclass(frozen=True)
class IndexSummary:
    location: Location
    shards: int
    samples: int
    bytes: int


def index_webdataset(
    store: Store, location: Location, *, progress: Callable[[str], object] | None = None
) -> IndexSummary:
    """Index every ``*.tar`` under ``location`` and write a manifest; return what was indexed."""
    prefix = location.key("")
    tars = sorted((info.key[len(prefix):], info.size) for info in store.list(location.bucket, prefix)
                  if info.key.endswith(".tar"))
    if not tars:
        raise UploadError(f"no .tar objects under {location}")
    entries = []
    fields: set[str] = set()
    for name, size in tars:
        key = location.key(name)
        index, crc = scan_tar(partial(store.get_range, location.bucket, key), name, size)
        data = index.encode()
        index_name = name + INDEX_SUFFIX
        store.put(location.bucket, location.key(index_name), data)
        entries.append(ShardEntry(name, len(index), size, 0, len(data), crc32(data), crc, index_name))
        fields.update(index.fields)
        if progress:
            progress(name)
    manifest = Manifest(shards=ShardTable.from_entries(entries), fields=tuple(sorted(fields)), params={"indexed": "webdataset"})
    store.put(location.bucket, location.key(MANIFEST_NAME), manifest.encode())
    return IndexSummary(location, len(entries), manifest.num_samples, manifest.num_bytes)
