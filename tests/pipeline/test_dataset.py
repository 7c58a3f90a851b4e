"""RemoteDataset against the embedded S3 server: coverage, order, workers and the chain."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import upload_cv_dataset
from remote_loader.pipeline.dataset import RemoteDataset
from remote_loader.synthetic import SyntheticImages


@pytest.fixture(scope="module")
def uploaded(seaweed):
    client = seaweed.client()
    bucket = "pipeline-tests"
    client.create_bucket(bucket)
    ds = SyntheticImages(97, size=(40, 30), num_classes=5)
    upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="few", maxcount=20, workers=0, progress=False)
    yield client, bucket, ds
    client.close()


def keys(dataset, num_workers):
    loader = DataLoader(dataset.map(lambda s: s["__key__"]), batch_size=None, num_workers=num_workers)
    return list(loader)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_every_sample_exactly_once(uploaded, world_size, num_workers):
    client, bucket, ds = uploaded
    seen = Counter()
    for rank in range(world_size):
        dataset = RemoteDataset(client, bucket, "few", rank=rank, world_size=world_size, equalize=False)
        got = keys(dataset, num_workers)
        assert len(got) == len(dataset)
        seen.update(got)
    assert seen == Counter(f"{i:06d}" for i in range(97))


def test_equalize_gives_every_rank_the_same_count(uploaded):
    client, bucket, _ = uploaded
    counts = [len(keys(RemoteDataset(client, bucket, "few", rank=r, world_size=3, equalize=True), 2)) for r in range(3)]
    assert counts == [33, 33, 33]


def test_order_is_seeded_per_epoch(uploaded):
    client, bucket, _ = uploaded
    dataset = RemoteDataset(client, bucket, "few", seed=5).shuffle(30)
    first = keys(dataset, 0)
    assert first == keys(dataset, 0)
    dataset.set_epoch(1)
    assert first != keys(dataset, 0) and sorted(first) == sorted(keys(dataset, 0))


def test_decode_to_tuple_map_tuple_batched_in_workers(uploaded):
    client, bucket, ds = uploaded
    dataset = (
        RemoteDataset(client, bucket, "few")
        .decode("pil")
        .to_tuple("jpg;png", "cls")
        .map_tuple(lambda im: torch.tensor(im.size), lambda x: x)
        .batched(16)
    )
    batches = list(DataLoader(dataset, num_workers=2, batch_size=None))
    sizes, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert len(labels) == 97 and sorted(Counter(labels.tolist()).values()) == sorted(Counter(ds.label(i) for i in range(97)).values())
    assert sizes.shape == (97, 2)
    short = [len(b[1]) for b in batches if len(b[1]) != 16]
    assert len(short) <= 2 and all(0 < n < 16 for n in short)  # at most one partial batch per worker


def test_bytes_only_samples_cross_worker_processes(uploaded):
    client, bucket, ds = uploaded
    samples = list(DataLoader(RemoteDataset(client, bucket, "few"), batch_size=None, num_workers=2))
    assert len(samples) == 97
    for sample in samples[:10]:
        assert sample["jpg"] == ds[int(sample["__key__"])][0]
