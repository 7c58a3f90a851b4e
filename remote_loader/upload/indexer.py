"""Index existing WebDataset tar shards in place, so both datasets read them.

Each ``*.tar`` under a prefix is read once, sequentially in ranged parts (bounded
memory): its headers give each member's offset and size, its data each member's crc32.
The index goes to a new object next to the shard (``<shard>.index``) and a manifest lists
the shards; the original objects are never modified.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from remote_loader.checksum import crc32
from remote_loader.config import RetryConfig
from remote_loader.errors import PreconditionFailed, UploadConflict, UploadError
from remote_loader.format import MANIFEST_NAME, Manifest, ShardEntry, ShardIndex, ShardTable
from remote_loader.format.index import MAX_FIELDS
from remote_loader.format.manifest import datasets_inside
from remote_loader.format.names import valid_shard_name
from remote_loader.format.tar import COMPRESSED_TARS, scan_tar
from remote_loader.storage import Location, Store
from remote_loader.storage.retrying import Retry, RetryingStore
from remote_loader.upload.claim import read_versioned

INDEX_SUFFIX = ".index"

log = logging.getLogger("remote_loader")


@dataclass(frozen=True)
class IndexSummary:
    """What ``index_webdataset`` indexed.

    Attributes:
        location: The prefix.
        shards: The ``.tar`` objects indexed.
        samples: Their samples.
        bytes: Their bytes.
        left_out: The compressed tars under the prefix (``COMPRESSED_TARS``), not indexed.
    """

    location: Location
    shards: int
    samples: int
    bytes: int
    left_out: tuple[str, ...] = ()


def index_webdataset(
    store: Store, location: Location, *, progress: Callable[[str], object] | None = None, force: bool = False,
    retry: RetryConfig | None = None,
) -> IndexSummary:
    """Index every ``*.tar`` under ``location`` and write a manifest; return what was indexed.

    Compressed tars under ``location`` (``.tar.gz``, ``.tgz``...) are left out: a warning on
    the ``remote_loader`` logger and the summary's ``left_out`` name them.

    Args:
        store: The store.
        location: The prefix holding the tars.
        progress: Called with each shard's name once it is indexed.
        force: Replace the manifest of a dataset that ``upload_cv_dataset`` wrote (it would
            lose the upload's parameters, id and class names); refused without it.
        retry: How every request is retried.
    """
    store = RetryingStore(store, Retry(retry or RetryConfig(), store))
    manifest_key = location.key(MANIFEST_NAME)
    found = read_versioned(store, location.bucket, manifest_key)
    existing = None if found is None else Manifest.decode(found[0], name=manifest_key)
    tag = None if found is None else found[1]
    if existing is not None and existing.params.get("upload_id") and not force:
        raise UploadError(
            f"{location} holds a dataset uploaded by remote_loader (upload {existing.params['upload_id']});"
            " indexing it would replace its manifest and drop its parameters and class names:"
            " pass force=True (--force) to do it anyway"
        )
    tars, left_out = _tars(store, location)
    entries = []
    fields: set[str] = set()
    for name, size in tars:
        entry, index = _index_tar(store, location, name, size)
        entries.append(entry)
        fields.update(index.fields)
        if progress:
            progress(name)
    # Version 2: tars indexed in place keep their own names and index objects, which version 3's
    # template and in-shard indexes do not hold.
    manifest = Manifest(
        shards=ShardTable.from_entries(entries), fields=tuple(sorted(fields)), params={"indexed": "webdataset"},
        version=2,
    )
    body = manifest.encode()
    try:  # only over the manifest read above: an upload that finished meanwhile is not replaced
        store.put(location.bucket, manifest_key, body, if_none_match=tag is None, if_match=tag)
    except PreconditionFailed:
        raise UploadConflict(
            f"the manifest at {location} changed while it was being indexed; index it again", location=str(location)
        ) from None
    return IndexSummary(location, len(entries), manifest.num_samples, manifest.num_bytes, left_out)


def _tars(store: Store, location: Location) -> tuple[list[tuple[str, int]], tuple[str, ...]]:
    """``(name, size)`` of the ``.tar`` objects under ``location`` in name order, and the names
    of the compressed tars left out (logged); UploadError where there is nothing to index."""
    prefix = location.key("")
    listing = list(store.list(location.bucket, prefix))
    inside = datasets_inside((info.key for info in listing), prefix)
    if inside:
        shown = ", ".join(f"s3://{location.bucket}/{d}" for d in inside[:5]) + (", ..." if len(inside) > 5 else "")
        raise UploadError(
            f"{location} holds {len(inside)} dataset{'s' if len(inside) > 1 else ''} below it ({shown}):"
            " indexing it would write into them and make one dataset of their shards; index a folder"
            " that holds only tars, nothing was written"
        )
    tars = sorted((info.key[len(prefix) :], info.size) for info in listing if info.key.endswith(".tar"))
    left_out = tuple(sorted(info.key[len(prefix) :] for info in listing if info.key.endswith(COMPRESSED_TARS)))
    if not tars:
        why = (f", only {_counted(left_out)} ({left_out[0]!r}{_more(left_out)}): a compressed tar cannot be read"
               " by byte range; decompress to .tar and index again" if left_out else "")
        raise UploadError(f"no .tar objects under {location}{why}")
    unreadable = [name for name, _ in tars if not valid_shard_name(name)]
    if unreadable:
        shown = ", ".join(repr(n) for n in unreadable[:5]) + (
            f" and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        )
        raise UploadError(
            f"{len(unreadable)} .tar names under {location} cannot be shard names (ASCII letters, digits"
            f" and _ . - / only, no part starting with . or -): {shown}; rename them, nothing was written"
        )
    if left_out:
        them = "them" if len(left_out) > 1 else "it"
        log.warning("index %s: left out %s (%r%s): a compressed tar cannot be read by byte range; decompress %s to"
                    " .tar and index again to include %s", location, _counted(left_out), left_out[0],
                    _more(left_out), them, them)
    return tars, left_out


def _counted(names: tuple[str, ...]) -> str:
    return f"{len(names)} compressed tar{'s' if len(names) > 1 else ''}"


def _more(names: tuple[str, ...]) -> str:
    return f" and {len(names) - 1} more" if len(names) > 1 else ""


def _index_tar(store: Store, location: Location, name: str, size: int) -> tuple[ShardEntry, ShardIndex]:
    """Scan tar ``name`` and write its index beside it; return its manifest entry and index."""
    index, crc = scan_tar(partial(store.get_range, location.bucket, location.key(name)), name, size,
                          max_fields=MAX_FIELDS)
    encoded = index.encode()
    entry = ShardEntry(name, len(index), size, 0, len(encoded), crc32(encoded), crc, name + INDEX_SUFFIX)
    ShardIndex.decode(encoded, data_end=entry.data_end, name=name)  # every rule a reader applies, before the PUT
    store.put(location.bucket, location.key(entry.index_name), encoded)
    return entry, index
