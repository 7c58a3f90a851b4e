"""Plain tars streamed without an index (``unindexed=True``): every tar's samples, once, and
what is done with a tar that cannot be read."""

from __future__ import annotations

import io
import logging
import tarfile
from collections import Counter
from collections.abc import Iterator

import pytest
from torch.utils.data import DataLoader

from remote_loader import CorruptShard, LocalStore, ObjectNotFound, RemoteDataset
from remote_loader.storage.base import ObjectInfo


def tar_of(keys: list[str], size: int = 100) -> bytes:
    """A tar as tarfile (WebDataset's TarWriter) writes it: one ``.txt`` member a sample."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key in keys:
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = size
            tar.addfile(info, io.BytesIO(key.encode().ljust(size, b".")))
    return buffer.getvalue()


def keys_of(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{j:03d}" for j in range(count)]


class ListedBefore:
    """A store whose ``list`` answers with a listing taken earlier (``take_listing``), before
    some objects were rewritten or deleted: the listing a pass took as it began, the objects
    changing after it and before they were fetched. All else is the store's own."""

    earlier: tuple[str, list[ObjectInfo]] | None = None

    def take_listing(self, bucket: str, prefix: str) -> None:
        self.earlier = bucket, list(super().list(bucket, prefix))

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        if self.earlier is None or self.earlier[0] != bucket:
            yield from super().list(bucket, prefix, start_after=start_after)
            return
        for info in self.earlier[1]:
            if info.key.startswith(prefix) and (start_after is None or info.key > start_after):
                yield info


class LocalListedBefore(ListedBefore, LocalStore):
    pass


def delivered(ds: RemoteDataset, num_workers: int = 0) -> Counter[str]:
    return Counter(s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=num_workers))


# --------------------------------------------------------------------------- every tar, once


@pytest.mark.parametrize("open_shards", [1, 2, 4])
def test_every_tar_is_read_whatever_the_tars_read_at_once(tmp_path, open_shards):
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    for t in range(6):
        store.put("b", f"ds/s{t}.tar", tar_of(keys_of(f"t{t}-", 3 + t)))
    ds = RemoteDataset(store, "b", "ds", unindexed=True, open_shards=open_shards, seed=5)
    assert delivered(ds) == Counter(key for t in range(6) for key in keys_of(f"t{t}-", 3 + t))


# --------------------------------------------------------------------------- tars that cannot be read


@pytest.fixture
def with_bad_tars(tmp_path):
    """Good tars s0 and s3 beside a tar that is no tar (s1), one cut inside a member (s2), and
    s4, in the pass's listing but deleted before it was fetched."""
    store = LocalListedBefore(tmp_path)
    store.create_bucket("b")
    store.put("b", "ds/s0.tar", tar_of(keys_of("a", 7)))
    store.put("b", "ds/s1.tar", b"not a tar" * 100)
    store.put("b", "ds/s2.tar", tar_of(keys_of("c", 3), size=600)[:1000])
    store.put("b", "ds/s3.tar", tar_of(keys_of("d", 5)))
    store.put("b", "ds/s4.tar", tar_of(keys_of("e", 2)))
    store.take_listing("b", "ds/")
    store.delete("b", "ds/s4.tar")
    return store


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_passes_over_tars_that_cannot_be_read_and_reads_the_others(with_bad_tars, caplog, num_workers):
    ds = RemoteDataset(with_bad_tars, "b", "ds", unindexed=True, on_error="skip", seed=3)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        got = delivered(ds, num_workers)
    assert got == Counter(keys_of("a", 7) + keys_of("d", 5))  # every good sample, exactly once
    assert ds.metrics.skipped == 3  # one a tar skipped whole: its samples were never counted
    if num_workers == 0:  # log records of worker processes do not reach caplog
        skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]
        assert len(skipped) == 3 and all("\n" not in m for m in skipped), skipped
        for name, error in (("s1.tar", "no valid tar header"), ("s2.tar", ""), ("s4.tar", "")):
            assert any(name in m and error in m for m in skipped), (name, skipped)


@pytest.mark.parametrize("bad, error", [("s1.tar", CorruptShard), ("s4.tar", ObjectNotFound)])
def test_raise_stops_at_a_tar_that_cannot_be_read_with_its_own_error(tmp_path, bad, error):
    store = LocalListedBefore(tmp_path)
    store.create_bucket("b")
    store.put("b", "ds/s0.tar", tar_of(keys_of("a", 3)))
    store.put("b", f"ds/{bad}", b"not a tar" * 100 if bad == "s1.tar" else tar_of(keys_of("e", 2)))
    store.take_listing("b", "ds/")
    if bad == "s4.tar":
        store.delete("b", f"ds/{bad}")
    ds = RemoteDataset(store, "b", "ds", unindexed=True, shuffle_shards=False, open_shards=1)
    got = []
    with pytest.raises(error, match=bad) as caught:
        for sample in ds:
            got.append(sample["__key__"])
    assert type(caught.value) is error and "\n" not in str(caught.value)
    assert got == keys_of("a", 3) and ds.metrics.skipped == 0
    if bad == "s1.tar":
        assert caught.value.name == "s1.tar"
