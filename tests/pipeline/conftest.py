"""The dataset the checkpoint tests share."""

from __future__ import annotations

import pytest

from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

CHECKPOINT_SAMPLES = 241  # odd: ranks of an equalised split repeat a sample


@pytest.fixture(scope="session")
def location(seaweed):
    """A client of the bucket holding the checkpoint tests' dataset ``d`` (shards of 20)."""
    client = seaweed.client()
    upload_to_new_bucket(
        client, "checkpoint-tests", "d", SyntheticImages(CHECKPOINT_SAMPLES, size=(32, 24)), maxcount=20
    )
    yield client
    client.close()
