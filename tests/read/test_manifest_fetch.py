"""A large manifest arrives in parallel ranges, byte for byte, and is read again when it
changes under the reader (against the embedded SeaweedFS, no mocked client calls)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from remote_loader import CorruptShard, FetchConfig, RemoteDataset, RetryConfig, make_client
from remote_loader.format import Manifest, ShardTable
from remote_loader.read import whole
from remote_loader.read.metrics import Metrics
from remote_loader.read.reader import DatasetReader
from remote_loader.read.session import ReadSession
from remote_loader.read.whole import fetch_whole
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

KiB = 1024


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first GET of 4 KiB, then parts of at least 1 KiB, as many as ``concurrency`` allows
    (however fast the first GET was): what a 25 MB manifest gets across a network."""
    monkeypatch.setattr(whole, "_FIRST", 4 * KiB)
    monkeypatch.setattr(whole, "_MIN_PART", KiB)
    monkeypatch.setattr(whole, "_PART_SECONDS", 1e-9)


def _manifest(shards: int, field: str) -> bytes:
    values = {"samples": 100, "size": 100_000, "index_offset": 90_000, "index_size": 1_000, "index_crc": 7, "crc32": 9}
    columns = {c: np.full(shards, v, dtype=np.uint64) for c, v in values.items()}
    table = ShardTable.from_template(columns, ("shard-", ".tar"), (6,), (np.arange(shards),))
    return Manifest(shards=table, fields=(field,)).encode()


@pytest.mark.parametrize("size, concurrency, gets", [
    (1_000, 16, 1),  # smaller than the first GET: all of it in one
    (4 * KiB, 16, 1),  # exactly the first GET
    (4 * KiB + 1, 16, 2),  # one byte more: a second range of one byte
    (12 * KiB + 7, 16, 9),  # the rest in 8 parts of at least 1 KiB
    (100 * KiB, 4, 5),  # at most `concurrency` parts
])
def test_an_object_arrives_whole_and_byte_identical_in_as_many_ranges_as_it_needs(s3, small_parts, size, concurrency,
                                                                                   gets):
    client, bucket = s3
    data = os.urandom(size)
    client.put(bucket, "m", data)
    metrics = Metrics()
    got = fetch_whole(ReadSession(FetchConfig(concurrency=concurrency), metrics, client), bucket, "m")
    assert bytes(got) == data
    assert (metrics.gets, metrics.bytes) == (gets, size)


def test_a_dataset_whose_manifest_arrives_in_ranges_streams_every_sample_once(s3, small_parts, monkeypatch):
    client, bucket = s3
    monkeypatch.setattr(whole, "_FIRST", 512)
    monkeypatch.setattr(whole, "_MIN_PART", 128)
    upload_to_new_bucket(client, bucket, "ds", SyntheticImages(300, size=(8, 8)), maxcount=2)
    data = client.get(bucket, "ds/manifest.msgpack")
    assert len(data) > 3 * 512, "the manifest must need several ranges"
    ds_reader = DatasetReader(client, bucket, "ds")
    assert ds_reader.manifest.encode() == data
    keys = [sample["__key__"] for sample in RemoteDataset(client, bucket, "ds")]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 300


@pytest.mark.parametrize("shards_after", [8_000, 3_000])
def test_a_manifest_replaced_while_its_ranges_arrive_is_read_again_whole(s3, small_parts, shards_after):
    """The first GET sees one upload's manifest, the ranges after it another's (as long, or
    shorter): the checksum, or the short range, sends the reader back to the start."""
    client, bucket = s3
    before, after = _manifest(8_000, "cls"), _manifest(shards_after, "lbl")
    assert len(before) > 3 * 4 * KiB
    client.put(bucket, "ds/manifest.msgpack", before)
    real = client.get_first_bytes
    replaced = []

    def first_bytes_then_replace(bucket_: str, key: str, length: int) -> tuple[bytes, int]:
        out = real(bucket_, key, length)
        if not replaced:
            client.put(bucket, "ds/manifest.msgpack", after)  # a real write, between the first GET and the rest
            replaced.append(True)
        return out

    client.get_first_bytes = first_bytes_then_replace  # type: ignore[method-assign]
    manifest = DatasetReader(client, bucket, "ds").manifest
    assert replaced and manifest.encode() == after and manifest.fields == ("lbl",)


def test_a_manifest_that_stays_damaged_fails_with_its_name(s3, small_parts):
    client, bucket = s3
    data = bytearray(_manifest(8_000, "cls"))
    data[len(data) // 2] ^= 1  # inside a later range
    client.put(bucket, "ds/manifest.msgpack", bytes(data))
    with pytest.raises(CorruptShard, match=r"manifest s3://.*/ds/manifest.msgpack fails its crc32 check"):
        _ = DatasetReader(client, bucket, "ds", fetch=FetchConfig(refetch_attempts=2)).manifest


def test_ranges_cut_short_by_the_network_are_fetched_again_not_the_whole_manifest(seaweed, small_parts):
    """A connection cut mid-body (the object unchanged) is a fault of that range: it is
    retried alone. Refetching the whole manifest instead would rarely get all 30 ranges
    through when every fourth body is cut short."""
    from tests.faultproxy import FaultProxy

    data = _manifest(8_000, "cls")
    with seaweed.client() as client:
        client.create_bucket("manifest-cuts")
        client.put("manifest-cuts", "ds/manifest.msgpack", data)
    proxy = FaultProxy(seaweed.endpoint_url, {"truncate": 0.25, "reset_mid_body": 0.1}, seed=21)
    try:
        with make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key) as client:
            fetch = FetchConfig(concurrency=30, retry=RetryConfig(backoff=0.001, max_backoff=0.01))
            manifest = DatasetReader(client, "manifest-cuts", "ds", fetch=fetch).manifest
        assert manifest.encode() == data
        # The same requests meet the same faults in every run (a presigned URL's time of signing
        # is not part of what the proxy draws from): 13 bodies cut short, 5 connections reset.
        assert proxy.injected["truncate"] >= 3
    finally:
        proxy.close()
