"""The read path's requests: one retrying store per iteration, its metrics, and the refetch
of damaged bytes.

Retrying itself is the storage layer's (``storage.retrying``); what the read path adds is
counting (GETs, bytes, retries into ``Metrics``), cancelling (an iterator being closed
ends the waits of its requests), and ``refetch``: bytes that fail their checksum are
fetched again, up to ``FetchConfig.refetch_attempts`` fetches, a concern of the format
rather than of the store. A session of a dataset read through a node's shard cache
(``read/node_cache.py``) reads the shards it holds from there, and fills it with those it lacks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from remote_loader.config import FetchConfig
from remote_loader.errors import CorruptShard, TruncatedShard
from remote_loader.read.cached_shard import ShardFile
from remote_loader.read.metrics import Metrics
from remote_loader.read.node_cache import UploadCache
from remote_loader.storage import Store
from remote_loader.storage.retrying import Cancelled, Retry, RetryingStore

T = TypeVar("T")
P = TypeVar("P")

__all__ = ["Cancelled", "ReadSession"]

_EXPECTED = 4096
"""Shards a session remembers as read through the node's cache, the most recently expected:
far more than it holds indexes of (each read of an index says it again), and a session that
reads a billion samples at random stays bounded."""


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
        self.store = RetryingStore(store, Retry(config.retry, store.endpoint, self.cancel,
                                                on_retry=lambda: metrics.add(retries=1)))
        self._cache = cache
        self._upload: UploadCache | None = None  # the cache, once made (after the manifest is read)
        self._shards: dict[str, tuple[str, int, int]] = {}  # key -> (name, size, crc32) of shards the cache holds

    @property
    def caching(self) -> bool:
        """Whether the session reads through a node's cache."""
        return self._cache is not None

    def expect(self, key: str, name: str, size: int, crc: int) -> None:
        """Say that object ``key`` is shard ``name`` of the manifest (``size`` bytes, crc32
        ``crc``): reads of it go through the node's cache, where there is one."""
        if self._cache is not None:
            self._shards.pop(key, None)  # the most recent last: the oldest go past _EXPECTED
            self._shards[key] = (name, size, crc)
            if len(self._shards) > _EXPECTED:
                del self._shards[next(iter(self._shards))]

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of an object: one ranged GET, or the node's cache."""
        if key in self._shards:
            out = bytearray(end - start)
            self.get_range_into(bucket, key, start, end, memoryview(out))
            return out
        self.metrics.add(gets=1)
        data = self.store.get_range(bucket, key, start, end)
        self.metrics.add(bytes=len(data))
        return data

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview) -> None:
        """Bytes ``[start, end)`` of an object received into ``out``: one ranged GET, or the
        node's cache (filled with the whole shard first where it lacks it)."""
        if not self._from_cache(bucket, key, start, end, out):
            self._get_into(bucket, key, start, end, out)

    def get_range_and_size(self, bucket: str, key: str, start: int, end: int) -> tuple[bytes | bytearray, int]:
        """Bytes ``[start, end)`` of an object and the object's size (see ``Store``)."""
        if key in self._shards:
            out = bytearray(end - start)
            if self._from_cache(bucket, key, start, end, memoryview(out)):
                return out, self._shards[key][1]
        self.metrics.add(gets=1)
        data, size = self.store.get_range_and_size(bucket, key, start, end)
        self.metrics.add(bytes=len(data))
        return data, size

    def whole(self, key: str, start: int, end: int) -> ShardFile | None:
        """Object ``key`` open from the node's cache to read bytes ``[start, end)`` of it, where
        the cache holds it whole (``UploadCache.whole``: checked, or each member to check);
        None otherwise (read it as any range). Those bytes are counted as read from the cache."""
        found = self._cached(key)
        if found is None:
            return None
        cache, name, size, crc = found
        try:
            shard = cache.whole(name, size, crc, damaged=lambda: self.metrics.add(retries=1))
        except OSError:  # the disk's: the bytes come from the store, as without a cache
            return None
        if shard is not None:
            self.metrics.add(cached_bytes=end - start)
        return shard

    def holds(self, key: str) -> bool:
        """Whether the node's cache holds object ``key`` whole (a look at its file: nothing read)."""
        found = self._cached(key)
        return found is not None and found[0].size(found[1]) == found[2]

    def head(self, bucket: str, key: str) -> int:
        """The object's size: a HEAD, or the size of its copy in the node's cache (checked whole
        against the manifest's crc32 when it was fetched)."""
        found = self._cached(key)
        size = found[0].size(found[1]) if found is not None else None
        return size if size is not None else self.store.head(bucket, key)

    def _cached(self, key: str | None) -> tuple[UploadCache, str, int, int] | None:
        """The node's cache and what it holds object ``key`` as (name, size, crc32), if it may."""
        shard = self._shards.get(key) if key is not None else None
        if shard is not None and self._upload is None and self._cache is not None:
            self._upload = self._cache()
        cache = self._upload if shard is not None else None
        return None if shard is None or cache is None else (cache, *shard)

    def _get_into(self, bucket: str, key: str, start: int, end: int, out: memoryview) -> None:
        self.metrics.add(gets=1)
        self.store.get_range_into(bucket, key, start, end, out)
        self.metrics.add(bytes=end - start)

    def _from_cache(self, bucket: str, key: str, start: int, end: int, out: memoryview) -> bool:
        found = self._cached(key)
        if found is None:
            return False
        cache, name, size, crc = found
        if not cache.read(name, size, crc, start, end, out, partial(self._get_into, bucket, key),
                          self.config.part_size, self.config.concurrency, self.cancel):
            return False
        self.metrics.add(cached_bytes=end - start)
        return True

    def refetch(self, fetch: Callable[[], P], parse: Callable[[P], T], key: str | None = None) -> T:
        """Return ``parse(fetch())``; bytes that ``parse`` (or ``fetch`` itself) finds damaged
        (``CorruptShard``) are fetched again, up to ``config.refetch_attempts`` fetches in all.
        An object of the wrong size (``TruncatedShard``) is read once more only: a second
        answer of the same store settles it. Damaged bytes of object ``key`` read from the
        node's cache drop its copy there: the next fetch goes to the store."""
        for attempt in range(1, self.config.refetch_attempts + 1):
            try:
                return parse(fetch())
            except CorruptShard as error:
                if attempt == self.config.refetch_attempts or (isinstance(error, TruncatedShard) and attempt >= 2):
                    raise
                self.metrics.add(retries=1)
                self.discard(key)
        raise AssertionError("unreachable")

    def discard(self, key: str | None) -> None:
        """Drop the cached copy of object ``key`` (its bytes failed a check), if there is one."""
        found = self._cached(key)
        if found is not None:
            found[0].discard(found[1])
