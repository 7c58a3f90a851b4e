"""The node's cache in a directory others may write (DESIGN.md, "Shared directories"): links
planted wherever the cache reads, writes, renames or deletes are never followed, files it did
not write are never removed, and a directory another user could change is refused, with one
warning, the dataset then read from the store."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import stat
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from remote_loader import CacheConfig, RemoteDataset
from remote_loader.read.node_cache import FILL, TAG, NodeCache, file_name, folder_name
from remote_loader.read.upload_cache import UploadCache
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload

SAMPLES, PER_SHARD = 60, 12  # five shards


def _samples(dataset):
    return Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)


@pytest.fixture
def dataset(s3):
    store, bucket = s3
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48)), maxcount=PER_SHARD)
    ds = RemoteDataset(store, bucket, "d")
    return store, bucket, ds, _samples(ds)


def _outside(tmp_path: Path) -> Path:
    """A folder of someone's, outside the cache: a file and a subfolder with a file."""
    outside = tmp_path / "outside"
    (outside / "older").mkdir(parents=True)
    (outside / "keep.txt").write_bytes(b"secret")
    (outside / "older" / "last.pt").write_bytes(b"weights")
    return outside


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _reader(store, bucket, cache: Path, **options) -> RemoteDataset:
    return RemoteDataset(store, bucket, "d", cache_dir=cache, **options)


def _upload_cache(ds: RemoteDataset) -> UploadCache:
    found = ds.reader.upload_cache()
    assert found is not None
    return found


def _cached_shards(ds: RemoteDataset) -> list[Path]:
    return [p for p in Path(_upload_cache(ds).path).iterdir()
            if p.is_file() and not p.is_symlink() and not p.name.startswith(".")]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "shard cache" in r.getMessage()]


def _plant(ds: RemoteDataset, place: str, target: Path) -> Path:
    """A link to ``target`` where the cache will read or write ``place``, in the folders a
    first reader makes (made here first, as that reader would)."""
    shard = file_name(ds.reader.manifest.shards[0].name)
    upload_dir = Path(_upload_cache(ds).path)
    paths = {"root": upload_dir.parent.parent, "dataset": upload_dir.parent, "about": upload_dir.parent / "about",
             "older upload": upload_dir.parent / "0badc0de", "upload": upload_dir, "fill": upload_dir / FILL,
             "part": upload_dir / FILL / (shard + ".part"), "lock": upload_dir / FILL / (shard + ".lock"),
             "shard": upload_dir / shard, "reservation lock": upload_dir.parent.parent / ".lock"}
    link = paths[place]
    if place == "root":
        link.parent.mkdir()  # the directory named
    else:
        NodeCache(ds.reader.cache).root()
        for folder in (upload_dir.parent, upload_dir, upload_dir / FILL):
            if folder == link:
                break
            folder.mkdir(mode=0o700, exist_ok=True)
    link.symlink_to(target)
    if place in ("part", "shard"):  # at every shard's, so that the first fill meets one
        for entry in ds.reader.manifest.shards[1:]:
            other = file_name(entry.name)
            (link.parent / (other + link.name[len(shard):])).symlink_to(target)
    return link


_FOLDERS = ["root", "dataset", "older upload", "upload", "fill"]
_FILES = ["about", "part", "lock", "shard", "reservation lock"]
_REFUSED = ["root", "dataset", "upload", "fill", "reservation lock"]


@pytest.mark.parametrize("place", _FOLDERS + _FILES)
def test_a_link_planted_where_the_cache_goes_is_never_followed(dataset, tmp_path, place, caplog):
    store, bucket, plain, clean = dataset
    outside = _outside(tmp_path)
    target = outside / "keep.txt" if place in _FILES else outside
    before = _snapshot(outside)
    ds = _reader(store, bucket, tmp_path / "cache")
    link = _plant(ds, place, target)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
        assert _samples(ds) == clean
    assert _snapshot(outside) == before  # nothing written, truncated or removed out there
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt", "older"]
    if place in _REFUSED:  # the cache's folders, and the lock of its space: refused, said once
        (message,) = _warnings(caplog)
        assert str(link) in message and "read from the store" in message
        assert ds.metrics.cached_bytes == 0
    elif place == "lock":  # one shard's lock: that shard is read from the store, said once
        (message,) = _warnings(caplog)
        assert str(link) in message and "that shard is read from the store" in message
        assert len(_cached_shards(ds)) == len(ds.reader.manifest.shards) - 1
    else:  # a file the cache replaces whole (a link is replaced, not written through), or an older upload's
        assert not _warnings(caplog)
        assert len(_cached_shards(ds)) == len(ds.reader.manifest.shards)
        assert ds.metrics.cached_bytes > 0


def test_the_cache_never_removes_files_it_did_not_write(dataset, tmp_path):
    """A scratch directory that also holds a run's checkpoints, named as the cache with a
    bound smaller than what is read: eviction removes shards of other uploads, never the
    checkpoint, and nothing beside the cache's own files is touched."""
    store, bucket, plain, clean = dataset
    scratch = tmp_path / "scratch"
    (scratch / "run1" / "ckpt").mkdir(parents=True)
    (scratch / "run1" / "ckpt" / "last.pt").write_bytes(b"weights" * 1000)
    (scratch / "notes.txt").write_text("mine")
    upload(store, bucket, "other", SyntheticImages(SAMPLES, size=(64, 48), seed=3), maxcount=PER_SHARD)
    other = RemoteDataset(store, bucket, "other", cache_dir=scratch)
    assert len(list(other)) == SAMPLES
    total = sum(e.size for e in plain.reader.manifest.shards)
    foreign = _plant_foreign(other)
    before = _snapshot(scratch / "run1") | {"notes.txt": b"mine"}
    ds = _reader(store, bucket, scratch, cache_bytes=total + (64 << 10))  # room for this dataset alone
    for _ in range(2):
        assert _samples(ds) == clean
    assert _snapshot(scratch / "run1") | {"notes.txt": (scratch / "notes.txt").read_bytes()} == before
    assert len(_cached_shards(other)) < len(other.reader.manifest.shards)  # the other dataset's were evicted...
    assert all(p.exists() or p.is_symlink() for p in foreign)  # ...and nothing of anyone else's in its folders
    assert len(_cached_shards(ds)) == len(ds.reader.manifest.shards)


def _plant_foreign(ds: RemoteDataset) -> list[Path]:
    """Things the cache did not write, in each of its folders, where its layout has no file of
    their kind or name: kept through eviction and clearing. (A file not named with a dot first
    in an upload's folder is a shard there: docs/cache.md asks that nothing else be put in it.)"""
    upload_dir = Path(_upload_cache(ds).path)
    root = upload_dir.parent.parent
    planted = [root / "notes.txt", upload_dir.parent / "README", upload_dir / "mine", upload_dir / FILL / "x.txt",
               upload_dir / ".hidden", upload_dir / "link.tar"]
    (upload_dir / "mine").mkdir()
    for path in planted:
        if path.name == "link.tar":
            path.symlink_to(root / "notes.txt")
        elif not path.exists():
            path.write_text("not the cache's")
    return planted


def test_an_overwrite_removes_only_the_older_uploads_own_files(dataset, tmp_path):
    store, bucket, plain, clean = dataset
    cache = tmp_path / "cache"
    first = _reader(store, bucket, cache)
    list(first)
    foreign = _plant_foreign(first)
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48), seed=7), maxcount=PER_SHARD, overwrite=True)
    fresh = _reader(store, bucket, cache)
    assert len(list(fresh)) == SAMPLES
    assert all(p.exists() or p.is_symlink() for p in foreign)
    assert not _cached_shards(first) and not list((Path(_upload_cache(first).path) / FILL).glob("*.lock"))
    assert Path(_upload_cache(first).path).is_dir()  # kept for a process still reading that upload


def test_a_process_still_reading_an_older_upload_loses_only_its_shards(dataset, tmp_path):
    """A reader of the new upload removes the old one's shards; one still reading the old
    upload (until its next pass tells it) keeps its folders, and so its cache: it fetches
    what it lacks into it again, with no warning."""
    store, bucket, plain, clean = dataset
    cache = tmp_path / "cache"
    old = _reader(store, bucket, cache)
    before = sorted(s["__key__"] for s in old)  # its folders made, its shards cached
    held = _upload_cache(old)
    shard = old.reader.manifest.shards[0]
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48), seed=7), maxcount=PER_SHARD, overwrite=True)
    assert len(list(_reader(store, bucket, cache))) == SAMPLES
    assert not _cached_shards(old)
    out = memoryview(bytearray(10))
    assert not held.read_into(shard.name, shard.size, shard.crc32, 0, 10, out)  # gone...
    assert held.broken is None and held.size(shard.name) is None and before
    assert Path(held.path).is_dir()  # ...but its folder is there to fill again


def test_clearing_never_follows_a_link_nor_removes_what_is_not_a_shard(dataset, tmp_path):
    store, bucket, plain, clean = dataset
    cache = tmp_path / "cache"
    ds = _reader(store, bucket, cache)
    list(ds)
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    (cache / "link").symlink_to(outside)
    foreign = _plant_foreign(ds)
    script = Path(sys.executable).with_name("remote-loader")
    subprocess.run([str(script), "cache", str(cache), "--clear"], check=True, capture_output=True)
    assert _snapshot(outside) == before
    assert all(p.exists() or p.is_symlink() for p in foreign)
    assert not _cached_shards(ds)
    assert not list((Path(_upload_cache(ds).path) / FILL).glob("*.lock"))  # the locks of no running fill too


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_directory_every_user_can_write_is_refused_without_the_sticky_bit(dataset, tmp_path, mode, caplog):
    store, bucket, plain, clean = dataset
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    ds = _reader(store, bucket, shared)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
    if mode != 0o777:  # sticky, as /tmp, or writable by its group alone: the user's own folder in it is used
        assert not _warnings(caplog) and ds.metrics.cached_bytes > 0 and len(_cached_shards(ds)) == 5
        assert (shared / folder_name()).stat().st_mode & 0o777 == 0o700
    else:
        (message,) = _warnings(caplog)
        assert "can be written by every user and has no sticky bit" in message and str(shared) in message
        assert not (shared / folder_name()).exists()


def test_a_cache_made_under_umask_002_is_used(dataset, tmp_path, caplog):
    """A user whose umask lets their group write what they make (Debian's user private
    groups): the directory made for the cache is their group's to write, the cache's own
    folders theirs alone."""
    store, bucket, plain, clean = dataset
    before = os.umask(0o002)
    try:
        ds = _reader(store, bucket, tmp_path / "node-cache")
        with caplog.at_level(logging.WARNING, logger="remote_loader"):
            assert _samples(ds) == clean
    finally:
        os.umask(before)
    assert not _warnings(caplog) and len(_cached_shards(ds)) == 5
    assert (tmp_path / "node-cache").stat().st_mode & 0o777 == 0o775
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "node-cache").rglob("*") if p.is_dir()} == {0o700}


def test_processes_starting_together_all_use_the_cache(tmp_path):
    """Each claims the new cache folder at once (as a node's first DataLoader workers do at
    their first shard): each finds it tagged, none refuses it for the tag another just wrote."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(6), context.Queue()
    for attempt in range(8):
        directory = tmp_path / f"try{attempt}"
        processes = [context.Process(target=_claim_at_once, args=(str(directory), barrier, results))
                     for _ in range(6)]
        for process in processes:
            process.start()
        got = [results.get(timeout=120) for _ in processes]
        for process in processes:
            process.join(60)
        assert got == ["ok"] * 6, got


def _claim_at_once(directory: str, barrier, results) -> None:
    try:
        barrier.wait(60)
        NodeCache(CacheConfig(directory)).root()
        results.put("ok")
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put(f"{type(error).__name__}: {error}")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("whose", ["directory", "cache folder"])
def test_a_folder_another_user_owns_is_refused(dataset, tmp_path, whose, caplog):
    store, bucket, plain, clean = dataset
    cache = tmp_path / "cache"
    cache.mkdir()
    if whose == "directory":
        os.chown(cache, 4242, 4242)
    else:
        NodeCache(_reader(store, bucket, cache).reader.cache).root()
        os.chown(cache / folder_name(), 4242, 4242)
    ds = _reader(store, bucket, cache)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
    (message,) = _warnings(caplog)
    assert "belongs to another user (uid 4242)" in message
    assert ds.metrics.cached_bytes == 0


def test_a_folder_of_the_cache_s_name_that_is_not_a_cache_is_left_alone(dataset, tmp_path, caplog):
    store, bucket, plain, clean = dataset
    cache = tmp_path / "cache"
    mine = cache / folder_name()
    mine.mkdir(parents=True, mode=0o700)
    (mine / "data.bin").write_bytes(b"mine")
    ds = _reader(store, bucket, cache, cache_bytes=1)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
    (message,) = _warnings(caplog)
    assert f"has no {TAG}" in message
    assert sorted(p.name for p in mine.iterdir()) == ["data.bin"]


def test_a_fifo_planted_where_a_shard_goes_is_replaced_not_waited_on(dataset, tmp_path):
    # Opened to be read, a fifo blocked the reader's threads until someone wrote to it: the
    # epoch delivered nothing, for ever.
    store, bucket, _, clean = dataset
    ds = _reader(store, bucket, tmp_path / "cache")
    assert _samples(ds) == clean
    fifos = _cached_shards(ds)
    for path in fifos:
        path.unlink()
        os.mkfifo(path)
    got: list[Counter] = []
    reading = threading.Thread(target=lambda: got.append(_samples(ds)), daemon=True)
    reading.start()
    reading.join(120)  # at most: a reader blocked on a fifo never ends
    for path in fifos:  # a writer lets any reader still blocked on one go (it then reads nothing)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert got == [clean]
    assert all(p.is_file() and not stat.S_ISFIFO(p.lstat().st_mode) for p in fifos)  # fetched again in their place
