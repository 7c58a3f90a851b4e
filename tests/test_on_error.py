"""``on_error`` is decided once, into an ``OnError``: the string and the member mean the same
everywhere, and what an upload records of it is the string."""

from __future__ import annotations

import pytest

from remote_loader import ConfigError, LocalStore, OnError, RemoteDataset
from remote_loader.format import MANIFEST_NAME, Manifest
from tests.helpers import FlakyImages, upload


@pytest.mark.parametrize("given", ["skip", OnError.SKIP])
def test_the_string_and_the_member_are_one_policy(given):
    assert OnError.of(given) is OnError.SKIP
    assert OnError.of(given).skips and not OnError.of("raise").skips


@pytest.mark.parametrize("given", ["Skip", "ignore", None, True, 1])
def test_anything_else_is_refused_in_one_line(given):
    with pytest.raises(ConfigError, match=r"^on_error must be 'raise' or 'skip', got ") as caught:
        OnError.of(given)
    assert "\n" not in str(caught.value)


def test_an_upload_given_the_member_records_the_string_and_skips(tmp_path):
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    summary = upload(store, "b", "d", FlakyImages(12, bad={3, 7}, size=(16, 16)), maxcount=5, on_error=OnError.SKIP)
    assert summary.skipped == 2
    manifest = Manifest.decode(store.get("b", f"d/{MANIFEST_NAME}"))
    assert manifest.params["upload"]["on_error"] == "skip" and type(manifest.params["upload"]["on_error"]) is str
    again = upload(store, "b", "d", FlakyImages(12, bad={3, 7}, size=(16, 16)), maxcount=5, on_error="skip")
    assert again.kept_samples == 10  # the same upload: nothing written again

    ds = RemoteDataset(store, "b", "d", on_error=OnError.SKIP, seed=1)
    assert ds.on_error is OnError.SKIP
    assert ds.decode("rgb8").to_tuple("__key__").on_error is OnError.SKIP
    assert sorted(key for (key,) in ds.to_tuple("__key__")) == sorted(f"{i:06d}" for i in range(12) if i not in (3, 7))
