"""A whole object of any size, in as many parallel ranged GETs as its size and the link call
for: how the manifest arrives."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial

from remote_loader.errors import CorruptShard, InvalidRange
from remote_loader.read.session import ReadSession
from remote_loader.storage.daemon import map_on_daemon_threads

_FIRST = 4 << 20
_MIN_PART = 1 << 20
_PART_SECONDS = 0.05
MAX_MANIFEST_BYTES = 1 << 31
"""The largest manifest a reader takes (a billion samples make about 25 MB): an object under
the manifest's name larger than this is refused before a buffer is made for it."""


def fetch_whole(session: ReadSession, bucket: str, key: str,
                timed: Callable[[float, int], None] | None = None) -> bytes | bytearray:
    """A whole object in one GET if it is at most 4 MiB (a manifest of up to ~170,000
    shards), else in parallel ranged GETs: on a link that carries ~90 MB/s per connection,
    a 25 MB manifest (a million shards) takes ~0.3 s in one GET, ~0.16 s this way.

    The first GET asks for the object's first 4 MiB and learns the object's size from the
    same response. From how long those took, the rest is split into as many ranges as
    would each take about 50 ms in one GET (at least 1 MiB each, at most ``concurrency``),
    fetched at once: one range on loopback, where more would only cost CPU; 8-16 across
    a network. The parts may come from two versions of an object replaced meanwhile: the
    caller's checksum finds that, as does a part that comes back short from an object no
    longer that long (``CorruptShard``: the caller fetches it all again). Any other fault
    of a part is retried for that part alone. ``timed(seconds, nbytes)`` is told how long
    the first GET took, the store's client made before it (loading an SDK's models: ~50 ms).
    """
    session.metrics.add(gets=1)
    session.store.inner.connect()
    started = time.perf_counter()
    first, size = session.store.get_first_bytes(bucket, key, _FIRST)
    took = time.perf_counter() - started
    session.metrics.add(bytes=len(first))
    if timed is not None:
        timed(took, len(first))
    if len(first) >= size:
        return first
    if size > MAX_MANIFEST_BYTES:
        raise CorruptShard(f"s3://{bucket}/{key} is {size:,d} bytes, larger than any manifest this reader takes"
                           f" ({MAX_MANIFEST_BYTES:,d}): it is not a remote_loader manifest", name=key)
    out = bytearray(size)
    view = memoryview(out)
    view[:len(first)] = first
    start, rest = len(first), size - len(first)
    one_get = took * rest / len(first)  # an over-estimate: ``took`` includes a round trip
    parts = max(1, min(session.config.concurrency, rest // _MIN_PART, math.ceil(one_get / _PART_SECONDS)))
    bounds = [start + rest * k // parts for k in range(parts + 1)]
    del first

    def part(k: int) -> None:
        try:
            session.store.inner.get_range_into(bucket, key, bounds[k], bounds[k + 1], view[bounds[k]:bounds[k + 1]])
        except InvalidRange:  # the object ends before this range: it was replaced meanwhile
            raise CorruptShard(f"s3://{bucket}/{key} changed while it was read in ranges (no longer {size} bytes)",
                               name=key) from None

    def one(k: int) -> None:
        session.metrics.add(gets=1)
        session.store.retry.call(partial(part, k), bucket=bucket, key=key)
        session.metrics.add(bytes=bounds[k + 1] - bounds[k])

    # On daemon threads, as the prefetcher's: Ctrl-C does not wait for a range stuck on a hung store.
    map_on_daemon_threads(one, range(parts), parts, "remote-loader-manifest")
    return out
