"""``on_error="skip"`` leaves out a sample whose image does not decode on the CPU path as the
GPU path does (counted, logged), and exactly once across a resume; with ``"raise"`` the
DecodeError names the sample's key and field."""

from __future__ import annotations

from collections import Counter

import pytest

from remote_loader import DecodeError, RandomResizedCrop, RemoteDataset
from tests.helpers import Undecodable, upload_to_new_bucket

N, BROKEN = 12, 5


@pytest.fixture(scope="module")
def client(seaweed):
    store = seaweed.client()
    upload_to_new_bucket(store, "decode-skip", "d", Undecodable(N, size=(48, 32), broken=BROKEN), maxcount=6)
    return store


@pytest.mark.parametrize("threads", [0, 2])
def test_an_image_that_does_not_decode_is_skipped_and_counted(client, threads):
    ds = (RemoteDataset(client, "decode-skip", "d", on_error="skip")
          .decode(RandomResizedCrop(16), threads=threads).to_tuple("__key__", "jpg"))
    keys = [int(key) for key, image in ds]
    assert sorted(keys) == [i for i in range(N) if i != BROKEN]
    assert ds.metrics.skipped == 1


def test_with_raise_the_error_names_the_sample_and_field(client):
    ds = RemoteDataset(client, "decode-skip", "d").decode(RandomResizedCrop(16))
    with pytest.raises(DecodeError, match=r"field 'jpg' of sample '0*5' in \S+: not a decodable image") as caught:
        list(ds)
    assert int(caught.value.key) == BROKEN and caught.value.field == "jpg"


def test_a_worker_state_after_a_skipped_sample_resumes_exactly_once(client):
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    def pipeline() -> RemoteDataset:
        return (RemoteDataset(client, "decode-skip", "d", seed=4, on_error="skip")
                .decode(RandomResizedCrop(16), threads=2).to_tuple("__key__"))

    for stop in (2, 5, 9):
        loader = StatefulDataLoader(pipeline(), batch_size=None, num_workers=2)
        seen = []
        for (key,) in loader:
            seen.append(key)
            if len(seen) == stop:
                state = loader.state_dict()
                break
        resumed = StatefulDataLoader(pipeline(), batch_size=None, num_workers=2)
        resumed.load_state_dict(state)
        rest = [key for (key,) in resumed]
        assert Counter(seen + rest) == Counter(f"{i:0{len(seen[0])}d}" for i in range(N) if i != BROKEN), stop
