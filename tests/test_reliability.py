"""Failures around the data path: typed errors through DataLoader workers, safe overwrite,
damaged or missing shards under on_error="skip", a dataset replaced while read, secrets in
URLs, and the embedded server's lifetime."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset

import remote_loader.errors as errors
from remote_loader import (
    ConfigError,
    DatasetChanged,
    DatasetReader,
    FetchConfig,
    ObjectNotFound,
    RemoteDataset,
    StorageConfig,
    StorageError,
    UploadError,
    make_client,
)
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import FlakyImages, NoisyImages, upload

# ------------------------------------------------------------------ typed errors through workers

FACTS = {"bucket": "b", "key": "k/shard.tar", "code": "SlowDown", "name": "shard.tar", "field": "jpg", "index": 7,
         "location": "s3://b/d"}


def _public_errors() -> list[type[errors.RemoteLoaderError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.RemoteLoaderError)]


def _facts_of(cls: type) -> dict[str, object]:
    names = cls.__init__.__code__.co_varnames[
        : cls.__init__.__code__.co_argcount + cls.__init__.__code__.co_kwonlyargcount
    ]
    return {k: v for k, v in FACTS.items() if k in names}


class _Raising(Dataset):
    """Sample ``i`` raises the ``i``-th error class, and the one after them all is 0: the
    epoch ends as a DataLoader's epoch does, so its worker is told to stop (a DataLoader
    dropped after an error waits 5 s for its worker, MP_STATUS_CHECK_INTERVAL)."""

    def __init__(self, classes: list[type]) -> None:
        self.classes = classes

    def __len__(self) -> int:
        return len(self.classes) + 1

    def __getitem__(self, i: int) -> int:
        if i == len(self.classes):
            return 0
        cls = self.classes[i]
        raise cls("what went wrong", **_facts_of(cls))


def test_each_error_type_keeps_its_class_and_facts_through_a_worker():
    classes = _public_errors()
    batches = iter(DataLoader(_Raising(classes), batch_size=None, num_workers=1))
    for cls in classes:  # in order: one worker, the sampler's order
        with pytest.raises(cls) as caught:
            next(batches)
        assert type(caught.value) is cls
        for name, value in _facts_of(cls).items():
            assert getattr(caught.value, name) == value, (cls.__name__, name)
        assert "what went wrong" in str(caught.value)
    assert list(batches) == [0]


# ------------------------------------------------------------------ uploads


def _keys_and_bytes(client, bucket, folder):
    return Counter((s["__key__"], bytes(s["jpg"])) for s in DatasetReader(client, bucket, folder))


def test_a_failed_overwrite_leaves_the_old_dataset_readable(s3):
    client, bucket = s3
    upload(client, bucket, "d", SyntheticImages(40, size=(32, 24)), maxcount=10)
    before = _keys_and_bytes(client, bucket, "d")
    with pytest.raises(UploadError, match="sample 33"):
        upload(client, bucket, "d", FlakyImages(40, {33}, size=(32, 24), seed=9), maxcount=10, overwrite=True)
    assert _keys_and_bytes(client, bucket, "d") == before
    # The overwrite run by itself succeeds later, and leaves only its own shards.
    upload(client, bucket, "d", SyntheticImages(40, size=(32, 24), seed=9), maxcount=10, overwrite=True)
    after = _keys_and_bytes(client, bucket, "d")
    assert after != before and sum(after.values()) == 40
    names = {f"d/{e.name}" for e in DatasetReader(client, bucket, "d").manifest.shards}
    assert {o.key for o in client.list(bucket, "d/")} == names | {"d/manifest.msgpack"}


def test_an_oversized_sample_is_skipped_and_the_reason_reported(s3, caplog):
    client, bucket = s3
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        summary = upload(
            client, bucket, "big", NoisyImages(30, noisy={11}, size=(16, 12)), maxsize=16384, on_error="skip"
        )
    assert summary.skipped == 1 and summary.samples == 29
    assert len(summary.skip_reasons) == 1 and "sample 11" in summary.skip_reasons[0]
    assert "too large" in summary.skip_reasons[0] and "too large" in str(summary)
    assert any("sample 11" in r.getMessage() for r in caplog.records)
    with pytest.raises(UploadError, match="sample 11 is .* too large"):
        upload(client, bucket, "big2", NoisyImages(30, noisy={11}, size=(16, 12)), maxsize=16384)


# ------------------------------------------------------------------ damaged shards, replaced datasets


@pytest.fixture
def uploaded(s3):
    client, bucket = s3
    upload(client, bucket, "d", SyntheticImages(100, size=(32, 24)), maxcount=20)
    return client, bucket, DatasetReader(client, bucket, "d").manifest


def test_a_missing_shard_is_skipped_and_counted_or_raises(uploaded):
    client, bucket, manifest = uploaded
    gone = manifest.shards[2]
    client.delete(bucket, f"d/{gone.name}")
    with pytest.raises(ObjectNotFound) as caught:
        list(RemoteDataset(client, bucket, "d"))
    assert gone.name in caught.value.key
    dataset = RemoteDataset(client, bucket, "d", on_error="skip")
    keys = [s["__key__"] for s in dataset]
    assert len(keys) == len(set(keys)) == 100 - gone.samples
    assert dataset.metrics.skipped == gone.samples


def test_a_shard_with_a_damaged_index_is_skipped(uploaded):
    client, bucket, manifest = uploaded
    entry = manifest.shards[1]
    data = bytearray(client.get(bucket, f"d/{entry.name}"))
    data[entry.index_offset + 3] ^= 0xFF
    client.put(bucket, f"d/{entry.name}", bytes(data))
    dataset = RemoteDataset(client, bucket, "d", on_error="skip")
    assert len(list(dataset)) == 100 - entry.samples and dataset.metrics.skipped == entry.samples


def test_a_dataset_replaced_while_read_says_so(uploaded):
    client, bucket, _ = uploaded
    fetch = FetchConfig(part_size=4096, range_bytes=4096, prefetch_bytes=8192, concurrency=1)
    stream = iter(RemoteDataset(client, bucket, "d", fetch=fetch, open_shards=1))
    next(stream)
    upload(client, bucket, "d", SyntheticImages(100, size=(32, 24)), maxcount=25, overwrite=True)
    with pytest.raises(DatasetChanged, match="replaced by another upload") as caught:
        for _ in stream:
            pass
    assert caught.value.key == "d/manifest.msgpack"


# ------------------------------------------------------------------ secrets in URLs


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_client("http://user:SECRET-123@127.0.0.1:9000"),
        lambda: StorageConfig(endpoint_url="http://user:SECRET-123@127.0.0.1:9000"),
        lambda: RemoteDataset("s3://bucket/prefix", endpoint_url="http://user:SECRET-123@127.0.0.1:9000"),
        lambda: StorageConfig.from_env({"AWS_ENDPOINT_URL": "https://key:SECRET-123@s3.example"}),
    ],
)
def test_credentials_in_an_endpoint_url_are_refused_without_echoing_them(make):
    with pytest.raises(ConfigError, match="holds credentials") as caught:
        make()
    assert "SECRET-123" not in str(caught.value) and "SECRET-123" not in repr(caught.value)


_SLASHED = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY/EXAMPLEKEY"  # AWS secret keys often hold a '/'


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_client(f"http://AKIAEXAMPLE:{_SLASHED}@127.0.0.1:9000"),
        lambda: StorageConfig(endpoint_url=f"https://AKIAEXAMPLE:{_SLASHED}@s3.amazonaws.com"),
        lambda: StorageConfig.from_env({"AWS_ENDPOINT_URL": f"http://AKIAEXAMPLE:{_SLASHED}@127.0.0.1"}),
        # MinIO's own endpoints have no scheme: host:port, here behind key:secret@
        lambda: StorageConfig.from_env({"MINIO_ENDPOINT": f"AKIAEXAMPLE:{_SLASHED}@127.0.0.1:9000"}),
        lambda: StorageConfig.from_env({"AWS_ENDPOINT_URL": f"AKIAEXAMPLE:{_SLASHED}@127.0.0.1:9000"}),
        lambda: make_client(f"AKIAEXAMPLE:{_SLASHED}@127.0.0.1:9000"),
        lambda: RemoteDataset("s3://bucket/prefix", endpoint_url=f"AKIAEXAMPLE:{_SLASHED}@127.0.0.1:9000"),
        lambda: make_client(f"http:///AKIAEXAMPLE:{_SLASHED}@127.0.0.1:9000"),
        lambda: make_client(f"http://AKIAEXAMPLE:{_SLASHED}?x@127.0.0.1:9000"),
    ],
)
def test_credentials_in_an_endpoint_url_are_never_echoed_whatever_its_shape(make):
    """A secret with a '/' (most AWS secret keys) ends the host part where the check looked
    for '@', and an endpoint without a scheme (MinIO's host:port) has none: both were echoed
    whole in the message that refused them (no valid port, not a URL)."""
    with pytest.raises(ConfigError) as caught:
        make()
    shown, error = "", caught.value  # what a traceback prints of each error in the chain, but the code lines
    while error is not None:
        shown += "".join(traceback.format_exception_only(error))
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    for piece in ("AKIAEXAMPLE", "wJalrXUtnFEMI", "EXAMPLEKEY"):
        assert piece not in shown, shown


# ------------------------------------------------------------------ the embedded server


def test_a_server_started_from_a_thread_outlives_the_thread(tmp_path):
    server = EmbeddedS3(data_dir=str(tmp_path / "s3"))
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        # The old tie to the starting thread stopped the server within 2.5 s of the thread's end.
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{server.endpoint_url}/healthz", timeout=2) as answer:
                assert answer.status == 200
            time.sleep(0.25)  # observing the server over time, not synchronising
        client = server.client()
        client.create_bucket("alive")
        client.put("alive", "k", b"v")
        assert client.get("alive", "k") == b"v"
    finally:
        server.stop()


def _weed_processes_using(path: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(path).encode() in cmdline and b"mini" in cmdline:
            found.append(int(pid))
    return found


def test_a_server_whose_start_fails_is_not_left_running(tmp_path):
    data = tmp_path / "s3"
    server = EmbeddedS3(data_dir=str(data), buckets=["Not_A_Valid_Bucket!"])
    with pytest.raises(StorageError, match="create bucket refused, the bucket's name is not one S3 allows:"
                                           " 'Not_A_Valid_Bucket!'"):
        server.start()
    assert server.pid is None
    assert _weed_processes_using(data) == []


def test_the_server_makes_as_many_volumes_as_asked_not_one_per_free_gib(tmp_path):
    """Every bucket takes a volume: SeaweedFS's own limit (a volume per GiB of free disk) made
    the suite's 107th bucket refuse writes; ``max_volumes`` sets the limit instead."""
    with EmbeddedS3(data_dir=str(tmp_path / "s3"), max_volumes=2) as server:
        client = server.client()
        for name in ("first", "second", "third"):
            client.create_bucket(name)
        client.put("first", "k", b"1")
        client.put("second", "k", b"2")
        with pytest.raises(errors.TransientStorageError, match="InternalError"):
            client.put("third", "k", b"3")
        assert [client.get(b, "k") for b in ("first", "second")] == [b"1", b"2"]
        client.close()
