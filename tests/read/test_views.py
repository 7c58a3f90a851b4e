"""``views=True``: members as read-only memoryviews, of the mapped file where the node's cache
holds the shard (no copy), the same bytes as without; a view never leaves a DataLoader worker
(it arrives as bytes); a pass from the cache does not wait for the manifest's GET."""

from __future__ import annotations

import mmap
import os
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from remote_loader import ConfigError, RemoteDataset, make_client
from remote_loader.format import MANIFEST_NAME
from remote_loader.read import cached_shard
from remote_loader.read.cached_shard import ShardFile
from remote_loader.testing.synthetic import SyntheticImages
from tests.faultproxy import FaultProxy
from tests.helpers import upload

SAMPLES, PER_SHARD = 40, 8  # five shards


@pytest.fixture
def dataset(s3):
    store, bucket = s3
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48)), maxcount=PER_SHARD)
    return store, bucket


def _members(items) -> Counter:
    return Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in items)


def _field_types(items) -> set[type]:
    return {type(v) for s in items for k, v in s.items() if not k.startswith("__")}


@pytest.mark.parametrize("cached", [False, True], ids=["store", "node-cache"])
def test_views_hold_the_same_bytes_as_bytes_do(dataset, tmp_path, cached):
    store, bucket = dataset
    options = {"cache_dir": tmp_path / "cache"} if cached else {"cache_dir": ""}
    plain = list(RemoteDataset(store, bucket, "d", **options))
    ds = RemoteDataset(store, bucket, "d", views=True, **options)
    for _ in range(2):  # a cache's first pass fills it, its second reads the files
        viewed = list(ds)
        assert _field_types(viewed) == {memoryview} and _field_types(plain) == {bytes}
        assert all(v.readonly for s in viewed for k, v in s.items() if not k.startswith("__"))
        assert _members(viewed) == _members(plain) and len(viewed) == SAMPLES


def test_from_the_cache_a_view_is_of_the_mapped_file_not_a_copy(dataset, tmp_path):
    store, bucket = dataset
    ds = RemoteDataset(store, bucket, "d", cache_dir=tmp_path / "cache", views=True)
    list(ds)
    second = list(ds)
    assert ds.metrics.cached_bytes > 0
    assert all(isinstance(s["jpg"].obj, mmap.mmap) for s in second)
    assert len({id(s["jpg"].obj) for s in second}) == SAMPLES // PER_SHARD  # one mapping a shard, not a range
    del second
    assert not cached_shard._mappings  # unmapped with the last view


def test_a_view_outlives_its_shard_file_and_the_cache_removing_it(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 16)
    shard = ShardFile(os.open(path, os.O_RDONLY), checked=True, size=4096)
    view = shard.view(4000, 96)
    assert view is not None and shard.view(4000, 97) is None and shard.view(-1, 2) is None
    shard.close()
    path.unlink()  # as eviction does: the mapping keeps the file it was made of
    assert bytes(view) == (bytes(range(256)) * 16)[4000:]


def test_a_shard_file_cut_short_before_it_is_mapped_gives_no_view(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(bytes(4096))
    shard = ShardFile(os.open(path, os.O_RDONLY), checked=True, size=4096)
    try:
        os.truncate(path, 4000)
        assert shard.view(0, 10) is None  # a mapping past the end would end the process at its first read
    finally:
        shard.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_views_leave_dataloader_workers_as_bytes(dataset, tmp_path, persistent):
    store, bucket = dataset
    ds = RemoteDataset(store, bucket, "d", cache_dir=tmp_path / "cache", views=True)
    expected = _members(RemoteDataset(store, bucket, "d", cache_dir=""))
    batches = DataLoader(ds.batched(4), batch_size=None, num_workers=2, persistent_workers=persistent)
    for _ in range(2):  # the second pass from the cache's mapped files
        samples = [dict(zip(batch.keys(), values, strict=True)) for batch in batches
                   for values in zip(*batch.values(), strict=True)]
        assert _field_types(samples) == {bytes}
        assert _members(samples) == expected


def test_views_is_a_flag(dataset):
    store, bucket = dataset
    with pytest.raises(ConfigError, match="views must be True or False"):
        RemoteDataset(store, bucket, "d", views="yes")


def test_a_pass_from_the_cache_gives_its_samples_while_the_manifest_is_read_again(seaweed, dataset, tmp_path):
    """The manifest read again as a pass from the cache begins (an overwrite would show there)
    is read beside the pass: every sample comes while that GET is held unanswered."""
    store, bucket = dataset
    proxy = FaultProxy(seaweed.endpoint_url, {})
    through = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
    try:
        ds = RemoteDataset(through, bucket, "d", cache_dir=tmp_path / "cache", views=True)
        expected = _members(ds)
        proxy.rates, proxy.paths = {"hold": 1.0}, MANIFEST_NAME
        items = iter(ds)
        got = [next(items) for _ in range(SAMPLES)]
        assert proxy.held == 1 and _members(got) == expected
        proxy.release()
        assert next(items, None) is None
    finally:
        through.close()
        proxy.close()
