"""Plain tars streamed without an index (``unindexed=True``): every tar's samples, once, what
is done with a tar that cannot be read or not the size the pass listed, and which objects
are left out."""

from __future__ import annotations

import gzip
import io
import logging
import tarfile
from collections import Counter
from collections.abc import Iterator

import pytest
from torch.utils.data import DataLoader

from remote_loader import CorruptShard, LocalStore, ObjectNotFound, RemoteDataset, TruncatedShard
from remote_loader.storage.base import ObjectInfo
from remote_loader.storage.s3_boto3 import Boto3Store
from tests.conftest import new_bucket


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


class S3ListedBefore(ListedBefore, Boto3Store):
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


# --------------------------------------------------------------------------- tars changed after the listing


@pytest.fixture(params=["local", "seaweedfs"])
def listed_before(request, tmp_path):
    """A store whose listing can be taken before its tars change: a local directory, or
    SeaweedFS through boto3 (the object's size from the GET's ``Content-Range``)."""
    if request.param == "local":
        store: ListedBefore = LocalListedBefore(tmp_path)
        bucket = "b"
        store.create_bucket(bucket)
        yield store, bucket
        return
    seaweed = request.getfixturevalue("seaweed")
    store = S3ListedBefore(seaweed.client().config)
    bucket = new_bucket(store)
    yield store, bucket
    store.close()


@pytest.mark.parametrize("change", ["grown", "shrunk"])
def test_a_tar_rewritten_after_the_listing_is_never_read_short(listed_before, change, caplog):
    store, bucket = listed_before
    listed, now = (keys_of("k", 40), keys_of("k", 60)) if change == "grown" else (keys_of("k", 60), keys_of("k", 40))
    store.put(bucket, "ds/s0.tar", tar_of(listed))
    store.put(bucket, "ds/s1.tar", tar_of(keys_of("m", 9)))
    store.take_listing(bucket, "ds/")
    store.put(bucket, "ds/s0.tar", tar_of(now))  # rewritten after the pass listed it
    sizes = len(tar_of(now)), len(tar_of(listed))
    assert len(tar_of(keys_of("k", 40))) == 51_200  # a record boundary: the listed size cuts the tar between members

    ds = RemoteDataset(store, bucket, "ds", unindexed=True, shuffle_shards=False, open_shards=1)
    with pytest.raises(TruncatedShard, match=rf"s0.tar is {sizes[0]:,d} bytes; .*{sizes[1]:,d}") as caught:
        list(ds)
    assert caught.value.name == "s0.tar" and "\n" not in str(caught.value)

    skipping = RemoteDataset(store, bucket, "ds", unindexed=True, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert delivered(skipping) == Counter(keys_of("m", 9))  # none of s0.tar's, the other tar's exactly once
    assert skipping.metrics.skipped == 1
    assert any("s0.tar" in r.getMessage() and f"{sizes[0]:,d}" in r.getMessage() for r in caplog.records)


class CutAfterFirstRead(LocalStore):
    """A local store whose object ``key`` is cut to ``to`` bytes once its first bytes were
    read: a tar truncated while a pass reads it, after the read that gave its size."""

    key, to = "", 0

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        data = super().get_range(bucket, key, start, end)
        self._cut(bucket, key, start)
        return data

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview, **kwargs) -> None:
        super().get_range_into(bucket, key, start, end, out, **kwargs)
        self._cut(bucket, key, start)

    def _cut(self, bucket: str, key: str, start: int) -> None:
        if key == self.key and start == 0:
            self.key = ""
            self.put(bucket, key, self.get(bucket, key)[: self.to])


def test_a_tar_cut_while_it_is_read_is_named_with_both_sizes(tmp_path, caplog):
    store = CutAfterFirstRead(tmp_path)
    store.create_bucket("b")
    whole = tar_of(keys_of("k", 30), size=100_000)  # over 2 MiB: its first MiB is fetched apart
    store.put("b", "ds/s1.tar", tar_of(keys_of("m", 4)))
    for on_error in ("raise", "skip"):
        store.put("b", "ds/s0.tar", whole)
        store.key, store.to = "ds/s0.tar", 2_000_000
        ds = RemoteDataset(store, "b", "ds", unindexed=True, on_error=on_error)
        if on_error == "raise":
            with pytest.raises(TruncatedShard, match=rf"s0.tar is 2,000,000 bytes; .* {len(whole):,d}:"):
                list(ds)
        else:
            with caplog.at_level(logging.WARNING, logger="remote_loader"):
                assert delivered(ds) == Counter(keys_of("m", 4))
            assert ds.metrics.skipped == 1 and any("s0.tar is 2,000,000" in r.getMessage() for r in caplog.records)


class WrittenAgainWhileRead:
    """A store whose object ``key`` is written again, to the same size with other bytes, once
    its first bytes were read (``get_first_bytes``, the GET that gives the size): a tar
    replaced while a pass reads it, where no size tells the two versions apart."""

    key = ""

    def get_first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, int]:
        found = super().get_first_bytes(bucket, key, length)
        if key == self.key:
            self.key = ""
            data = self.get(bucket, key)
            self.put(bucket, key, data.replace(b"." * 64, b"!" * 64))  # members' bytes, not their headers
        return found


class LocalWrittenAgain(WrittenAgainWhileRead, LocalStore):
    pass


class S3WrittenAgain(WrittenAgainWhileRead, Boto3Store):
    pass


@pytest.fixture(params=["local", "seaweedfs"])
def written_again(request, tmp_path):
    if request.param == "local":
        store: WrittenAgainWhileRead = LocalWrittenAgain(tmp_path)
        store.create_bucket("b")
        yield store, "b"
        return
    store = S3WrittenAgain(request.getfixturevalue("seaweed").client().config)
    yield store, new_bucket(store)
    store.close()


def test_a_tar_written_again_to_the_same_size_while_it_is_read_never_mixes_the_two(written_again, caplog):
    store, bucket = written_again
    whole = tar_of(keys_of("k", 30), size=100_000)  # over 2 MiB: read in several GETs after its first bytes
    store.put(bucket, "ds/s1.tar", tar_of(keys_of("m", 4)))
    for on_error in ("raise", "skip"):
        store.put(bucket, "ds/s0.tar", whole)
        store.key = "ds/s0.tar"
        ds = RemoteDataset(store, bucket, "ds", unindexed=True, on_error=on_error)
        if on_error == "raise":
            with pytest.raises(TruncatedShard, match=r"s0.tar was written again while this pass read it") as caught:
                list(ds)
            assert caught.value.name == "s0.tar"
        else:
            with caplog.at_level(logging.WARNING, logger="remote_loader"):
                assert delivered(ds) == Counter(keys_of("m", 4))  # none of s0.tar's, half old and half new
            assert ds.metrics.skipped == 1 and any("s0.tar was written again" in r.getMessage() for r in caplog.records)


class Counting(LocalStore):
    """A user's store, written before reads could name a version: its ``get_range_into`` has
    no ``if_match``."""

    ranges = 0

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview) -> None:
        self.ranges += 1
        super().get_range_into(bucket, key, start, end, out)


def test_a_store_whose_ranged_reads_take_no_version_reads_unindexed_tars_unpinned(tmp_path):
    # Its override was called with if_match and raised TypeError: no tar of over 128 KiB was read.
    store = Counting(tmp_path)
    store.create_bucket("b")
    store.put("b", "ds/s0.tar", tar_of(keys_of("k", 30), size=100_000))
    assert delivered(RemoteDataset(store, "b", "ds", unindexed=True)) == Counter(keys_of("k", 30))
    assert store.ranges > 0


# --------------------------------------------------------------------------- objects left out


def test_gzipped_tars_are_left_out_with_one_warning(tmp_path, caplog):
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    store.put("b", "ds/s0.tar", tar_of(keys_of("a", 4)))
    store.put("b", "ds/s1.tar.gz", gzip.compress(tar_of(keys_of("c", 2))))
    store.put("b", "ds/s2.tgz", gzip.compress(tar_of(keys_of("d", 2))))
    ds = RemoteDataset(store, "b", "ds", unindexed=True)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        for _ in range(2):  # two passes: one warning
            assert delivered(ds) == Counter(keys_of("a", 4))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "2 compressed tars" in warned[0] and "s1.tar.gz" in warned[0] and "byte range" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remote_loader"):  # another rank leaves them out, silently
        list(RemoteDataset(store, "b", "ds", unindexed=True, rank=1, world_size=2))
    assert not caplog.records
