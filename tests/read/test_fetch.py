"""The prefetcher's ranges: read while they arrive, parts in order, errors where they belong."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import pytest

from remote_loader import (
    AccessDenied,
    FetchConfig,
    LocalStore,
    PreconditionFailed,
    RemoteDataset,
    TransientStorageError,
    make_client,
)
from remote_loader.read import Fetched, Job, Metrics, Prefetcher, ReadSession
from remote_loader.read.arrivals import Arrivals
from remote_loader.read.fetch import FetcherClosed, fetch_head
from remote_loader.read.session import Pinned
from remote_loader.storage.base import Store
from remote_loader.testing.synthetic import SyntheticImages
from tests.conftest import new_bucket
from tests.faultproxy import FaultProxy
from tests.helpers import upload_to_new_bucket


def test_a_range_done_with_while_a_part_still_arrives_keeps_its_buffer_from_reuse():
    """A range closed after a part failed (skipped under on_error="skip") gave its buffer back
    for the next range while a later part was still being received into it: that part's bytes
    landed in the range that reused the buffer."""
    given = []
    parts = Arrivals([100, 110, 120], 130)
    fetched = Fetched("k", 100, 130, None, memoryview(bytearray(30)), parts, release=lambda: given.append(1))
    parts.arrive(0, TransientStorageError("part 0 failed"))
    parts.arrive(1)
    fetched.done_with()  # part 2 still arriving
    assert given == []
    parts.arrive(2)
    fetched.done_with()
    assert given == [1]


def test_wait_returns_for_arrived_parts_and_raises_only_for_a_failed_one():
    parts = Arrivals([100, 110, 120], 130)
    fetched = Fetched("k", 100, 130, None, memoryview(bytearray(30)), parts)
    parts.arrive(0)
    assert fetched.wait(110) == 110  # only part 0 is needed
    parts.arrive(1, TransientStorageError("part 1 failed"))
    parts.arrive(2)
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
    with Prefetcher("b", jobs, ReadSession(config, metrics, store)) as prefetcher:
        got = []
        for fetched in prefetcher:
            fetched.wait()
            got.append((fetched.obj, bytes(fetched.buffer)))
            fetched.release()
    assert got == [(key, blobs[key][start:end]) for key, start, end in spans]
    assert metrics.bytes == sum(end - start for _, start, end in spans)


def test_a_head_fetched_early_is_a_ranges_first_part(tmp_path, caplog):
    """A job whose maker fetched the object's first bytes already (``fetch_head``, while the
    index ``locate()`` needs is on its way) has them as its range's first part, not fetched
    again: ``locate`` here waits until its head was requested. The bytes come out the same
    wherever the located range lies against the head: inside it, ending within it, past it,
    or empty."""
    heads_requested: dict[str, threading.Event] = {}

    class Recording(LocalStore):
        get_range_into = Store.get_range_into  # through get_range

        def get_range(self, bucket, key, start, end):
            if start == 0:
                heads_requested[key].set()
            return super().get_range(bucket, key, start, end)

    store = Recording(tmp_path)
    store.create_bucket("b")
    sizes = {"big": 5_000_000, "small": 300_000, "tail": 3_000_000, "empty": 50_000, "last": 100}
    blobs = {key: os.urandom(size) for key, size in sizes.items()}
    for key, data in blobs.items():
        store.put("b", key, data)
        heads_requested[key] = threading.Event()
    spans = {"big": (512, 4_000_000), "small": (512, 1000), "tail": (2_000_000, 3_000_000),
             "empty": (0, 0), "last": (0, 100)}  # empty: a shard skipped whole, its head unused
    in_time: dict[str, bool] = {}

    def locate(key: str) -> tuple[int, int, None]:
        in_time[key] = heads_requested[key].wait(5) if key != "last" else True
        return (*spans[key], None)

    config = FetchConfig(part_size=1 << 20, concurrency=4, prefetch_bytes=16 << 20)
    session = ReadSession(config, Metrics(), store)
    jobs = [Job(key, lambda k=key: locate(k), fetch_head(session, "b", key, 0, sizes[key])) for key in sizes]
    with Prefetcher("b", jobs, session) as prefetcher:
        got = {}
        for fetched in prefetcher:
            fetched.wait()
            got[fetched.obj] = bytes(fetched.buffer)
            fetched.release()
    assert got == {key: blobs[key][start:end] for key, (start, end) in spans.items()}
    assert in_time == {key: True for key in sizes}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no callback failed on the side


def test_no_range_ends_in_a_part_of_a_few_kib(tmp_path):
    """A GET of a few KiB costs a round trip like one of MiBs, and on the first batch's
    path it waits behind them: a range's last part under 1 MiB joins the part before, and
    the head of an object under 2 MiB takes the whole object."""
    gets: list[tuple[str, int, int]] = []

    class Recording(LocalStore):
        get_range_into = Store.get_range_into  # through get_range

        def get_range(self, bucket, key, start, end):
            gets.append((key, start, end))
            return super().get_range(bucket, key, start, end)

    store = Recording(tmp_path)
    store.create_bucket("b")
    mib = 1 << 20
    sizes = {"headed": mib + 6_000, "long": 3 * mib + 30_000, "later": 2 * mib + 24_000, "whole": 700_000}
    blobs = {key: os.urandom(size) for key, size in sizes.items()}
    for key, data in blobs.items():
        store.put("b", key, data)
    spans = {"headed": (512, mib + 5_000), "long": (0, sizes["long"]), "later": (0, sizes["later"]),
             "whole": (0, 700_000)}
    config = FetchConfig(part_size=mib, concurrency=4, prefetch_bytes=16 * mib)
    session = ReadSession(config, Metrics(), store)
    heads = {"headed": fetch_head(session, "b", "headed", 0, sizes["headed"])}
    # Five jobs before "later", so that it is cut into whole parts, not the first ranges' small ones.
    keys = ["headed", "long", "whole", "whole", "whole", "later"]
    jobs = [Job(key, lambda k=key: (*spans[k], None), heads.get(key)) for key in keys]
    with Prefetcher("b", jobs, session) as prefetcher:
        got = []
        for fetched in prefetcher:
            fetched.wait()
            got.append((fetched.obj, bytes(fetched.buffer)))
            fetched.release()
    assert got == [(key, blobs[key][slice(*spans[key])]) for key in keys]
    assert [g for g in gets if g[0] == "headed"] == [("headed", 0, sizes["headed"])]
    assert [g for g in gets if g[2] - g[1] < 700_000] == []
    assert sorted(g for g in gets if g[0] == "later") == [("later", 0, mib), ("later", mib, sizes["later"])]


def test_a_head_that_fails_fails_its_range_where_it_is_read(tmp_path):
    class Refusing(LocalStore):
        get_range_into = Store.get_range_into  # through get_range

        def get_range(self, bucket, key, start, end):
            if key == "obj1":
                raise AccessDenied("access denied to obj1", bucket=bucket, key=key)
            return super().get_range(bucket, key, start, end)

    store = Refusing(tmp_path)
    _store(tmp_path)
    session = ReadSession(FetchConfig(), Metrics(), store)
    jobs = [Job(f"obj{i}", lambda: (10, 1000, None), fetch_head(session, "b", f"obj{i}", 0, 100_000)) for i in range(3)]
    with Prefetcher("b", jobs, session) as prefetcher:
        ranges = iter(prefetcher)
        first = next(ranges)
        first.wait()
        first.release()
        second = next(ranges)
        with pytest.raises(AccessDenied, match="obj1"):
            second.wait()


def test_close_works_from_the_fetchers_own_threads(tmp_path):
    """A pipeline dropped without being closed is finalised wherever the garbage collector
    runs, one of the fetcher's threads included: closing from there ends the fetch too."""
    _store(tmp_path)
    prefetchers: list[Prefetcher] = []

    class ClosingStore(LocalStore):
        def get_range_into(self, bucket, key, start, end, out):
            prefetchers[0].close()  # as a finaliser run by the collector in this getter would
            super().get_range_into(bucket, key, start, end, out)

    jobs = [Job(f"obj{i}", lambda: (0, 100_000, None)) for i in range(3)]
    prefetcher = Prefetcher("b", jobs, ReadSession(FetchConfig(concurrency=2), Metrics(), ClosingStore(tmp_path)))
    prefetchers.append(prefetcher)
    with pytest.raises(FetcherClosed):
        for fetched in prefetcher:
            fetched.wait()
    assert not prefetcher._parts  # nothing queued holds a range (and through it the fetcher) any more


def _store(tmp_path, objects: int = 3, size: int = 100_000) -> LocalStore:
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    for i in range(objects):
        store.put("b", f"obj{i}", os.urandom(size))
    return store


def test_a_failure_in_the_scheduler_reaches_the_consumer(tmp_path):
    """A range too large to allocate makes the scheduler thread fail in its buffer pool
    (numpy's MemoryError): the consumer gets that error instead of waiting forever."""
    store = _store(tmp_path)
    jobs = [Job("obj0", lambda: (0, 1000, None)), Job("obj1", lambda: (0, 1 << 62, None)),
            Job("obj2", lambda: (0, 10, None))]
    config = FetchConfig(part_size=1 << 20, concurrency=2)
    with Prefetcher("b", jobs, ReadSession(config, Metrics(), store)) as prefetcher:
        ranges = iter(prefetcher)
        first = next(ranges)
        first.wait()
        first.release()
        with pytest.raises(MemoryError):
            next(ranges)


def test_an_error_locating_a_range_is_raised_in_job_order(tmp_path):
    store = _store(tmp_path)

    def broken() -> tuple[int, int, None]:
        raise TransientStorageError("index GET failed", bucket="b", key="obj1")

    jobs = [Job("obj0", lambda: (0, 10, None)), Job("obj1", broken)]
    with Prefetcher("b", jobs, ReadSession(FetchConfig(), Metrics(), store)) as prefetcher:
        ranges = iter(prefetcher)
        assert next(ranges).obj == "obj0"
        with pytest.raises(TransientStorageError) as caught:
            next(ranges)
    assert caught.value.key == "obj1"


def test_close_returns_within_a_second_while_a_request_hangs(tmp_path):
    """A GET that never returns (a hung server) does not hold up close(): the thread
    stuck in it is left to its read timeout, and released here at the end."""
    _store(tmp_path)  # the objects the hanging store serves
    release = threading.Event()
    entered = threading.Event()

    class HangingStore(LocalStore):
        def get_range_into(self, bucket, key, start, end, out):  # a hung server, on a real local store
            entered.set()
            release.wait(30)
            super().get_range_into(bucket, key, start, end, out)

    hanging = HangingStore(tmp_path)
    before = set(threading.enumerate())  # other tests' threads may still be ending
    jobs = [Job(f"obj{i}", lambda: (0, 100_000, None)) for i in range(3)]
    prefetcher = Prefetcher("b", jobs, ReadSession(FetchConfig(concurrency=2), Metrics(), hanging))
    ranges = iter(prefetcher)
    next(ranges)
    assert entered.wait(10)
    started = time.monotonic()
    ranges.close()  # abandoning the iteration closes the prefetcher
    assert time.monotonic() - started < 2.0
    release.set()

    def ours() -> list[str]:
        return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("remote-loader-")]

    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the released threads to end, not synchronising on time
    assert not ours()


def _through_a_slow_proxy(seaweed, bucket: str, forget_round_trip: bool, delay: float = 0.03) -> RemoteDataset:
    # Each GET waits ``delay`` at a proxy before the server answers, as across a network.
    store = seaweed.client()
    upload_to_new_bucket(store, bucket, "d", SyntheticImages(400), maxcount=100)
    proxy = FaultProxy(seaweed.endpoint_url, {"delay": 1.0}, delay=delay)
    try:
        client = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        fetch = FetchConfig(part_size=128 << 10, range_bytes=1 << 20, concurrency=32, prefetch_bytes=16 << 20)
        dataset = RemoteDataset(client, bucket, "d", fetch=fetch)
        assert dataset.reader.round_trip is not None and dataset.reader.round_trip >= delay
        if forget_round_trip:
            dataset.reader.round_trip = None  # as a reader that could not tell
        keys = [sample["__key__"] for sample in dataset]
        assert len(keys) == len(set(keys)) == 400
        client.close()
    finally:
        proxy.close()
        store.close()
    return dataset


def test_the_fetcher_reaches_further_when_every_get_costs_a_round_trip(tmp_path):
    """With the first 8 GETs in flight the reader waits for bytes, so the fetcher lets more
    run. Each GET of a shard here takes 100 ms more, as across a network, in the store itself:
    a proxy in the test's process, short of CPU beside busy processes, could carry no more GETs
    faster, and the reach rightly stayed at 8 (1 run in 4 beside five busy loops)."""

    class Far(LocalStore):
        get_range_into = Store.get_range_into  # through get_range

        def get_range(self, bucket, key, start, end):
            if key.endswith(".tar"):
                threading.Event().wait(0.1)  # the round trip, not a synchronisation
            return super().get_range(bucket, key, start, end)

    store = Far(tmp_path)
    upload_to_new_bucket(store, "b", "d", SyntheticImages(400), maxcount=100)
    fetch = FetchConfig(part_size=128 << 10, range_bytes=1 << 20, concurrency=32, prefetch_bytes=16 << 20)
    dataset = RemoteDataset(store, "b", "d", fetch=fetch)
    keys = [sample["__key__"] for sample in dataset]
    assert len(keys) == len(set(keys)) == 400
    assert 8 < dataset.metrics.gets_in_flight <= 32


def test_after_a_long_first_round_trip_the_fetcher_starts_at_its_ceilings(seaweed):
    # The manifest's GET took a network's round trip: no ramp, all 32 GETs from the start.
    dataset = _through_a_slow_proxy(seaweed, "fetch-far", forget_round_trip=False)
    assert dataset.metrics.gets_in_flight == 32


def test_arrivals_name_the_parts_that_hold_a_span_and_a_wait_ends_when_its_check_raises():
    parts = Arrivals([0, 10, 20], 25)
    assert list(parts.holding(0, 10)) == [0] and list(parts.holding(9, 11)) == [0, 1]
    assert list(parts.holding(20, 25)) == [2] and list(parts.holding(5, 5)) == []
    assert [parts.stop(k) for k in range(3)] == [10, 20, 25]

    class Stop(Exception):
        pass

    def check():
        raise Stop

    with pytest.raises(Stop):
        parts.wait(1, 0.001, check)  # part 1 never arrives: the check ends the wait
    parts.arrive(1)
    assert parts.wait(1, 0.001, check) is None and parts.settled(1) and not parts.settled(0)


@pytest.mark.parametrize("free_ranges", [2, 0])
def test_a_range_given_back_is_freed_though_the_getter_that_fetched_it_is_idle(tmp_path, free_ranges):
    # An idle getter thread kept the last range it fetched in a local variable: its buffer
    # stayed alive after the reader gave it back, one range of each of up to `concurrency`
    # getters (~80 MB a decoding worker on the node's benchmark).
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    for i in range(48):
        store.put("b", f"obj{i}", os.urandom(1 << 20))
    jobs = [Job(f"obj{i}", lambda: (0, 1 << 20, None)) for i in range(48)]
    config = FetchConfig(part_size=1 << 20, concurrency=16, prefetch_bytes=16 << 20, free_ranges=free_ranges)
    buffers = []
    with Prefetcher("b", jobs, ReadSession(config, Metrics(), store)) as prefetcher:
        for fetched in prefetcher:
            fetched.wait()
            buffers.append(weakref.ref(fetched.buffer.obj))
            fetched.release()
            del fetched
        alive = {id(ref()) for ref in buffers if ref() is not None}
        # Those kept for reuse, and the last two ranges' while their getters end their turns
        # (with the leak, 10-12: one for nearly every getter)
        assert len(alive) <= free_ranges + 2


@pytest.mark.parametrize("written", ["to the same size", "longer"])
def test_a_pinned_range_read_with_its_size_is_refused_once_the_object_was_written_again(s3, written):
    # The size came from a GET that named no version: the new object's bytes and size were returned as the pinned one's.
    store, bucket = s3
    store.put(bucket, "ds/s0.tar", b"a" * 1000)
    listed = next(iter(store.list(bucket, "ds/")))
    pinned = Pinned(listed.key, listed.etag)
    session = ReadSession(FetchConfig(), Metrics(), store)
    assert session.get_range_and_size(bucket, pinned, 10, 20) == (b"a" * 10, 1000)
    store.put(bucket, "ds/s0.tar", b"b" * (1000 if written == "to the same size" else 2000))
    with pytest.raises(PreconditionFailed) as caught:
        session.get_range_and_size(bucket, pinned, 10, 20)
    assert caught.value.key == "ds/s0.tar"


class _SizesOfAnyVersion(LocalStore):
    """A user's store, written before reads could name a version: its ``get_range_and_size``
    has no ``if_match``."""

    def get_range_and_size(self, bucket: str, key: str, start: int, end: int) -> tuple[bytes, int]:
        return super().get_range_and_size(bucket, key, start, end)


def test_a_pinned_range_read_with_its_size_from_a_store_that_names_no_version_there_is_still_pinned(tmp_path):
    store = _SizesOfAnyVersion(tmp_path)
    store.create_bucket("b")
    store.put("b", "ds/s0.tar", b"a" * 1000)
    listed = next(iter(store.list("b", "ds/")))
    session = ReadSession(FetchConfig(), Metrics(), store)
    assert session.get_range_and_size("b", Pinned(listed.key, listed.etag), 10, 20) == (b"a" * 10, 1000)
    store.put("b", "ds/s0.tar", b"b" * 1000)
    with pytest.raises(PreconditionFailed):  # a HEAD, then the ranged read naming the version
        session.get_range_and_size("b", Pinned(listed.key, listed.etag), 10, 20)


def test_a_pinned_range_read_with_its_size_is_one_request_counted_in_the_metrics(seaweed):
    # It made a HEAD and then the GET naming the version: two requests, one of them counted.
    store = seaweed.client()
    bucket = new_bucket(store)
    store.put(bucket, "ds/s0.tar", b"a" * 1000)
    listed = next(iter(store.list(bucket, "ds/")))
    proxy = FaultProxy(seaweed.endpoint_url, {})  # no faults: it counts what reaches the server
    try:
        client = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        metrics = Metrics()
        session = ReadSession(FetchConfig(), metrics, client)
        assert session.get_range_and_size(bucket, Pinned(listed.key, listed.etag), 10, 20) == (b"a" * 10, 1000)
        assert (proxy.requests, metrics.gets, metrics.bytes) == (1, 1, 10)
        client.close()
    finally:
        proxy.close()
        store.close()
