"""Reads from the node's shard cache (docs/cache.md, "What is checked"): a shard checked whole
as it entered the cache is read as it is, by every process, until its file changes;
``verify_reads`` checks every member at every read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from remote_loader import CacheConfig, ConfigError, DatasetReader, RemoteDataset, RemoteMapDataset
from remote_loader.read.cached_shard import ShardFile
from remote_loader.read.node_cache import FILL
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload

SAMPLES, PER_SHARD = 60, 12  # five shards

_READ = """
import json, sys
from remote_loader import RemoteDataset, make_client
store = make_client(sys.argv[1], sys.argv[2], sys.argv[3])
ds = RemoteDataset(store, sys.argv[4], "d", cache_dir=sys.argv[5])
print(json.dumps({s["__key__"]: bytes(s["jpg"]).hex() for s in ds}))
print(json.dumps(ds.metrics.as_dict()))
"""


def _samples(dataset):
    return Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)


@pytest.fixture
def dataset(s3):
    store, bucket = s3
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48)), maxcount=PER_SHARD)
    reader = DatasetReader(store, bucket, "d")
    return store, bucket, reader, _samples(reader)


def _cached_file(cache: Path, name: str) -> Path:
    (path,) = [p for p in cache.rglob(name) if FILL not in p.parts]
    return path


def _change_in_place(path: Path, offset: int, keep_times: bool) -> None:
    """Flip one byte of a file where it lies (the same inode and size), its times kept or not."""
    found = path.stat()
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)
    if keep_times:
        os.utime(path, ns=(found.st_atime_ns, found.st_mtime_ns))
    else:
        os.utime(path, ns=(found.st_atime_ns, found.st_mtime_ns + 1_000_000_000))


def _read_elsewhere(seaweed, bucket: str, cache: Path, **env: str) -> tuple[dict[str, str], dict[str, int]]:
    """Every sample's jpg (hex) and the metrics, as a process of its own reads them through ``cache``."""
    import json

    done = subprocess.run([sys.executable, "-c", _READ, seaweed.endpoint_url, seaweed.access_key, seaweed.secret_key,
                           bucket, str(cache)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd(), **env}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1])


def _cached_with_a_member_changed(dataset, tmp_path: Path, keep_times: bool = True) -> tuple[Path, Any, str]:
    """The dataset read once through a cache, then a byte of one jpg of shard 2's cached file
    changed where it lies, its times kept (what no record of the file shows) or not: the
    cache, that shard's entry, and the key of the sample changed."""
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    assert _samples(RemoteDataset(store, bucket, "d", cache_dir=cache)) == clean
    entry = reader.manifest.shards[2]
    key, offset = _damaged_member(reader, 2)
    _change_in_place(_cached_file(cache, entry.name), offset, keep_times=keep_times)
    return cache, entry, key


def _damaged_member(reader: DatasetReader, shard: int) -> tuple[str, int]:
    """A sample of shard ``shard`` and an offset inside its jpg."""
    index = reader.read_index(reader.manifest.shards[shard])
    column = index.fields.index("jpg")
    return index.keys[5], int(index.offsets[5, column]) + 10


def test_a_shard_checked_as_it_entered_is_read_as_it_is_by_every_process_until_it_changes(seaweed, dataset,
                                                                                          tmp_path):
    """The default: no member of a checked file is checked again, in this process or another,
    while its inode, size and modification time are the ones checked; once they are not, the
    file is checked whole again, fails, and the shard comes from the store."""
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    assert _samples(RemoteDataset(store, bucket, "d", cache_dir=cache)) == clean
    entry = reader.manifest.shards[2]
    key, offset = _damaged_member(reader, 2)
    path = _cached_file(cache, entry.name)
    _change_in_place(path, offset, keep_times=True)
    jpgs, metrics = _read_elsewhere(seaweed, bucket, cache)
    stored = {k: jpg for k, jpg, _ in clean}
    assert [k for k in stored if bytes.fromhex(jpgs[k]) != stored[k]] == [key]  # read as it lies, unchecked
    assert metrics["bytes"] == 0 and metrics["retries"] == 0
    _change_in_place(path, offset + 1, keep_times=False)  # a write that moves its modification time
    jpgs, metrics = _read_elsewhere(seaweed, bucket, cache)
    assert {k: bytes.fromhex(v) for k, v in jpgs.items()} == stored
    assert metrics["bytes"] == entry.size and metrics["retries"] == 1  # that shard alone, from the store


def test_verify_reads_checks_every_member_of_a_cached_shard(seaweed, dataset, tmp_path):
    """With REMOTE_LOADER_CACHE_VERIFY=1 a change that keeps the file's times is found at the
    member, and that shard is fetched again."""
    _, bucket, _, clean = dataset
    cache, entry, _ = _cached_with_a_member_changed(dataset, tmp_path)
    jpgs, metrics = _read_elsewhere(seaweed, bucket, cache, REMOTE_LOADER_CACHE_VERIFY="1")
    assert {k: bytes.fromhex(v) for k, v in jpgs.items()} == {k: jpg for k, jpg, _ in clean}
    assert metrics["bytes"] == entry.size and metrics["retries"] >= 1


def test_cache_verify_holds_in_a_process_that_read_the_cache_without_it(dataset, tmp_path):
    """A dataset made with ``cache_verify=True`` checks every member even where this process
    already reads the same upload's cache without it (the cache's state is kept per setting)."""
    store, bucket, _, clean = dataset
    cache, entry, key = _cached_with_a_member_changed(dataset, tmp_path)
    trusting = {k: jpg for k, jpg, _ in _samples(RemoteDataset(store, bucket, "d", cache_dir=cache))}
    stored = {k: jpg for k, jpg, _ in clean}
    assert [k for k in stored if trusting[k] != stored[k]] == [key]  # the default: read as it lies
    checking = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_verify=True)
    assert _samples(checking) == clean and checking.metrics.bytes == entry.size


def test_reading_a_cached_shard_marks_it_used_and_keeps_its_modification_time(dataset, tmp_path):
    """Least recently used is told by the access time: the modification time is the check's."""
    store, bucket, _, clean = dataset
    cache = tmp_path / "cache"
    list(RemoteDataset(store, bucket, "d", cache_dir=cache))
    an_hour_ago = time.time_ns() - 3600 * 10**9
    paths = [p for p in cache.rglob("*.tar") if FILL not in p.parts]
    for path in paths:
        os.utime(path, ns=(an_hour_ago, an_hour_ago + 1))
    assert _samples(RemoteDataset(store, bucket, "d", cache_dir=cache)) == clean
    for path in paths:
        found = path.stat()
        assert found.st_mtime_ns == an_hour_ago + 1
        assert found.st_atime_ns > an_hour_ago + 1800 * 10**9


def test_a_cached_shard_cut_short_is_fetched_again(dataset, tmp_path):
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    list(RemoteDataset(store, bucket, "d", cache_dir=cache))
    entry = reader.manifest.shards[1]
    os.truncate(_cached_file(cache, entry.name), entry.size // 2)
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache)
    assert _samples(ds) == clean
    assert ds.metrics.bytes == entry.size


def test_a_shard_file_cut_short_after_it_was_opened_reads_as_none(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 16)
    shard = ShardFile(os.open(path, os.O_RDONLY), checked=True, size=4096)
    try:
        assert shard.read(4000, 96) == (bytes(range(256)) * 16)[4000:]
        os.truncate(path, 4050)
        assert shard.read(4000, 96) is None
    finally:
        shard.close()


@pytest.mark.parametrize(("env", "verify"), [({}, False), ({"REMOTE_LOADER_CACHE_VERIFY": "1"}, True),
                                             ({"REMOTE_LOADER_CACHE_VERIFY": "false"}, False)])
def test_the_environment_asks_for_a_check_of_every_read(tmp_path, env, verify):
    config = CacheConfig.of(tmp_path, None, env=env)
    assert config is not None and config.verify_reads is verify
    config = CacheConfig.of(tmp_path, None, env=env, verify_reads=True)
    assert config is not None and config.verify_reads is True


def test_the_environment_s_check_of_every_read_goes_unused_without_a_cache(tmp_path):
    """``REMOTE_LOADER_CACHE_VERIFY=1`` set for a job asks nothing of a dataset without a cache
    (``cache_dir=""`` turns the environment's off, as the docs' job script does): it was
    refused as if ``cache_verify=True`` had been given."""
    env = {"REMOTE_LOADER_CACHE_VERIFY": "1"}
    assert CacheConfig.of(None, None, env=env) is None
    assert CacheConfig.of("", None, env={**env, "REMOTE_LOADER_CACHE_DIR": str(tmp_path)}) is None
    with pytest.raises(ConfigError, match="cache_verify checks what a cache reads"):
        CacheConfig.of(None, None, env=env, verify_reads=True)  # given, it asks for a cache


def test_a_flag_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="REMOTE_LOADER_CACHE_VERIFY must be 1 or 0, got 'sometimes'"):
        CacheConfig.of(tmp_path, None, env={"REMOTE_LOADER_CACHE_VERIFY": "sometimes"})
    with pytest.raises(ConfigError, match="verify_reads must be True or False"):
        CacheConfig(str(tmp_path), verify_reads="yes")  # type: ignore[arg-type]


def test_a_map_style_reader_reads_a_checked_file_as_it_is_and_every_member_with_cache_verify(dataset, tmp_path):
    """``RemoteMapDataset`` reads the cache as ``RemoteDataset`` does: a file checked whole is
    read as it lies, each member straight into its bytes; with ``cache_verify=True`` each
    member is checked, and a damaged one's shard fetched again (batches and single samples)."""
    store, bucket, _, clean = dataset
    cache, entry, key = _cached_with_a_member_changed(dataset, tmp_path)
    stored = {k: jpg for k, jpg, _ in clean}
    trusting = RemoteMapDataset(store, bucket, "d", cache_dir=cache)
    read = {s["__key__"]: s["jpg"] for s in trusting.__getitems__(list(range(len(trusting))))}
    assert [k for k in stored if read[k] != stored[k]] == [key] and trusting.metrics.gets == 0
    checking = RemoteMapDataset(store, bucket, "d", cache_dir=cache, cache_verify=True)
    assert _samples(checking[i] for i in range(len(checking))) == clean
    assert checking.metrics.bytes == entry.size and checking.metrics.retries >= 1


@pytest.mark.parametrize("mapped", [False, True])
def test_checking_every_read_without_verify_still_finds_a_file_changed_since_its_check(dataset, tmp_path, mapped):
    """With ``verify=False`` no member is checked: ``cache_verify=True`` must not then check
    less than the default, which finds a file written to since its check and fetches it again."""
    store, bucket, _, clean = dataset
    cache, entry, _ = _cached_with_a_member_changed(dataset, tmp_path, keep_times=False)
    if mapped:
        ds = RemoteMapDataset(store, bucket, "d", cache_dir=cache, cache_verify=True, verify=False)
        read = _samples(ds.__getitems__(list(range(len(ds)))))
    else:
        ds = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_verify=True, verify=False)
        read = _samples(ds)
    assert read == clean and ds.metrics.bytes == entry.size


@pytest.mark.parametrize("small", [True, False])
def test_a_range_of_small_samples_is_read_from_its_cached_shard_at_once(dataset, tmp_path, monkeypatch, small):
    """A system call a member costs more than copying a small member: a range of samples of
    under ``SMALL_SAMPLES`` bytes each is read from its cached shard with one ``pread`` and its
    members copied out, checked where the file is not trusted as it is; larger ones are read
    straight into their bytes, a ``pread`` a member."""
    from remote_loader.read import shards

    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    assert _samples(RemoteDataset(store, bucket, "d", cache_dir=cache)) == clean  # the first epoch fills the cache
    if not small:
        monkeypatch.setattr(shards, "SMALL_SAMPLES", 1)
    reads: list[int] = []
    read = ShardFile.read
    monkeypatch.setattr(ShardFile, "read", lambda self, offset, size: (reads.append(size), read(self, offset, size))[1])
    indexes = [reader.read_index(entry) for entry in reader.manifest.shards]
    ranges = [index.extent(0, len(index)) - index.start(0, len(index)) for index in indexes]  # a shard's samples
    members = [len(data) for _, jpg, cls in clean for data in (jpg, cls)]
    for verify in (None, True):
        reads.clear()
        assert _samples(RemoteDataset(store, bucket, "d", cache_dir=cache, cache_verify=verify)) == clean
        assert sorted(reads) == sorted(ranges if small else members)


@pytest.mark.parametrize("how", ["iterable", "views", "map batches", "map samples"])
def test_cache_verify_checks_every_member_without_verify(dataset, tmp_path, how):
    """``cache_verify=True`` checks every member read from the cache even with ``verify=False``:
    a change that keeps the file's times is found at the member and that shard fetched again."""
    store, bucket, _, clean = dataset
    cache, entry, _ = _cached_with_a_member_changed(dataset, tmp_path)
    ds: Any
    if how.startswith("map"):
        ds = RemoteMapDataset(store, bucket, "d", cache_dir=cache, cache_verify=True, verify=False)
        every = list(range(len(ds)))
        read = _samples(ds.__getitems__(every) if how == "map batches" else [ds[i] for i in every])
    else:
        ds = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_verify=True, verify=False, views=how == "views")
        read = _samples(ds)
    assert read == clean and ds.metrics.bytes == entry.size


@pytest.mark.parametrize("cache_verify", [False, True])
@pytest.mark.parametrize("resize", ["grown", "cut short"])
def test_a_damaged_cached_shard_whose_size_changed_is_dropped_and_fetched_again(dataset, tmp_path, resize,
                                                                              cache_verify, caplog):
    """A file whose size is no longer the shard's is not the one checked: it is dropped, with a
    warning, and the shard fetched again, even with ``verify=False`` (its ranges are never read
    from the file as it lies)."""
    store, bucket, reader, clean = dataset
    cache, entry, _ = _cached_with_a_member_changed(dataset, tmp_path)
    path = _cached_file(cache, entry.name)
    if resize == "grown":
        with path.open("ab") as grown:
            grown.write(b"\0")
    else:
        os.truncate(path, reader.read_index(entry).extent(0, 6))  # the changed member kept
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache, verify=False, cache_verify=cache_verify)
    with caplog.at_level("WARNING", logger="remote_loader"):
        assert _samples(ds) == clean
    assert ds.metrics.bytes == entry.size and path.stat().st_size == entry.size  # fetched again, once
    assert any(entry.name in r.getMessage() and "fetched again" in r.getMessage() for r in caplog.records)
