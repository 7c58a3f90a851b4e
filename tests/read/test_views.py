"""``views=True``: members as read-only memoryviews, of the mapped file where the node's cache
holds the shard (no copy), the same bytes as without; a view never leaves a DataLoader worker
(it arrives as bytes, in whatever holds it) and never meets torch's default conversion (which
would take it for a sequence of ints); a file that cannot be mapped is read as without views;
a pass from the cache does not wait for the manifest's GET, and an overwrite its check finds
is raised once, by a later pass where the one that asked ended first."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
from collections import Counter, OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
from torch.utils.data import DataLoader

from remote_loader import ConfigError, DatasetChanged, RemoteDataset, RemoteMapDataset, loader, make_client
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


Pair = namedtuple("Pair", "image label")


@dataclass
class Boxed:
    image: object


def _pair(sample):
    return Pair(sample["jpg"], sample["cls"])


def _ordered(sample):
    return OrderedDict(jpg=sample["jpg"], cls=sample["cls"])


def _boxed(sample):
    return Boxed(sample["jpg"])


@pytest.fixture
def cached(dataset, tmp_path):
    """A views dataset whose cache holds every shard, and its members as bytes."""
    store, bucket = dataset
    ds = RemoteDataset(store, bucket, "d", cache_dir=tmp_path / "cache", views=True)
    expected = _members(ds)
    return ds, expected


def _dataloaders():
    kinds = [DataLoader]
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return kinds
    return [*kinds, StatefulDataLoader]


@pytest.mark.parametrize("kind", _dataloaders(), ids=lambda k: k.__name__)
def test_a_dataloader_without_workers_and_its_default_conversion_gets_bytes(cached, kind):
    ds, expected = cached
    samples = list(kind(ds, batch_size=None, num_workers=0))
    assert _field_types(samples) == {bytes} and _members(samples) == expected
    batches = list(kind(ds.batched(4), batch_size=None, num_workers=0))
    assert {type(v) for b in batches for v in b["jpg"]} == {bytes}
    collated = next(iter(kind(ds, batch_size=4, num_workers=0)))  # torch's default_collate: no error
    assert {type(v) for v in collated["jpg"]} == {bytes}
    assert {type(v) for b in loader(ds.batched(4), num_workers=0) for v in b["jpg"]} == {bytes}


class _Counted(RemoteDataset):
    """A subclass with an ``__iter__`` of its own, as users write them."""

    def __iter__(self):
        yield from super().__iter__()


def test_a_subclass_with_its_own_iter_gets_bytes_through_the_default_conversion(dataset, tmp_path):
    store, bucket = dataset
    ds = _Counted(store, bucket, "d", cache_dir=tmp_path / "cache", views=True)
    samples = list(DataLoader(ds, batch_size=None, num_workers=0))
    assert _field_types(samples) == {bytes} and len(samples) == SAMPLES


def test_a_collate_fn_of_ones_own_takes_views_as_they_are(cached):
    ds, expected = cached
    samples = list(DataLoader(ds, batch_size=None, num_workers=0, collate_fn=lambda item: item))
    assert _field_types(samples) == {memoryview} and _members(samples) == expected


@pytest.mark.parametrize(("make", "kind"), [(_pair, Pair), (_ordered, OrderedDict)])
def test_a_view_leaves_a_worker_as_bytes_in_a_container_of_its_own_type(cached, make, kind):
    ds, _ = cached
    out = list(DataLoader(ds.map(make), batch_size=None, num_workers=1, timeout=60))
    assert len(out) == SAMPLES and {type(item) for item in out} == {kind}
    assert {type(v) for item in out for v in (item.values() if kind is OrderedDict else item)} == {bytes}


def test_a_view_inside_an_object_leaves_a_worker_as_bytes(cached):
    ds, expected = cached
    out = list(DataLoader(ds.map(_boxed), batch_size=None, num_workers=1, timeout=60, collate_fn=lambda x: x))
    assert {type(item.image) for item in out} == {bytes}
    assert Counter(item.image for item in out) == Counter(jpg for _, jpg, _ in expected)


def test_a_cached_file_that_cannot_be_mapped_is_read_as_without_views(cached, monkeypatch):
    """FUSE with direct_io (before Linux 6.6) answers mmap with ENODEV: each member is then a
    view of its copy, read from the file, not fetched again from the store."""
    ds, expected = cached

    class Unmappable:
        PROT_READ = mmap.PROT_READ

        @staticmethod
        def mmap(*args, **kwargs):
            raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(cached_shard, "mmap", Unmappable)
    fetched = ds.metrics.bytes
    samples = list(ds)
    assert _field_types(samples) == {memoryview} and _members(samples) == expected
    assert ds.metrics.bytes == fetched


def test_the_map_style_dataset_refuses_views_and_connection_options_with_a_store(dataset, tmp_path):
    store, bucket = dataset
    with pytest.raises(ConfigError, match="views is RemoteDataset's: RemoteMapDataset gives each member as bytes"):
        RemoteMapDataset(store, bucket, "d", views=True)
    with pytest.raises(ConfigError, match="endpoint_url: connection options go with a URL, not a store"):
        RemoteMapDataset(store, bucket, "d", endpoint_url="http://127.0.0.1:9")


def test_an_overwrite_found_after_a_pass_ended_is_raised_by_the_next_pass(seaweed, dataset, tmp_path):
    """Passes cut short (N steps an epoch), each before its manifest check answered: the next
    pass takes the last one's answer first and raises DatasetChanged, once; the one after
    reads the new upload."""
    store, bucket = dataset
    proxy = FaultProxy(seaweed.endpoint_url, {})
    through = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
    try:
        ds = RemoteDataset(through, bucket, "d", cache_dir=tmp_path / "cache", views=True)
        list(ds)
        upload(store, bucket, "d", SyntheticImages(30, size=(20, 14), num_classes=3, seed=5), maxcount=10,
               overwrite=True)
        new = _members(RemoteDataset(store, bucket, "d", cache_dir=""))
        proxy.rates, proxy.paths = {"hold": 1.0}, MANIFEST_NAME
        assert len(list(itertools.islice(ds, 8))) == 8  # the old upload's, from the cache
        assert proxy.held == 1
        proxy.release(hold_again=True)  # that check answers; the next pass's own would wait
        with pytest.raises(DatasetChanged, match="the next pass reads the new upload"):
            list(itertools.islice(ds, 8))
        proxy.release()
        assert _members(ds) == new and _members(ds) == new
    finally:
        through.close()
        proxy.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_over_views_resumes_each_sample_once_with_its_bytes(dataset, tmp_path, workers):
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    store, bucket = dataset

    def pipeline() -> RemoteDataset:
        return RemoteDataset(store, bucket, "d", seed=7, cache_dir=tmp_path / "cache", views=True).shuffle(10)

    expected = _members(pipeline())  # fills the cache: what follows reads its files' mappings
    for stop in (3, 17):
        first = StatefulDataLoader(pipeline(), batch_size=None, num_workers=workers, collate_fn=_as_given)
        seen = []
        for sample in first:
            seen.append(sample)
            if len(seen) == stop:
                state = first.state_dict()
                break
        resumed = StatefulDataLoader(pipeline(), batch_size=None, num_workers=workers, collate_fn=_as_given)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert _members(seen + rest) == expected, stop
        assert _field_types(seen + rest) == ({memoryview} if workers == 0 else {bytes})


def _as_given(item):
    return item
