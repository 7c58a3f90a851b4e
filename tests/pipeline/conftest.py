"""The dataset the checkpoint tests share."""

from __future__ import annotations

import pytest

from remote_loader import upload_cv_dataset
from remote_loader.testing.synthetic import SyntheticImages

CHECKPOINT_SAMPLES = 241  # odd: ranks of an equalised split repeat a sample


@pytest.fixture(scope="session")
def location(seaweed):
    """A client of the bucket holding the checkpoint tests' dataset ``d`` (shards of 20)."""
    client = seaweed.client()
    client.create_bucket("checkpoint-tests")
    upload_cv_dataset(SyntheticImages(CHECKPOINT_SAMPLES, size=(32, 24)), client=client, bucket="checkpoint-tests",
                      base_folder="d", maxcount=20, workers=0, progress=False)
    yield client
    client.close()
