"""Random access: RemoteMapDataset, batched fetches, samplers."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler

from remote_loader import RemoteDataset
from remote_loader.mapstyle.dataset import RemoteMapDataset
from remote_loader.mapstyle.samplers import LocalitySampler
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

N = 500


@pytest.fixture(scope="module")
def dataset500(seaweed):
    client = seaweed.client()
    upload_to_new_bucket(client, "map-tests", "d", SyntheticImages(N, size=(40, 30), formats=("jpeg", "png")),
                         maxcount=25, workers=2)
    yield client
    client.close()


def fields(sample):
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def test_getitem_equals_the_streamed_bytes_for_every_sample(dataset500):
    streamed = {s["__key__"]: fields(s) for s in RemoteDataset(dataset500, "map-tests", "d")}
    ds = RemoteMapDataset(dataset500, "map-tests", "d")
    assert len(ds) == N == len(streamed)
    got = {}
    for i in range(N):
        sample = ds[i]
        got[sample["__key__"]] = sample
    assert got == streamed
    assert ds[-1] == ds[N - 1]
    with pytest.raises(IndexError):
        ds[N]


def test_getitems_merges_samples_of_a_shard_into_few_gets(dataset500):
    ds = RemoteMapDataset(dataset500, "map-tests", "d")
    indices = list(range(50, 100))  # two whole shards
    for i in (50, 75):
        ds[i]  # warm the index cache
    before = ds.metrics.gets
    batch = ds.__getitems__(indices)
    assert ds.metrics.gets - before == 2
    assert [s["__key__"] for s in batch] == [ds[i]["__key__"] for i in indices]
    scattered = [3, 260, 4, 480, 3]
    expected = [ds[i]["__key__"] for i in scattered]  # also caches the three shards' indexes
    before = ds.metrics.gets
    assert [s["__key__"] for s in ds.__getitems__(scattered)] == expected
    assert ds.metrics.gets - before == 3  # 3 and 4 share a GET; the repeated 3 is fetched once
    ds.close()


def test_distributed_sampler_covers_every_index_once(dataset500):
    ds = RemoteMapDataset(dataset500, "map-tests", "d", transform=lambda s: s["__key__"])
    seen = Counter()
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=1)
        for batch in DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2):
            seen.update(batch)
    assert len(seen) == N and set(seen.values()) == {1}


def test_locality_sampler_order_split_and_coverage():
    sizes = [25] * 20
    parts = [list(LocalitySampler(sizes, window=4, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == 250
    assert sorted(parts[0] + parts[1]) == list(range(500))
    sampler = LocalitySampler(sizes, window=4, seed=3, rank=0, world_size=1)
    sampler.set_epoch(0)
    first = list(sampler)
    assert first == list(sampler)  # an epoch set: followed exactly
    sampler.set_epoch(1)
    assert first != list(sampler)
    # A window of 4 shards: the first 100 indices come from exactly 4 shards.
    assert len({i // 25 for i in first[:100]}) == 4
    uneven = [list(LocalitySampler([7, 3], window=1, rank=r, world_size=3)) for r in range(3)]
    assert all(len(u) == 4 for u in uneven) and set(sum(uneven, [])) == set(range(10))


def gets_per_batch(ds, order, batch=64):
    before = ds.metrics.gets
    batches = 0
    for b in range(0, len(order) - batch + 1, batch):
        ds.__getitems__(order[b : b + batch])
        batches += 1
    return (ds.metrics.gets - before) / batches


def test_locality_sampler_needs_fewer_gets_than_uniform(dataset500):
    ds = RemoteMapDataset(dataset500, "map-tests", "d", cache_shards=100)
    ds.__getitems__(list(range(0, N, 25)))  # every index cached: count sample GETs only
    uniform = gets_per_batch(ds, np.random.default_rng(0).permutation(N).tolist())
    local = {k: gets_per_batch(ds, list(LocalitySampler(ds, window=k, seed=0))) for k in (1, 4, 16)}
    assert local[1] < local[4] < local[16] <= uniform
    assert local[1] <= 4
    ds.close()


def test_map_dataset_pickles_into_workers_with_a_cold_cache(dataset500):
    ds = RemoteMapDataset(dataset500, "map-tests", "d", transform=lambda s: s["__key__"])
    ds[0]
    keys = [k for batch in DataLoader(ds, batch_size=50, num_workers=2) for k in batch]
    assert keys == [ds[i] for i in range(N)]


def test_map_dataset_used_in_the_parent_then_forked_into_workers(dataset500):
    """A validation pass in the parent fetches on threads and fills its caches; forked
    workers (where those threads do not exist) fetch their batches on threads of their own."""
    ds = RemoteMapDataset(dataset500, "map-tests", "d", transform=lambda s: s["__key__"])
    parent = ds.__getitems__(list(range(0, 100)))
    loader = DataLoader(ds, batch_size=50, num_workers=2, multiprocessing_context="fork", timeout=120)
    keys = [k for batch in loader for k in batch]
    assert keys[:100] == parent
    assert keys == [ds[i] for i in range(N)]
    ds.close()


def test_a_sample_is_found_by_its_index_in_the_uploaded_dataset_skipped_ones_named(s3):
    from tests.helpers import FlakyImages, upload

    client, bucket = s3
    source = FlakyImages(90, {4, 50}, size=(16, 12))
    upload(client, bucket, "skips", source, maxcount=7, workers=2, on_error="skip")
    ds = RemoteMapDataset(client, bucket, "skips")
    assert [int(ds[i]["__key__"]) for i in range(5)] != [0, 1, 2, 3, 5]  # positions follow the shuffled order
    for j in range(90):
        if j in (4, 50):
            with pytest.raises(IndexError, match=rf"ds\[{j}\] was skipped at upload"):
                ds.by_source_index(j)
        else:
            sample = ds.by_source_index(j)
            assert int(sample["__key__"]) == j and bytes(sample["jpg"]) == source.encoded(j)
    with pytest.raises(IndexError, match="source index 90 out of range for the 90 items"):
        ds.position_of(90)


def test_a_dataset_overwritten_under_random_access_says_what_reads_the_new_upload(tmp_path):
    from remote_loader import DatasetChanged, LocalStore
    from tests.helpers import upload

    store = LocalStore(tmp_path)
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(20, size=(16, 12)), maxcount=10)
    ds = RemoteMapDataset(store, "b", "d")
    assert ds[0]["__key__"].isdigit()  # read before the overwrite
    ds.members_of(3)  # its shard's index kept: a member read next goes straight to the shard
    upload(store, "b", "d", SyntheticImages(12, size=(16, 12), seed=5), maxcount=10, overwrite=True)
    with pytest.raises(DatasetChanged, match="make a new RemoteMapDataset"):
        ds[15]
    with pytest.raises(DatasetChanged, match="make a new RemoteMapDataset"):
        ds.read_member(3, "jpg")  # a part of a long video is read this way
    assert len(RemoteMapDataset(store, "b", "d")) == 12


def test_a_member_is_read_whole_checked_or_in_parts(tmp_path):
    from remote_loader import CorruptSampleError, LocalStore

    store = LocalStore(str(tmp_path))
    upload_to_new_bucket(store, "b", "d", SyntheticImages(6, size=(40, 30)), maxcount=3)
    ds = RemoteMapDataset(store, "b", "d")
    key, members = ds.members_of(4)
    whole = ds.by_source_index(4)
    assert key == whole["__key__"] and set(members) == {"jpg", "cls"} and members["jpg"][0] == len(whole["jpg"])
    assert ds.read_member(4, "jpg") == whole["jpg"] and ds.read_member(4, "jpg", 10, 30) == whole["jpg"][10:30]
    with pytest.raises(KeyError, match="has no field 'png'"):
        ds.read_member(4, "png")
    with pytest.raises(ValueError, match="not within field 'jpg'"):
        ds.read_member(4, "jpg", 0, members["jpg"][0] + 1)
    shard = next(p for p in tmp_path.rglob("*.tar") if whole["jpg"] in p.read_bytes())  # JPEGs' heads are alike
    data = bytearray(shard.read_bytes())
    at = data.index(whole["jpg"]) + 100
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = RemoteMapDataset(store, "b", "d")
    assert fresh.read_member(4, "jpg", 0, 50) == whole["jpg"][:50]  # a part: not checked, and it is intact
    with pytest.raises(CorruptSampleError, match=f"field 'jpg' of sample '{key}'"):
        fresh.read_member(4, "jpg")


def test_an_index_that_is_not_an_int_is_refused_naming_it(dataset500):
    """A float was taken for its floor (``ds[1.9]`` gave ``ds[1]``), a bool for 0 or 1, and a
    string or slice raised a comparison's TypeError from inside."""
    import torch

    ds = RemoteMapDataset(dataset500, "map-tests", "d")
    for bad in (1.9, np.float32(2.5), True, "2", slice(0, 3), None, np.array([1, 2]), torch.tensor(1.0),
                torch.tensor(True), np.array([3]), torch.tensor([3])):
        with pytest.raises(TypeError, match="a sample index is an int, got "):
            ds[bad]
    with pytest.raises(TypeError, match="got float 1.7"):
        ds.__getitems__([1, 1.7])
    assert ds[np.int64(2)] == ds[torch.tensor(2)] == ds[2]


def test_an_index_asked_twice_in_a_batch_gives_a_sample_of_its_own_each_time(dataset500):
    """As ``ds[i]`` twice would: a transform that changes its sample in place got the same
    dict twice (and failed on what it had made of it the first time)."""
    def label(sample):
        sample["cls"] = int(bytes(sample.pop("cls")))
        return sample

    ds = RemoteMapDataset(dataset500, "map-tests", "d", transform=label)
    once = ds[1]
    twice = ds.__getitems__([1, 7, 1])
    assert twice[0] == twice[2] == once and twice[0] is not twice[2]
    plain = RemoteMapDataset(dataset500, "map-tests", "d").__getitems__([3, 3])
    assert plain[0] == plain[1] and plain[0] is not plain[1]
