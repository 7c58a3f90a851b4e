"""A full epoch of 2,000 class-ordered images through a DataLoader with two workers."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import upload_cv_dataset
from remote_loader.pipeline.dataset import RemoteDataset
from remote_loader.testing.synthetic import SyntheticImages


@pytest.fixture(scope="module")
def class_ordered(seaweed):
    """2,000 images of 10 classes written in class order: upload-time shuffling switched off."""
    client = seaweed.client()
    client.create_bucket("epoch-tests")
    ds = SyntheticImages(2000, size=(64, 48), num_classes=10)
    upload_cv_dataset(ds, client=client, bucket="epoch-tests", base_folder="ordered", maxcount=50, shuffle=False,
                      workers=2, progress=False)
    yield client, ds
    client.close()


def adjacent_equal(labels):
    """Fraction of neighbours with the same label: ~0.1 for a uniform shuffle of 10 balanced classes."""
    return float(np.mean(np.diff(labels) == 0))


def crop(image):
    """A fixed 32x32 corner: images differ in size, batches need one."""
    return image[:, :32, :32]


def test_full_epoch_with_two_workers(class_ordered):
    client, ds = class_ordered
    dataset = (
        RemoteDataset(client, "epoch-tests", "ordered", open_shards=8, seed=1)
        .shuffle(1000)
        .decode("torchrgb")
        .to_tuple("jpg", "cls", "__key__")
        .map_tuple(crop, None, None)
        .batched(64)
    )
    labels, keys = [], []
    for batch_images, batch_labels, batch_keys in DataLoader(dataset, batch_size=None, num_workers=2):
        assert batch_images.dtype == torch.uint8 and batch_images.shape[1:] == (3, 32, 32) and len(batch_images) <= 64
        labels.extend(batch_labels.tolist())
        keys.extend(batch_keys)
    assert Counter(keys) == Counter(f"{i:06d}" for i in range(2000))
    assert all(ds.label(int(k)) == label for k, label in zip(keys, labels, strict=True))
    # Class order in storage, yet the stream is close to a uniform shuffle.
    assert adjacent_equal(labels[:1000]) < 0.16


def test_without_mixing_class_order_shows(class_ordered):
    """The control for the statistic above: one shard at a time, no buffer."""
    client, _ = class_ordered
    labels = [int(bytes(s["cls"])) for s in RemoteDataset(client, "epoch-tests", "ordered", open_shards=1)]
    assert adjacent_equal(labels[:1000]) > 0.9
