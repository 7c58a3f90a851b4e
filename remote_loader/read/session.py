"""The read path's requests: one retrying store per iteration, its metrics, and the refetch
of damaged bytes.

Retrying itself is the storage layer's (``storage.retrying``); what the read path adds is
counting (GETs, bytes, retries into ``Metrics``), cancelling (an iterator being closed
ends the waits of its requests), and ``refetch``: bytes that fail their checksum are
fetched again, up to ``FetchConfig.refetch_attempts`` fetches, a concern of the format
rather than of the store. A session of a dataset read through a node's shard cache
(``read/upload_cache.py``) reads the shards it holds from there, and fills it with those it lacks.

Which objects those are, each request says: it names its object by key (read from the
store), or as a ``Shard`` of the manifest (its name, size and crc32: through the cache, where
there is one). Nothing is routed by what was read before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from remote_loader.config import FetchConfig
from remote_loader.errors import CorruptShard, InvalidRange, TruncatedShard
from remote_loader.read.cached_shard import ShardFile
from remote_loader.read.metrics import Metrics
from remote_loader.read.shard_fill import Slots
from remote_loader.read.upload_cache import UploadCache
from remote_loader.storage import Store
from remote_loader.storage.base import place
from remote_loader.storage.retrying import Cancelled, Retry, RetryingStore

T = TypeVar("T")
P = TypeVar("P")

__all__ = ["Cancelled", "Pinned", "ReadSession", "Shard"]


@dataclass(frozen=True)
class Shard:
    """An object of the upload as its manifest lists it (a shard, or an index kept apart):
    ``key`` in the bucket, ``name`` in the upload, ``size`` bytes, crc32 ``crc``. A request
    naming its object so may be served by the node's cache, which keeps objects by these."""

    key: str
    name: str
    size: int
    crc: int


@dataclass(frozen=True)
class Pinned:
    """An object by its key and the version tag its listing gave (``ObjectInfo.etag``): each
    ranged GET of it names the tag, and fails with ``PreconditionFailed`` once the object was
    written again, so that the parts of one read all come from one version of it."""

    key: str
    etag: str


Object = str | Shard | Pinned
"""What a request reads: an object by its key (always from the store), a ``Shard``, or a
``Pinned`` version of one."""


def key_of(obj: Object) -> str:
    """The object's key in the bucket."""
    return obj if isinstance(obj, str) else obj.key


class ReadSession:
    """The requests of one reader or one iteration: ``store`` with every request retried
    under ``config.retry``, retries counted in ``metrics``, all of it ended by ``cancel``.

    Args:
        config: The fetch settings; ``config.retry`` drives the retries.
        metrics: Where GETs, bytes and retries are counted.
        store: The store the requests go to.
        cancel: Set it to make waiting requests give up at once with ``Cancelled``.
        cache: The node's cache of the dataset's upload, made when first needed (after the
            manifest is read), or None.
    """

    def __init__(self, config: FetchConfig, metrics: Metrics, store: Store,
                 cancel: threading.Event | None = None, cache: Callable[[], UploadCache | None] | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.cancel = cancel if cancel is not None else threading.Event()
        self.store = RetryingStore(store, Retry(config.retry, store, self.cancel,
                                                on_retry=lambda: metrics.add(retries=1)))
        self._cache = cache
        self._upload: UploadCache | None = None  # the cache, once made (after the manifest is read)
        self._slots = Slots(config.concurrency)  # the GETs of the shards it fills into the cache

    @property
    def caching(self) -> bool:
        """Whether the session reads through a node's cache."""
        return self._cache is not None

    def get_range(self, bucket: str, obj: Object, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of an object: one ranged GET, or the node's cache."""
        if self._cached(obj) is not None or isinstance(obj, Pinned):
            out = bytearray(end - start)
            self.get_range_into(bucket, obj, start, end, memoryview(out))
            return out
        self.metrics.add(gets=1)
        data = self.store.get_range(bucket, key_of(obj), start, end)
        self.metrics.add(bytes=len(data))
        return data

    def get_range_into(self, bucket: str, obj: Object, start: int, end: int, out: memoryview) -> None:
        """Bytes ``[start, end)`` of an object received into ``out``: one ranged GET, or the
        node's cache (filled with the whole shard first where it lacks it)."""
        if not self._from_cache(bucket, obj, start, end, out):
            self._get_into(bucket, key_of(obj), start, end, out, obj.etag if isinstance(obj, Pinned) else None)

    def get_range_and_size(self, bucket: str, obj: Object, start: int, end: int) -> tuple[bytes | bytearray, int]:
        """Bytes ``[start, end)`` of an object and the object's size (see ``Store``): one
        GET. Of a ``Pinned`` one, the GET names its version: ``PreconditionFailed`` if it was
        written since its listing."""
        found = self._cached(obj)
        if found is not None:
            out = bytearray(end - start)
            if self._from_cache(bucket, obj, start, end, memoryview(out)):
                return out, found[2]
        self.metrics.add(gets=1)
        data, size = self.store.get_range_and_size(bucket, key_of(obj), start, end,
                                                   if_match=obj.etag if isinstance(obj, Pinned) else None)
        self.metrics.add(bytes=len(data))
        return data, size

    def whole(self, obj: Object) -> ShardFile | None:
        """The object open from the node's cache, where the cache holds it whole
        (``UploadCache.whole``: checked, or each member to check); None otherwise (read it as
        any range). Whoever reads it counts the bytes it read in ``metrics.cached_bytes``."""
        found = self._cached(obj)
        if found is None:
            return None
        cache, name, size, crc = found
        try:
            return cache.whole(name, size, crc, damaged=lambda: self.metrics.add(retries=1))
        except OSError:  # the disk's: the bytes come from the store, as without a cache
            return None

    def holds(self, obj: Object) -> bool:
        """Whether the node's cache holds the object whole (a look at its file: nothing read)."""
        found = self._cached(obj)
        return found is not None and found[0].size(found[1]) == found[2]

    def head(self, bucket: str, obj: Object) -> int:
        """The object's size: a HEAD, or the size of its copy in the node's cache (checked whole
        against the manifest's crc32 when it was fetched)."""
        found = self._cached(obj)
        size = found[0].size(found[1]) if found is not None else None
        return size if size is not None else self.store.head(bucket, key_of(obj))

    def _cached(self, obj: Object | None) -> tuple[UploadCache, str, int, int] | None:
        """The node's cache and the object as it keeps it (name, size, crc32), where the object
        is a ``Shard`` and the dataset is read through a cache."""
        if not isinstance(obj, Shard) or self._cache is None:
            return None
        if self._upload is None:
            self._upload = self._cache()
        return None if self._upload is None else (self._upload, obj.name, obj.size, obj.crc)

    def _get_into(self, bucket: str, key: str, start: int, end: int, out: memoryview,
                  if_match: str | None = None) -> None:
        self.metrics.add(gets=1)
        self.store.get_range_into(bucket, key, start, end, out, if_match=if_match)
        self.metrics.add(bytes=end - start)

    def _from_cache(self, bucket: str, obj: Object, start: int, end: int, out: memoryview) -> bool:
        found = self._cached(obj)
        if found is None or not isinstance(obj, Shard):  # only a Shard is found in the cache
            return False
        cache, name, size, crc = found
        if not cache.read(name, size, crc, start, end, out, partial(self._fill_part, bucket, obj),
                          self.config.part_size, self._slots, self.cancel, lambda: self.metrics.add(retries=1)):
            return False
        self.metrics.add(cached_bytes=end - start)
        return True

    def _fill_part(self, bucket: str, shard: Shard, start: int, end: int, out: memoryview, sized: bool) -> None:
        """A part ``[start, end)`` of ``shard`` fetched into the node's cache; where ``sized``,
        its GET also checks the object's size against the manifest's, as a read from the store
        does (``DatasetReader.read_index``): an object longer than the manifest says, its first
        bytes the shard's, crc32 and all, is refused, not cached and served."""
        if not sized:
            self._get_into(bucket, shard.key, start, end, out)
            return
        self.metrics.add(gets=1)
        data, size = self.store.get_range_and_size(bucket, shard.key, start, end)
        self.metrics.add(bytes=len(data))
        if size != shard.size:
            where = self.store.path_of(bucket, shard.key) or place(bucket, shard.key)
            raise TruncatedShard(f"{where} is {size:,d} bytes; the manifest says {shard.size:,d}: it was truncated or"
                                 " replaced", name=shard.name)
        out[:] = data

    def refetch(self, fetch: Callable[[], P], parse: Callable[[P], T], obj: Object | None = None) -> T:
        """Return ``parse(fetch())``; bytes that ``parse`` (or ``fetch`` itself) finds damaged
        (``CorruptShard``) are fetched again, up to ``config.refetch_attempts`` fetches in all.
        An object of the wrong size (``TruncatedShard``), or one the store answered short though
        it is the right size (``InvalidRange``), is read once more only: a second answer of the
        same store settles it. Damaged bytes of ``obj`` (a ``Shard``) read from the
        node's cache drop its copy there: the next fetch goes to the store."""
        for attempt in range(1, self.config.refetch_attempts + 1):
            try:
                return parse(fetch())
            except (CorruptShard, InvalidRange) as error:
                once = isinstance(error, TruncatedShard | InvalidRange)
                if attempt == self.config.refetch_attempts or (once and attempt >= 2):
                    raise
                self.metrics.add(retries=1)
                self.discard(obj)
        raise AssertionError("unreachable")

    def discard(self, obj: Object | None) -> None:
        """Drop the cached copy of the object (its bytes failed a check), if there is one."""
        found = self._cached(obj)
        if found is not None:
            found[0].discard(found[1])
