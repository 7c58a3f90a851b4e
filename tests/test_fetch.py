"""The prefetcher's ranges: read while they arrive, parts in order, errors where they belong."""

from __future__ import annotations

import os
import threading

import pytest

from remote_loader import FetchConfig, LocalStore, TransientStorageError
from remote_loader.fetch import Fetched, Job, Metrics, Prefetcher


def test_wait_returns_for_arrived_parts_and_raises_only_for_a_failed_one():
    parts = [threading.Event() for _ in range(3)]
    fetched = Fetched("k", 100, 130, None, memoryview(bytearray(30)), [100, 110, 120], parts, [None, None, None])
    parts[0].set()
    fetched.wait(110)  # only part 0 is needed
    fetched.errors[1] = TransientStorageError("part 1 failed")
    parts[1].set()
    parts[2].set()
    fetched.wait(105)
    with pytest.raises(TransientStorageError, match="part 1 failed"):
        fetched.wait(111)
    with pytest.raises(TransientStorageError):
        fetched.wait()  # the whole range needs part 1 too


def test_prefetcher_delivers_every_range_byte_identical_in_job_order(tmp_path):
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    blobs = {f"obj{i}": os.urandom(size) for i, size in enumerate((0, 1, 3_000_000, 5_500_123, 17))}
    for key, data in blobs.items():
        store.put("b", key, data)
    spans = [(key, start, len(data)) for key, data in blobs.items() for start in (0, len(data) // 3)]
    jobs = [Job(key, lambda s=start, e=end: (s, e, (s, e))) for key, start, end in spans]
    config = FetchConfig(part_size=1 << 20, concurrency=3, prefetch_bytes=4 << 20)
    metrics = Metrics()
    with Prefetcher(store, "b", jobs, config, metrics) as prefetcher:
        got = []
        for fetched in prefetcher:
            fetched.wait()
            got.append((fetched.key, bytes(fetched.buffer)))
            fetched.release()
    assert got == [(key, blobs[key][start:end]) for key, start, end in spans]
    assert metrics.bytes == sum(end - start for _, start, end in spans)
