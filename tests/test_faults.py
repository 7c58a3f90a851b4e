"""Storage that misbehaves: resets, 5xx, slow-down, delays, short reads and flipped bytes.

A fault-injecting proxy sits between the client and SeaweedFS. Every epoch must yield
exactly the samples of a clean run, byte for byte, and never a corrupt one.
"""

from __future__ import annotations

import gc
import os
import threading
import uuid
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from remote_loader import (
    CorruptSampleError,
    DatasetReader,
    EndpointUnreachable,
    FetchConfig,
    RemoteDataset,
    RemoteLoaderError,
    RemoteMapDataset,
    RetryConfig,
    StorageConfig,
    StorageError,
    make_client,
    upload_cv_dataset,
)
from remote_loader.testing.synthetic import SyntheticImages
from tests.conftest import new_bucket
from tests.faultproxy import FAULTS, FaultProxy
from tests.helpers import upload, upload_to_new_bucket

FAULTY_FETCH = FetchConfig(part_size=64 * 1024, concurrency=4, refetch_attempts=10, retry=RetryConfig(backoff=0.001))


@pytest.fixture(scope="module")
def clean(seaweed):
    client = seaweed.client()
    client.create_bucket("fault-tests")
    upload_cv_dataset(SyntheticImages(2000, size=(48, 36)), client=client, bucket="fault-tests", base_folder="d",
                      maxcount=100, workers=2, progress=False)
    samples = Counter(
        (s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in RemoteDataset(client, "fault-tests", "d")
    )
    yield samples
    client.close()


def through(proxy, seaweed, backend):
    config = StorageConfig(
        endpoint_url=proxy.endpoint_url,
        access_key=seaweed.access_key,
        secret_key=seaweed.secret_key,
        max_attempts=3,
        read_timeout=10,
    )
    return make_client(config=config, backend=backend)


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_epoch_through_faults_equals_a_clean_epoch(seaweed, clean, backend):
    # The shards' names are an upload's own (random): which requests the draws fault differs
    # from one run to the next, so every kind is met once first, whatever the draws.
    proxy = FaultProxy(seaweed.endpoint_url, {kind: 0.05 for kind in FAULTS}, seed=11, each_first=True)
    try:
        dataset = RemoteDataset(through(proxy, seaweed, backend), "fault-tests", "d", fetch=FAULTY_FETCH)
        got = Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)
    finally:
        proxy.close()
    assert got == clean
    assert set(proxy.injected) == set(FAULTS), proxy.injected
    assert dataset.metrics.retries > 0
    print(
        f"\n{backend}: {proxy.requests} requests, injected {dict(proxy.injected)}, "
        f"loader retries {dataset.metrics.retries}"
    )


def test_an_upload_through_faults_on_every_request_stores_every_sample_once(seaweed):
    """500s, 503s and resets on PUTs, GETs, LISTs and DELETEs alike: the upload's own
    requests (its state, the manifest, the clean-up) are retried like its shards'."""
    client, bucket = seaweed.client(), "upload-fault-tests"  # a fixed name: faults follow the requests' paths
    client.create_bucket(bucket)
    ds = SyntheticImages(60, size=(40, 30))
    proxy = FaultProxy(
        seaweed.endpoint_url,
        {"error_500": 0.1, "slow_down_503": 0.05, "reset_before": 0.05},
        seed=12,
        methods=("GET", "PUT", "POST", "DELETE", "HEAD"),
    )
    try:
        faulty = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        summary = upload(faulty, bucket, "up", ds, maxcount=8)
        faulty.close()
    finally:
        proxy.close()
    assert summary.samples == 60 and summary.skipped == 0
    assert proxy.seen("PUT", f"/{bucket}/up/manifest.msgpack") > 1, "the manifest PUT met no fault: pick another seed"
    stored = Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in DatasetReader(client, bucket, "up"))
    assert stored == Counter((f"{i:06d}", ds[i][0], str(ds[i][1]).encode()) for i in range(60))
    assert [info.key for info in client.list(bucket, "up/") if "/_upload/" in info.key] == []
    client.close()


def test_a_clean_up_that_fails_after_the_switch_is_no_failed_upload_and_a_re_run_finishes_it(seaweed, caplog):
    """Every DELETE refused once the manifest is switched: the dataset is public and whole, so
    the upload returns, warning of what it left, and running it again removes that. It raised
    EndpointUnreachable for a dataset it had uploaded, and a re-run said 'already holds this
    dataset' and left the state and the 6 task records for ever."""
    client = seaweed.client()
    bucket = new_bucket(client)
    ds = SyntheticImages(60, size=(16, 16))
    proxy = FaultProxy(seaweed.endpoint_url, {"error_500": 1.0}, methods=("DELETE",))
    try:
        faulty = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        with caplog.at_level("WARNING", logger="remote_loader"):
            summary = upload(faulty, bucket, "tidy", ds, maxcount=10, retry=RetryConfig(outage_deadline=0.5))
            # A re-run while the store still refuses: the dataset is whole, so it returns (it raised)
            still = upload(faulty, bucket, "tidy", ds, maxcount=10, retry=RetryConfig(outage_deadline=0.5))
        faulty.close()
    finally:
        proxy.close()
    assert summary.samples == 60 and proxy.injected["error_500"] > 0 and still.uploaded_samples == 0
    assert any("clean-up failed" in r.getMessage() for r in caplog.records)
    assert any("could not be removed" in r.getMessage() for r in caplog.records)
    assert [k.key for k in client.list(bucket, "tidy/_upload/")] != []  # what it could not delete
    again = upload(client, bucket, "tidy", ds, maxcount=10)
    assert again.uploaded_samples == 0
    assert [k.key for k in client.list(bucket, "tidy/_upload/")] == []
    assert sorted(s["__key__"] for s in DatasetReader(client, bucket, "tidy")) == [f"{i:06d}" for i in range(60)]


class SlowFirstItems(SyntheticImages):
    """A dataset whose tasks take longer than the outage deadline: each task's first item
    takes ``seconds`` to read in the upload's task threads (not in its size estimate)."""

    def __init__(self, count: int, seconds: float) -> None:
        super().__init__(count, size=(16, 16))
        self.seconds = seconds

    def __getitem__(self, index):
        if index % 10 == 0 and threading.current_thread().name == "remote-loader-task":
            threading.Event().wait(self.seconds)  # the item itself is slow: a network share, say
        return super().__getitem__(index)


def test_one_fault_in_a_task_longer_than_the_outage_deadline_costs_a_retry(seaweed):
    """A task is retried whole, and its outage was timed from the start of the attempt: a
    task that outlasted the deadline gave up at its first fault, the store answering all the
    while ('failed every request for 8.2 s (1 attempts ...)' for one 500 on a task of 8 s
    with outage_deadline=5). The outage is timed from the failure."""
    client = seaweed.client()
    bucket = new_bucket(client)
    proxy = FaultProxy(seaweed.endpoint_url, {"error_500": 1.0}, methods=("PUT",), paths="/shard-",
                       first_only="request")  # each shard's first PUT
    try:
        faulty = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        summary = upload(faulty, bucket, "slow", SlowFirstItems(20, seconds=0.6), maxcount=10, shuffle=False,
                         retry=RetryConfig(outage_deadline=0.5))
        faulty.close()
    finally:
        proxy.close()
    assert summary.samples == 20 and proxy.injected["error_500"] == 2
    assert sorted(s["__key__"] for s in DatasetReader(client, bucket, "slow")) == [f"{i:06d}" for i in range(20)]


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_body_damaged_on_the_way_to_the_store_is_refused_and_sent_again(seaweed, backend):
    """A byte flipped in a PUT's or a part's body on the way: every body carries its crc32
    (x-amz-checksum-crc32), SeaweedFS refuses a body that does not match (BadDigest), and
    the body is sent again; the dataset stored is the one uploaded, byte for byte."""
    client, bucket = seaweed.client(), f"upload-flip-{backend}"
    client.create_bucket(bucket)
    ds = SyntheticImages(40, size=(64, 48))
    proxy = FaultProxy(seaweed.endpoint_url, {"flip_body": 0.3}, seed=4, methods=("PUT",))
    try:
        faulty = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key, backend=backend)
        summary = upload(faulty, bucket, "up", ds, maxcount=10, maxsize=12_000)  # shards in several parts
        faulty.close()
    finally:
        proxy.close()
    assert summary.samples == 40 and proxy.injected["flip_body"] > 0
    reader = DatasetReader(client, bucket, "up")
    assert all(reader.check_shard(entry).ok for entry in reader.manifest.shards)
    stored = Counter((s["__key__"], bytes(s["jpg"])) for s in reader)
    assert stored == Counter((f"{i:06d}", ds[i][0]) for i in range(40))
    client.close()


def test_an_upload_whose_every_body_is_damaged_fails_and_leaves_no_dataset(seaweed):
    client, bucket = seaweed.client(), "upload-flip-always"
    client.create_bucket(bucket)
    proxy = FaultProxy(seaweed.endpoint_url, {"flip_body": 1.0}, seed=1, methods=("PUT",))
    try:
        config = StorageConfig(endpoint_url=proxy.endpoint_url, access_key=seaweed.access_key,
                               secret_key=seaweed.secret_key)
        faulty = make_client(config=config)
        with pytest.raises(RemoteLoaderError, match="BadDigest"):
            upload(
                faulty,
                bucket,
                "up",
                SyntheticImages(10, size=(32, 24)),
                maxcount=5,
                retry=RetryConfig(backoff=0.0, max_backoff=0.0, outage_deadline=1.0),
            )
        faulty.close()
    finally:
        proxy.close()
    assert not client.exists(bucket, "up/manifest.msgpack")
    client.close()


def test_a_range_refused_inside_an_object_of_the_right_size_blames_the_store_not_the_shard(seaweed):
    """A 416 for bytes that lie inside a shard of the size its manifest says: the shard was
    not truncated or replaced, the store's answer is wrong, and the error says so."""
    client, bucket = seaweed.client(), "refused-range-tests"
    upload_to_new_bucket(client, bucket, "d", SyntheticImages(20, size=(32, 24)), maxcount=10)
    proxy = FaultProxy(seaweed.endpoint_url, {"refuse_range": 1.0}, paths="/d/shard-")
    try:
        dataset = RemoteDataset(make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key), bucket, "d")
        with pytest.raises(StorageError, match=r"yet it is the [\d,]+ bytes the manifest says: the store") as info:
            list(dataset)
    finally:
        proxy.close()
    assert "truncated" not in str(info.value) and info.value.code == "InvalidRange"
    refusing = FaultProxy(seaweed.endpoint_url, {"refuse_range": 1.0})  # the manifest's first bytes too
    try:
        with pytest.raises(StorageError, match=r"byte 0 lies outside the object, yet it is [\d,]+ bytes"):
            RemoteDataset(make_client(refusing.endpoint_url, seaweed.access_key, seaweed.secret_key), bucket, "d")
    finally:
        refusing.close()
    client.close()


def test_flipped_sample_is_refetched_or_skipped(seaweed, clean):
    # Flip only sample-range GETs after the first attempt of each: refetching heals them.
    proxy = FaultProxy(seaweed.endpoint_url, {"flip": 0.3}, seed=5)
    try:
        dataset = RemoteDataset(
            through(proxy, seaweed, "boto3"),
            "fault-tests",
            "d",
            fetch=FetchConfig(part_size=64 * 1024, refetch_attempts=10, retry=RetryConfig(backoff=0.0)),
        )
        got = Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)
    finally:
        proxy.close()
    assert got == clean and proxy.injected["flip"] > 0


def test_a_server_that_ignores_range_stops_the_epoch_naming_the_object(moto):
    """A server (or a proxy before it) that answers ranged GETs with whole objects: the epoch
    stops at the first range that does not start at byte 0, naming the object and the cause,
    and no sample is made of the object's first bytes. (moto checks no signature, so the
    proxy can drop the Range header.)"""
    target = moto.target
    client = make_client(target.endpoint_url, target.access_key, target.secret_key)
    bucket = new_bucket(client)
    upload(client, bucket, "d", SyntheticImages(60), maxcount=30)
    proxy = FaultProxy(target.endpoint_url, {"ignore_range": 1.0})
    try:
        through = make_client(proxy.endpoint_url, target.access_key, target.secret_key)
        dataset = RemoteDataset(through, bucket, "d", fetch=FetchConfig(part_size=1 << 20))
        samples = []
        with pytest.raises(StorageError, match=r"/d/shard-[^ ]+\.tar: a GET of bytes [1-9]\d*-\d+ was answered with"
                                               r" the whole object: .* ignores HTTP Range requests") as caught:
            samples.extend(dataset)
        assert caught.value.code == "RangeIgnored"
        clean = {s["__key__"]: bytes(s["jpg"]) for s in RemoteDataset(client, bucket, "d")}
        assert all(bytes(s["jpg"]) == clean[s["__key__"]] for s in samples)
        through.close()
    finally:
        proxy.close()
        client.close()


@pytest.fixture
def rotten(seaweed):
    """A dataset whose stored bytes of one sample are damaged: no refetch can heal them."""
    client = seaweed.client()
    bucket = f"rotten-{uuid.uuid4().hex[:12]}"
    upload_to_new_bucket(client, bucket, "d", SyntheticImages(60, size=(48, 36)), maxcount=20)
    reader = DatasetReader(client, bucket, "d")
    entry = reader.manifest.shards[1]
    index = reader.read_index(entry)
    _, offset, size, _ = index.members(5)[0]
    data = bytearray(client.get(bucket, f"d/{entry.name}"))
    data[offset + size // 2] ^= 0x01
    client.put(bucket, f"d/{entry.name}", bytes(data))
    yield client, bucket, entry.name, index.keys[5]
    client.close()


def test_bytes_that_stay_corrupt_raise_naming_shard_and_key(rotten):
    client, bucket, shard, key = rotten
    dataset = RemoteDataset(client, bucket, "d", fetch=FetchConfig(refetch_attempts=3, retry=RetryConfig(backoff=0.0)))
    with pytest.raises(CorruptSampleError) as info:
        list(dataset)
    assert (info.value.name, info.value.key) == (shard, key)
    assert shard in str(info.value) and key in str(info.value)


def test_skip_counts_samples_that_stay_corrupt(rotten):
    client, bucket, _, key = rotten
    dataset = RemoteDataset(
        client, bucket, "d", on_error="skip", fetch=FetchConfig(refetch_attempts=3, retry=RetryConfig(backoff=0.0))
    )
    keys = [s["__key__"] for s in dataset]
    assert len(keys) == 59 and key not in keys
    assert dataset.metrics.skipped == 1 and dataset.metrics.retries == 2


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")  # 2 cores here
def test_two_ranks_four_workers_through_faults_leak_nothing(seaweed, clean):
    threads_before, fds_before = set(threading.enumerate()), open_fds()  # other tests' threads may end meanwhile
    proxy = FaultProxy(seaweed.endpoint_url, {kind: 0.05 / len(FAULTS) for kind in FAULTS}, seed=3)
    client = through(proxy, seaweed, "boto3")
    got: Counter = Counter()
    for rank in range(2):
        dataset = RemoteDataset(client, "fault-tests", "d", rank=rank, world_size=2, equalize=False, fetch=FAULTY_FETCH)
        loader = DataLoader(
            dataset.map(lambda s: (s["__key__"], bytes(s["jpg"]), bytes(s["cls"]))), batch_size=None, num_workers=4
        )
        got.update(map(tuple, loader))
    del loader, dataset  # a dataset holds its shared-memory counters (a file descriptor each) while alive
    client.close()
    proxy.close()  # joins the proxy's connection threads
    gc.collect()  # DataLoader's iterator joins its queue threads when collected
    assert got == clean
    started = [t for t in threading.enumerate() if t not in threads_before]
    for thread in started:  # request threads end by themselves once their GET is answered
        thread.join(10)
    assert not [t.name for t in started if t.is_alive()]
    assert open_fds() <= fds_before


def test_map_dataset_heals_flipped_bytes(seaweed, clean):
    proxy = FaultProxy(seaweed.endpoint_url, {"flip": 0.3}, seed=8)
    try:
        ds = RemoteMapDataset(
            through(proxy, seaweed, "boto3"),
            "fault-tests",
            "d",
            fetch=FetchConfig(refetch_attempts=10, retry=RetryConfig(backoff=0.0)),
        )
        got = Counter()
        for start in range(0, len(ds), 64):
            got.update(
                (s["__key__"], s["jpg"], s["cls"])
                for s in ds.__getitems__(list(range(start, min(start + 64, len(ds)))))
            )
        ds.close()
    finally:
        proxy.close()
    assert got == clean and proxy.injected["flip"] > 0 and ds.metrics.retries > 0


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_ranges_answered_short_once_are_read_again_and_nothing_is_lost(seaweed, clean, on_error):
    """Each sample range's first GET answered whole but with half its bytes (its length saying
    so), though the shard is the manifest's size: the store answered wrongly, and the range is
    read once more, streamed or read at random, under either ``on_error``."""
    shards = len(clean) // 100
    # The ranges read from a shard's first byte (its head, fetched before its index has come), once.
    proxy = FaultProxy(seaweed.endpoint_url, {"short_answer": 1.0}, paths="/d/shard-", first_only="request",
                       ranges="bytes=0-")
    try:
        dataset = RemoteDataset(through(proxy, seaweed, "boto3"), "fault-tests", "d", on_error=on_error)
        got = Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)
    finally:
        proxy.close()
    assert got == clean and dataset.metrics.skipped == 0
    assert dataset.metrics.retries >= proxy.injected["short_answer"] > 0
    proxy = FaultProxy(seaweed.endpoint_url, {"short_answer": 1.0}, paths="/d/shard-", first_only="object")
    try:  # the indexes
        dataset = RemoteDataset(through(proxy, seaweed, "boto3"), "fault-tests", "d", on_error=on_error)
        got = Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)
    finally:
        proxy.close()
    assert got == clean and dataset.metrics.skipped == 0 and proxy.injected["short_answer"] == shards
    proxy = FaultProxy(seaweed.endpoint_url, {"short_answer": 1.0}, paths="/d/shard-", first_only="object")
    try:
        ds = RemoteMapDataset(through(proxy, seaweed, "boto3"), "fault-tests", "d")
        some = Counter((s["__key__"], s["jpg"], s["cls"]) for s in ds.__getitems__(list(range(0, len(ds), 97))))
        ds.close()
    finally:
        proxy.close()
    assert some <= clean and some.total() == len(range(0, len(clean), 97)) and proxy.injected["short_answer"] > 0


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_bare_429_is_ridden_out_as_a_rate_limit(seaweed, clean, backend):
    proxy = FaultProxy(seaweed.endpoint_url, {"too_many_requests": 1.0}, paths="/d/shard-", first_only="request")
    try:
        dataset = RemoteDataset(through(proxy, seaweed, backend), "fault-tests", "d",
                                fetch=FetchConfig(retry=RetryConfig(backoff=0.001)))
        got = Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)
    finally:
        proxy.close()
    assert got == clean and proxy.injected["too_many_requests"] >= len(clean) // 100


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_an_answer_to_head_without_its_length_is_a_storage_error_naming_the_object(seaweed, clean, backend):
    proxy = FaultProxy(seaweed.endpoint_url, {"head_no_length": 1.0}, methods=("HEAD",))
    try:
        client = through(proxy, seaweed, backend)  # minio's own client reads a missing length as 0
        key = next(info.key for info in client.list("fault-tests", "d/"))
        with pytest.raises(StorageError, match=rf"s3://fault-tests/{key}: the store answered HEAD without"
                                               " Content-Length") as caught:
            client.head("fault-tests", key)
    finally:
        proxy.close()
    assert caught.value.code == "NoContentLength"


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_server_that_trickles_its_bodies_is_given_up_on_after_the_outage_deadline(seaweed, clean, backend):
    """A byte every half second never meets a read timeout: a body slower than
    ``receive.SLOWEST_BODY`` fails its GET, and GETs failing past the outage deadline end the epoch."""
    proxy = FaultProxy(seaweed.endpoint_url, {"trickle": 1.0}, paths="/d/shard-", delay=0.5)
    config = StorageConfig(endpoint_url=proxy.endpoint_url, access_key=seaweed.access_key,
                           secret_key=seaweed.secret_key, read_timeout=1)
    fetch = FetchConfig(part_size=32 * 1024, range_bytes=32 * 1024, retry=RetryConfig(backoff=0.001, outage_deadline=3))
    dataset = RemoteDataset(make_client(config=config, backend=backend), "fault-tests", "d", fetch=fetch)
    outcome: list[object] = []

    def epoch() -> None:
        try:
            outcome.append(sum(1 for _ in dataset))
        except RemoteLoaderError as error:
            outcome.append(error)

    reading = threading.Thread(target=epoch, daemon=True)
    reading.start()
    reading.join(120)  # a bound for the test, never reached: it ends within seconds, or hangs for good
    ended = not reading.is_alive()
    proxy.close()
    assert ended and isinstance(outcome[0], EndpointUnreachable), outcome
    assert "outage_deadline=3" in str(outcome[0]) and proxy.injected["trickle"] > 0
