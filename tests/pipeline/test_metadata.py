"""Manifest metadata in the pipeline: versions 1 and 2 give the same epochs, version 3 (read by
pages) every sample once too, and workers share the manifest read by the main process instead
of fetching or copying it."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from remote_loader import DatasetChanged, RemoteMapDataset
from remote_loader.format import MANIFEST_NAME, Manifest, epoch_order
from remote_loader.pipeline.dataset import RemoteDataset
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket


@pytest.fixture(scope="module")
def versions(seaweed):
    """The same dataset under "v3" (as uploaded), and "v2" and "v1" (its manifest rewritten as
    versions 2 and 1, as earlier releases wrote them)."""
    client = seaweed.client()
    bucket = "metadata-tests"
    upload_to_new_bucket(client, bucket, "v3", SyntheticImages(131, size=(32, 24), num_classes=5), maxcount=9)
    manifest = Manifest.decode(client.get(bucket, f"v3/{MANIFEST_NAME}"))
    assert manifest.version == 3
    table = manifest.shards.table()
    for version in (1, 2):
        for entry in table:
            client.put(bucket, f"v{version}/{entry.name}", client.get(bucket, f"v3/{entry.name}"))
        client.put(bucket, f"v{version}/{MANIFEST_NAME}",
                   dataclasses.replace(manifest, shards=table, version=version).encode())
    yield client, bucket
    client.close()


def keys(dataset, num_workers):
    return list(DataLoader(dataset.map(lambda s: s["__key__"]), batch_size=None, num_workers=num_workers))


@pytest.mark.parametrize("equalize", [False, True])
def test_versions_1_and_2_give_the_same_epochs_exactly_once(versions, equalize):
    client, bucket = versions
    by_version = {}
    for version in ("v1", "v2"):
        ranks = [keys(RemoteDataset(client, bucket, version, rank=r, world_size=3, equalize=equalize, seed=4)
                      .shuffle(20), 2) for r in range(3)]
        by_version[version] = ranks
    assert by_version["v1"] == by_version["v2"]
    seen = Counter(k for rank in by_version["v2"] for k in rank)
    if equalize:
        assert [len(r) for r in by_version["v2"]] == [44, 44, 44]
        assert set(seen) == {f"{i:06d}" for i in range(131)} and sum(seen.values()) == 132
    else:
        assert seen == Counter(f"{i:06d}" for i in range(131))
    v1, v2, v3 = (RemoteMapDataset(client, bucket, v) for v in ("v1", "v2", "v3"))
    assert len(v1) == len(v2) == len(v3) == 131
    assert all(v1[i] == v2[i] == v3[i] for i in (0, 8, 9, 64, 130))


@pytest.mark.parametrize("equalize", [False, True])
def test_version_3_gives_every_sample_once_a_new_order_each_epoch(versions, equalize):
    client, bucket = versions
    epochs = []
    for epoch in (0, 1):
        ranks = []
        for r in range(3):
            dataset = RemoteDataset(client, bucket, "v3", rank=r, world_size=3, equalize=equalize, seed=4)
            dataset.set_epoch(epoch)
            ranks.append(keys(dataset.shuffle(20), 2))
        seen = Counter(k for rank in ranks for k in rank)
        assert set(seen) == {f"{i:06d}" for i in range(131)}
        assert sum(seen.values()) == (132 if equalize else 131)
        epochs.append(ranks)
    assert epochs[0] != epochs[1]


def test_forked_workers_share_the_manifest_read_at_construction(versions):
    client, bucket = versions
    for entry in Manifest.decode(client.get(bucket, f"v2/{MANIFEST_NAME}")).shards:
        client.put(bucket, f"gone/{entry.name}", client.get(bucket, f"v2/{entry.name}"))
    client.put(bucket, f"gone/{MANIFEST_NAME}", client.get(bucket, f"v2/{MANIFEST_NAME}"))
    dataset = RemoteDataset(client, bucket, "gone")
    client.delete(bucket, f"gone/{MANIFEST_NAME}")  # workers cannot fetch it: they must use the parent's
    got = list(DataLoader(dataset.map(lambda s: s["__key__"]), batch_size=None, num_workers=2,
                          multiprocessing_context=multiprocessing.get_context("fork")))
    assert Counter(got) == Counter(f"{i:06d}" for i in range(131))


def test_pickles_carry_no_manifest_and_a_spawned_worker_checks_it_fetched_the_same(versions):
    client, bucket = versions
    stream, mapped = RemoteDataset(client, bucket, "v2"), RemoteMapDataset(client, bucket, "v2")
    for dataset in (stream, mapped):
        data = pickle.dumps(dataset)
        assert b"shard-" not in data and b"ShardTable" not in data and b"Manifest" not in data
    again = pickle.loads(pickle.dumps(mapped))
    assert again[5] == mapped[5]
    # A spawned worker fetches the manifest once and refuses one from another upload.
    moved = pickle.loads(pickle.dumps(stream))
    original = client.get(bucket, f"v2/{MANIFEST_NAME}")
    client.put(bucket, f"v2/{MANIFEST_NAME}", client.get(bucket, f"v1/{MANIFEST_NAME}"))
    try:
        with pytest.raises(DatasetChanged, match="replaced by another upload"):
            len(moved)
    finally:
        client.put(bucket, f"v2/{MANIFEST_NAME}", original)
    assert len(pickle.loads(pickle.dumps(stream))) == 131


@pytest.mark.parametrize("epoch", [0, 3])
def test_forked_workers_take_the_epochs_shard_order_from_the_main_process(versions, monkeypatch, epoch):
    """Made at construction (epoch 0) and at set_epoch, before the workers fork: a worker
    that had to permute the shards itself would fail here."""
    client, bucket = versions
    expected = keys(RemoteDataset(client, bucket, "v2", seed=11).shuffle(20), 0) if epoch == 0 else None
    dataset = RemoteDataset(client, bucket, "v2", seed=11)
    if epoch:
        fresh = RemoteDataset(client, bucket, "v2", seed=11)
        fresh.set_epoch(epoch)
        expected = keys(fresh.shuffle(20), 0)
        dataset.set_epoch(epoch)

    def refuse(*args: object) -> None:
        raise AssertionError("a worker permuted the shards itself")

    monkeypatch.setattr(epoch_order, "shard_order", refuse)
    got = list(DataLoader(dataset.shuffle(20).map(lambda s: s["__key__"]), batch_size=None, num_workers=2,
                          multiprocessing_context=multiprocessing.get_context("fork")))
    assert Counter(got) == Counter(f"{i:06d}" for i in range(131))
    assert sorted(got) == sorted(expected)
    in_process = list(DataLoader(dataset.shuffle(20).map(lambda s: s["__key__"]), batch_size=None, num_workers=0))
    assert in_process == expected  # the same order as one made afresh
    assert dataset._data.orders._last is not None and pickle.loads(pickle.dumps(dataset))._data.orders._last is None
