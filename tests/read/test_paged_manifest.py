"""A dataset whose manifest is read by pages (version 3, its pages an object of their own):
each rank reads the pages of its own blocks only, every sample once, elastic resume and
random access on it; a damaged, missing or replaced pages object is reported by name
(against the embedded SeaweedFS, no mocked client calls)."""

from __future__ import annotations

import itertools
from collections import Counter

import msgpack
import pytest

from remote_loader import (
    ConfigError,
    CorruptShard,
    DatasetChanged,
    LocalitySampler,
    RemoteDataset,
    RemoteMapDataset,
)
from remote_loader.format import MANIFEST_NAME
from remote_loader.format import pages as paging
from remote_loader.read.reader import DatasetReader
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload

SAMPLES, PER_SHARD, ROWS = 60, 2, 4  # 30 shards in 8 pages of 4 (the last of 2)


@pytest.fixture
def paged(s3, monkeypatch):
    """A dataset of 30 shards whose manifest keeps its pages apart, 4 shards a page."""
    client, bucket = s3
    monkeypatch.setattr(paging, "PAGE_ROWS", ROWS)
    monkeypatch.setattr(paging, "INLINE_BYTES", 0)
    upload(client, bucket, "ds", SyntheticImages(SAMPLES, size=(8, 8)), maxcount=PER_SHARD)
    return client, bucket


def pages_object(client, bucket) -> str:
    head = msgpack.unpackb(client.get(bucket, f"ds/{MANIFEST_NAME}")[:-4])
    return str(head["pages"]["object"])


def keys(dataset) -> list[str]:
    return [sample["__key__"] for sample in dataset]


def test_each_rank_reads_the_pages_of_its_blocks_only_and_every_sample_once(paged):
    client, bucket = paged
    name = pages_object(client, bucket)
    assert name.endswith("manifest.pages") and client.head(bucket, f"ds/{name}") > 0
    seen: Counter[str] = Counter()
    for rank in range(4):
        dataset = RemoteDataset(client, bucket, "ds", rank=rank, world_size=4, seed=3)
        seen.update(keys(dataset))
        read = dataset._data.reader.manifest.shards.pages_read
        assert 1 <= read <= 3, f"rank {rank} read {read} of the 8 pages; its share is 2 blocks and a boundary"
    assert seen == Counter(f"{i:06d}" for i in range(SAMPLES))


def test_a_new_epoch_orders_blocks_and_shards_anew_with_every_sample_once(paged):
    client, bucket = paged
    dataset = RemoteDataset(client, bucket, "ds", seed=3)
    first = keys(dataset)
    dataset.set_epoch(1)
    second = keys(dataset)
    assert first != second and sorted(first) == sorted(second) == [f"{i:06d}" for i in range(SAMPLES)]


def test_random_access_reads_any_sample_by_its_page(paged):
    client, bucket = paged
    mapped = RemoteMapDataset(client, bucket, "ds", cache_pages=2)
    assert len(mapped) == SAMPLES
    one_by_one = [mapped[i]["__key__"] for i in range(SAMPLES)]  # pages read again and again through 2 kept
    assert sorted(one_by_one) == [f"{i:06d}" for i in range(SAMPLES)]
    batch = RemoteMapDataset(client, bucket, "ds").__getitems__(list(range(SAMPLES - 1, -1, -7)))
    assert [s["__key__"] for s in batch] == one_by_one[::-1][::7]


def test_a_locality_sampler_reads_each_page_once_an_epoch(paged):
    """Its windows follow the blocks of the epoch's order: one page at a time (two where a
    batch spans two blocks), each once."""
    client, bucket = paged
    mapped = RemoteMapDataset(client, bucket, "ds", cache_pages=2)
    seen: Counter[str] = Counter()
    for rank in range(2):
        sampler = LocalitySampler(mapped, window=2, seed=4, rank=rank, world_size=2)
        indices = list(sampler)
        for first in range(0, len(indices), 8):
            seen.update(s["__key__"] for s in mapped.__getitems__(indices[first : first + 8]))
    assert seen == Counter(f"{i:06d}" for i in range(SAMPLES))
    assert mapped.reader.manifest.shards.pages_read <= 8 + 2  # 8 pages; a rank's edge may share one


def test_states_taken_on_two_ranks_resume_on_three_exactly_once(paged):
    client, bucket = paged
    seen, states = [], []
    for rank in range(2):
        dataset = RemoteDataset(client, bucket, "ds", rank=rank, world_size=2, seed=5).shuffle(6)
        seen += [sample["__key__"] for sample in itertools.islice(dataset, 11)]
        states.append(dataset.state_dict())
    rest = []
    for rank in range(3):
        dataset = RemoteDataset(client, bucket, "ds", rank=rank, world_size=3, seed=5, equalize=False).shuffle(6)
        dataset.load_state_dict(states)
        rest += keys(dataset)
    assert len(seen) == 22 and Counter(seen + rest) == Counter(f"{i:06d}" for i in range(SAMPLES))


def test_a_page_cache_of_no_pages_is_refused(paged):
    client, bucket = paged
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="cache_pages"):
            DatasetReader(client, bucket, "ds", cache_pages=bad)


def test_damaged_pages_are_refused_naming_the_page(paged):
    client, bucket = paged
    name = pages_object(client, bucket)
    body = bytearray(client.get(bucket, f"ds/{name}"))
    body[5] ^= 0xFF  # inside page 0
    client.put(bucket, f"ds/{name}", bytes(body))
    with pytest.raises(CorruptShard, match=r"page 0 \(shards 0-3\) fails its crc32 check"):
        RemoteMapDataset(client, bucket, "ds")[0]


def test_pages_removed_under_a_reader_of_the_same_dataset_are_named(paged):
    client, bucket = paged
    name = pages_object(client, bucket)
    mapped = RemoteMapDataset(client, bucket, "ds")
    client.delete(bucket, f"ds/{name}")
    with pytest.raises(CorruptShard, match=f"manifest pages .*{name} are 0 bytes.*removed, truncated or replaced"):
        mapped[0]


def test_an_overwrite_under_a_reader_is_told_apart_and_removes_the_old_pages(paged):
    client, bucket = paged
    old = pages_object(client, bucket)
    mapped = RemoteMapDataset(client, bucket, "ds")
    upload(client, bucket, "ds", SyntheticImages(SAMPLES, size=(8, 8)), maxcount=PER_SHARD, seed=9, overwrite=True)
    new = pages_object(client, bucket)
    listed = {o.key for o in client.list(bucket, "ds/")}
    assert new != old and f"ds/{new}" in listed and f"ds/{old}" not in listed
    assert all(new.split("-manifest")[0] in key for key in listed if key.endswith((".tar", ".pages")))
    with pytest.raises(DatasetChanged, match="replaced by another upload"):
        mapped[0]
