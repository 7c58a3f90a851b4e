"""The node-local shard cache (docs/cache.md): one fetch a node, never stale, never trusted
blindly, bounded, and a fallback to the store whatever goes wrong with the disk."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import pytest

from remote_loader import (
    CacheConfig,
    ConfigError,
    DatasetChanged,
    DatasetReader,
    FetchConfig,
    LocalStore,
    RemoteDataset,
    RemoteMapDataset,
    make_client,
)
from remote_loader.read import node_cache, upload_cache
from remote_loader.read.node_cache import FILL, NodeCache
from remote_loader.storage.base import Store
from remote_loader.storage.daemon import in_daemon_thread
from remote_loader.testing.synthetic import SyntheticImages
from tests.faultproxy import FaultProxy
from tests.helpers import upload, upload_to_new_bucket

SAMPLES, PER_SHARD = 120, 12  # ten shards


def _samples(dataset):
    return Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in dataset)


def _shard_bytes(reader: DatasetReader) -> int:
    return sum(entry.size for entry in reader.manifest.shards)


def _cached(root: Path) -> dict[str, bytes]:
    """Every whole shard in a cache, by name (nothing being written)."""
    return {p.name: p.read_bytes() for p in root.rglob("*.tar") if FILL not in p.parts}


def _cached_paths(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tar") if FILL not in p.parts]


def _check_whole(root: Path, reader: DatasetReader) -> None:
    crcs = {entry.name: entry.crc32 for entry in reader.manifest.shards}
    for name, data in _cached(root).items():
        assert zlib.crc32(data) == crcs[name], name


@pytest.fixture
def dataset(s3):
    store, bucket = s3
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48)), maxcount=PER_SHARD)
    reader = DatasetReader(store, bucket, "d")
    return store, bucket, reader, _samples(reader)


def test_the_second_epoch_reads_the_cache_and_sends_no_shard_request(dataset, tmp_path):
    store, bucket, reader, clean = dataset
    ds = RemoteDataset(store, bucket, "d", cache_dir=tmp_path / "cache")
    assert _samples(ds) == clean
    first = ds.metrics.as_dict()
    assert first["bytes"] == _shard_bytes(reader)  # each shard fetched once, whole
    assert first["gets"] == len(reader.manifest.shards)  # shards under a part: one GET each
    assert _samples(ds) == clean  # epoch 2, a new order
    second = ds.metrics.as_dict()
    assert second["gets"] == first["gets"] and second["bytes"] == first["bytes"]
    assert second["cached_bytes"] > 2 * first["bytes"] * 0.9
    mapped = RemoteMapDataset(store, bucket, "d", cache_dir=tmp_path / "cache")
    assert Counter((s["__key__"], bytes(s["jpg"]), bytes(s["cls"])) for s in mapped) == clean
    assert mapped.metrics.gets == 0
    _check_whole(tmp_path / "cache", reader)


def test_a_map_style_read_from_the_cache_reads_each_member_once_into_its_bytes(s3, tmp_path):
    """From a shard the cache holds whole, a sample's members are read from the file straight
    into their bytes: no buffer of the run beside them, zeroed and then copied out of (which
    made a batch from the cache slower per sample than one ``ds[i]`` at a time). Its bytes are
    the upload's, and a member of a checked file is not checked again."""
    import io
    import tracemalloc

    import numpy as np
    from PIL import Image

    store, bucket = s3
    noise = np.random.default_rng(0).integers(0, 256, (1200, 1200, 3), dtype=np.uint8)
    jpeg = io.BytesIO()
    Image.fromarray(noise).save(jpeg, format="JPEG", quality=98)
    big = jpeg.getvalue()
    assert len(big) > 2_000_000
    upload(store, bucket, "big", [(big, 1), (big[:], 2)], maxcount=2)
    ds = RemoteMapDataset(store, bucket, "big", cache_dir=tmp_path / "cache")
    first = ds.__getitems__([0, 1])  # fetched whole into the cache
    assert sorted(bytes(s["jpg"]) == big for s in first) == [True, True]
    name = ds.reader.manifest.shards[0].name
    for _ in range(1200):  # until the fill has checked the shard and renamed it into place (at most 60 s)
        if [p for p in (tmp_path / "cache").rglob(name) if FILL not in p.parts]:
            break
        _wait(0.05)
    ds[0]  # the file opened and trusted once: what stays is the read itself
    counted = ds.metrics.cached_bytes
    tracemalloc.start()
    try:
        again = ds[1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert again["jpg"] == big and type(again["jpg"]) is bytes
    assert ds.metrics.cached_bytes - counted == len(again["jpg"]) + len(again["cls"])  # what was read, no more
    assert peak < 1.3 * len(big), f"{peak:,} bytes allocated to read a member of {len(big):,}"
    assert ds.metrics.gets == 1  # the shard, whole, once: its index read from it


def test_a_batch_over_more_shards_than_it_keeps_indexes_of_fetches_each_index_once(tmp_path):
    """A batch reads each shard's index once, on its threads, and keeps it for the run it reads,
    whether or not the cache holds that shard (here none: the bound is below a shard's size)."""
    store = LocalStore(tmp_path / "store")
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(40, size=(32, 24)), maxcount=2)  # 20 shards
    ds = RemoteMapDataset(store, "b", "d", cache_dir=tmp_path / "cache", cache_bytes=1000, cache_shards=4)
    batch = [2 * shard for shard in range(20)]  # a sample of every shard
    got = ds.__getitems__(batch)
    assert ds.metrics.gets == 2 * 20  # an index and a run a shard
    assert got == [RemoteMapDataset(store, "b", "d")[i] for i in batch]


def test_the_environment_turns_the_cache_on(dataset, tmp_path, monkeypatch):
    store, bucket, reader, clean = dataset
    monkeypatch.setenv("REMOTE_LOADER_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setenv("REMOTE_LOADER_CACHE_BYTES", "1G")
    ds = RemoteDataset(store, bucket, "d")
    assert ds.reader.cache == CacheConfig(str(tmp_path / "env-cache"), 10**9)
    assert _samples(ds) == clean
    assert len(_cached(tmp_path / "env-cache")) == len(reader.manifest.shards)
    assert RemoteDataset(store, bucket, "d", cache_dir="").reader.cache is None


@pytest.mark.parametrize(("given", "bound", "message"), [
    ({"max_bytes": "64GiB"}, 64 << 30, None), ({"max_bytes": "1.5T"}, 1_500_000_000_000, None),
    ({"max_bytes": 1000}, 1000, None), ({"max_bytes": "lots"}, None, "cache_bytes must be a number of bytes"),
    ({"max_bytes": "0.5K"}, 500, None), ({"max_bytes": "1.5KiB"}, 1536, None), ({"max_bytes": "2 GB"}, 2 * 10**9, None),
    ({"max_bytes": 0}, None, "cache_bytes"), ({"max_bytes": True}, None, "cache_bytes"),
])
def test_a_bound_is_a_number_of_bytes(tmp_path, given, bound, message):
    if message is None:
        assert CacheConfig(str(tmp_path), **given).max_bytes == bound
    else:
        with pytest.raises(ConfigError, match=message):
            CacheConfig(str(tmp_path), **given)


@pytest.mark.parametrize("bound", ["1.5", "0.0001K", "9" * 309, "1" + "0" * 400 + "K", "1" + "0" * 5000, "10000000T",
                                   2**63, 10**400], ids=["1.5", "0.0001K", "9*309", "1e400K", "1e5000", "1e7T",
                                                         "2**63", "10**400"])
def test_a_bound_of_a_fraction_of_a_byte_or_beyond_any_disk_is_refused_in_one_line(tmp_path, bound):
    with pytest.raises(ConfigError, match="^cache_bytes must") as refused:
        CacheConfig(str(tmp_path), bound)
    assert len(str(refused.value)) < 200


def test_a_cache_dir_holding_a_nul_byte_is_refused_when_the_dataset_is_made(tmp_path):
    """Refused at once, given or from the environment, not at the first sample read."""
    store = LocalStore(tmp_path / "store")
    for make in (lambda: CacheConfig(str(tmp_path / "a\0b")),
                 lambda: RemoteDataset(store, "b", "d", cache_dir=tmp_path / "a\0b")):
        with pytest.raises(ConfigError, match="^cache_dir must .*NUL"):
            make()
    with pytest.raises(ConfigError, match="^the environment variable REMOTE_LOADER_CACHE_DIR must .*NUL"):
        CacheConfig.of(None, None, env={"REMOTE_LOADER_CACHE_DIR": str(tmp_path / "a\0b")})


def test_a_bad_value_from_the_environment_is_named_as_the_variable_that_gave_it(tmp_path):
    env = {"REMOTE_LOADER_CACHE_DIR": str(tmp_path), "REMOTE_LOADER_CACHE_BYTES": "1.5"}
    with pytest.raises(ConfigError, match="^the environment variable REMOTE_LOADER_CACHE_BYTES must be a whole"):
        CacheConfig.of(None, None, env=env)
    with pytest.raises(ConfigError, match="^cache_bytes must be a whole"):  # given, not from the environment
        CacheConfig.of(None, "2.5", env=env)
    assert CacheConfig.of(None, "2K", env=env).max_bytes == 2000


def test_a_bound_without_a_directory_is_refused():
    with pytest.raises(ConfigError, match="give cache_dir too"):
        CacheConfig.of(None, "10G", env={})
    assert CacheConfig.of(None, None, env={}) is None


def _read_in_a_process(env: dict[str, str], bucket: str, cache: str, number: int, rank: int, world: int,
                       epochs: int, barrier, results) -> None:
    store = make_client(env["endpoint"], env["key"], env["secret"])
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache, rank=rank, world_size=world, equalize=False)
    barrier.wait(60)
    out = []
    for _ in range(epochs):
        before = ds.metrics.bytes
        keys = sorted(s["__key__"] for s in ds)
        out.append((keys, ds.metrics.bytes - before))
    results.put((number, out))


def _in_processes(seaweed, endpoint: str, bucket: str, cache: str | None, ranks: list[tuple[int, int]], epochs: int):
    """Run readers in spawned processes that begin their epochs at once; ``[(keys, bytes
    fetched) per epoch]`` of each, in the order of ``ranks``."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(len(ranks)), context.Queue()
    env = {"endpoint": endpoint, "key": seaweed.access_key, "secret": seaweed.secret_key}
    processes = [context.Process(target=_read_in_a_process, args=(env, bucket, cache, number, rank, world, epochs,
                                                                     barrier, results))
                 for number, (rank, world) in enumerate(ranks)]
    for process in processes:
        process.start()
    try:
        got = dict(results.get(timeout=240) for _ in processes)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in processes)
    return [got[number] for number in range(len(ranks))]


def test_two_processes_filling_one_cache_at_once_fetch_each_shard_once(seaweed, dataset, tmp_path):
    """Both read every shard, in the same order, beginning together through a store that
    answers each GET 0.2 s late: each shard comes from the store once, to one of them."""
    store, bucket, reader, clean = dataset
    proxy = FaultProxy(seaweed.endpoint_url, {"delay": 1.0}, delay=0.2, paths=".tar")
    try:
        runs = _in_processes(seaweed, proxy.endpoint_url, bucket, str(tmp_path / "cache"), [(0, 1), (0, 1)], 1)
    finally:
        proxy.close()
    keys = sorted(k for k, _, _ in clean)
    assert [run[0][0] for run in runs] == [keys, keys]
    assert sum(run[0][1] for run in runs) == _shard_bytes(reader)
    _check_whole(tmp_path / "cache", reader)


def test_the_ranks_of_a_node_fetch_the_dataset_once_in_two_epochs(seaweed, dataset, tmp_path):
    store, bucket, reader, clean = dataset
    ranks = [(0, 2), (1, 2)]
    cached = _in_processes(seaweed, seaweed.endpoint_url, bucket, str(tmp_path / "cache"), ranks, 2)
    streamed = _in_processes(seaweed, seaweed.endpoint_url, bucket, None, ranks, 2)
    keys = sorted(k for k, _, _ in clean)
    for runs in (cached, streamed):
        for epoch in range(2):
            assert sorted(runs[0][epoch][0] + runs[1][epoch][0]) == keys
    total = _shard_bytes(reader)
    # Once in the two epochs: a shard a rank began to read near the end of epoch 1 may still be
    # arriving whole into the cache as the epoch ends, its last parts then counted in epoch 2.
    assert sum(run[0][1] + run[1][1] for run in cached) == total
    assert sum(run[e][1] for run in streamed for e in range(2)) >= 2 * total * 0.9


def test_an_overwrite_between_epochs_is_never_served_from_the_cache(dataset, tmp_path):
    store, bucket, reader, _ = dataset
    cache = tmp_path / "cache"
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache)
    list(ds)
    old = Path(_upload_cache(ds).path)
    assert old.is_dir()
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48), seed=7), maxcount=PER_SHARD, overwrite=True)
    fresh = _samples(DatasetReader(store, bucket, "d"))
    assert _samples(RemoteDataset(store, bucket, "d", cache_dir=cache)) == fresh
    assert not [p for p in old.iterdir() if p.is_file()]  # the older upload's copies are gone
    _check_whole(cache, DatasetReader(store, bucket, "d"))


def test_a_flipped_byte_in_a_cached_shard_is_fetched_again(dataset, tmp_path):
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    list(RemoteDataset(store, bucket, "d", cache_dir=cache))
    entry = reader.manifest.shards[3]
    (path,) = [p for p in cache.rglob(entry.name) if FILL not in p.parts]
    index = reader.read_index(entry)
    offset = int(index.offsets[5].max())  # inside sample 5's last member
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache)
    assert _samples(ds) == clean
    assert ds.metrics.retries >= 1 and ds.metrics.bytes == entry.size  # that shard alone, again
    _check_whole(cache, reader)


def test_a_bound_smaller_than_the_dataset_is_kept(dataset, tmp_path):
    store, bucket, reader, clean = dataset
    total, cache = _shard_bytes(reader), tmp_path / "cache"
    bound = int(total * 0.45)
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_bytes=bound)
    for _ in range(3):
        assert _samples(ds) == clean
        assert 0 < sum(len(data) for data in _cached(cache).values()) <= bound
    assert ds.metrics.bytes >= total + 2 * (total - bound)  # what was not cached came from the store


def test_other_datasets_are_evicted_least_recently_used_first(s3, tmp_path):
    store, bucket = s3
    for folder in ("a", "b", "c"):
        upload(store, bucket, folder, SyntheticImages(24, size=(64, 48), seed=len(folder)), maxcount=PER_SHARD)
    sizes = {f: _shard_bytes(DatasetReader(store, bucket, f)) for f in "abc"}
    cache = tmp_path / "cache"
    bound = sizes["a"] + sizes["b"] + sizes["c"] // 2
    for folder in ("a", "b"):
        list(RemoteDataset(store, bucket, folder, cache_dir=cache, cache_bytes=bound))
    an_hour_ago = time.time() - 3600
    for path in _cached_paths(cache):
        os.utime(path, (an_hour_ago, an_hour_ago))
    list(RemoteMapDataset(store, bucket, "a", cache_dir=cache, cache_bytes=bound))  # a: used last
    list(RemoteDataset(store, bucket, "c", cache_dir=cache, cache_bytes=bound))
    held = {d.name.split(" ")[0].rsplit("/", 1)[-1]: d.bytes for d in NodeCache(CacheConfig(str(cache))).datasets()}
    assert held["a"] == sizes["a"] and held.get("b", 0) < sizes["b"] and held["c"] == sizes["c"]


_KILLED_FILL = """
import sys
from remote_loader import RemoteDataset, make_client
store = make_client(sys.argv[1], sys.argv[2], sys.argv[3])
for sample in RemoteDataset(store, sys.argv[4], "d", cache_dir=sys.argv[5]):
    pass
"""


def test_a_fill_killed_mid_write_leaves_nothing_read(seaweed, dataset, tmp_path):
    """A process killed while its fills' GETs stall half-way leaves parts that no reader
    takes for shards: the next reader fills those shards again, and every shard in the
    cache is whole."""
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    proxy = FaultProxy(seaweed.endpoint_url, {"stall_mid_body": 1.0}, delay=120, paths=".tar")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_FILL, proxy.endpoint_url, seaweed.access_key,
                              seaweed.secret_key, bucket, str(cache)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        parts: list[Path] = []
        for _ in range(2400):  # until the child holds a part with bytes in it (at most 120 s)
            parts = [p for p in cache.rglob("*.part") if p.stat().st_blocks]
            if parts or child.poll() is not None:
                break
            _wait(0.05)
        assert parts, "the child wrote no part"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        proxy.rates = {}
        ds = RemoteDataset(make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key), bucket, "d",
                           cache_dir=cache)
        assert _samples(ds) == clean
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        proxy.close()
    assert len(_cached(cache)) == len(reader.manifest.shards)
    assert not [p for p in cache.rglob("*.part") if p.stat().st_size]  # written over, or removed
    _check_whole(cache, reader)


def _wait(seconds: float) -> None:
    """A bounded wait between two looks at the child's files (the condition is what is waited for)."""
    threading.Event().wait(seconds)


def test_an_unwritable_cache_warns_once_and_streams(dataset, tmp_path, caplog):
    store, bucket, reader, clean = dataset
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ds = RemoteDataset(store, bucket, "d", cache_dir=blocker / "cache")
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
        assert _samples(ds) == clean
    warnings = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(warnings) == 1 and "cannot be written" in warnings[0], warnings
    assert ds.metrics.bytes >= 2 * _shard_bytes(reader) * 0.9


_FULL_DISK = """
import logging, resource, signal, sys
logging.basicConfig(level=logging.WARNING)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from remote_loader import RemoteDataset, make_client
store = make_client(sys.argv[1], sys.argv[2], sys.argv[3])
ds = RemoteDataset(store, sys.argv[4], "d", cache_dir=sys.argv[5])  # its counters' shared memory made first
limit = int(sys.argv[6])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # a file past this fails to grow: EFBIG
keys = [s["__key__"] for s in ds] + [s["__key__"] for s in ds]
print(len(keys), len(set(keys)))
"""


def test_a_disk_that_refuses_to_grow_a_file_warns_once_and_streams(seaweed, dataset, tmp_path):
    store, bucket, reader, _ = dataset
    largest = max(entry.size for entry in reader.manifest.shards)
    result = subprocess.run([sys.executable, "-c", _FULL_DISK, seaweed.endpoint_url, seaweed.access_key,
                             seaweed.secret_key, bucket, str(tmp_path / "cache"), str(largest // 2)],
                            capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(2 * SAMPLES), str(SAMPLES)]
    assert result.stderr.count("cannot be written") == 1, result.stderr[-2000:]


@contextlib.contextmanager
def _fills_held(ds: RemoteDataset, entries) -> Iterator[None]:
    """The locks of ``entries``' fills held here, as by a process stopped while it fills them."""
    NodeCache(ds.reader.cache).root()  # made and tagged, as a first reader makes it
    upload_dir = Path(_upload_cache(ds).path)
    (upload_dir / FILL).mkdir(parents=True, mode=0o700)
    held = [os.open(upload_dir / FILL / (entry.name + ".lock"), os.O_RDWR | os.O_CREAT) for entry in entries]
    try:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in held:
            os.close(fd)


def test_a_fill_held_by_a_stopped_process_is_waited_for_a_bounded_time(dataset, tmp_path, monkeypatch, caplog):
    """A process stopped (SIGSTOP) while it fills a shard holds the shard's lock: the others
    wait for it a bounded time, then read that shard from the store."""
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache)
    monkeypatch.setattr(upload_cache, "_PATIENCE", 0.2)
    with _fills_held(ds, reader.manifest.shards[:1]), caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
    assert len(_cached(cache)) == len(reader.manifest.shards) - 1
    waited = [r for r in caplog.records if "another process has fetched" in r.getMessage()]
    assert len(waited) == 1  # once for the shard, not once for each of its reads


def test_a_process_stopped_holding_several_fills_is_waited_for_once_not_once_a_shard(dataset, tmp_path, monkeypatch,
                                                                                    caplog):
    """A process stopped while it fills several shards holds all their locks. Once a wait for
    one of them runs out, the others are read from the store without waiting (those under way
    end with it): one wait in all, said once, not one a shard."""
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache, fetch=FetchConfig(concurrency=1))
    monkeypatch.setattr(upload_cache, "_PATIENCE", 0.3)
    with _fills_held(ds, reader.manifest.shards), caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
    assert len(reader.manifest.shards) >= 3 and not _cached(cache)
    waited = [r.getMessage() for r in caplog.records if "another process has fetched" in r.getMessage()]
    assert len(waited) == 1, waited
    assert "the shards other processes are fetching" in waited[0]


def _upload_cache(ds: RemoteDataset) -> upload_cache.UploadCache:
    cache = ds.reader.upload_cache()
    assert cache is not None
    return cache


def test_the_cli_shows_and_clears_a_cache(dataset, tmp_path):
    store, bucket, reader, _ = dataset
    cache = tmp_path / "cache"
    list(RemoteDataset(store, bucket, "d", cache_dir=cache))
    script = Path(sys.executable).with_name("remote-loader")
    shown = json.loads(subprocess.run([str(script), "cache", str(cache), "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert shown["bytes"] == _shard_bytes(reader)
    (only,) = shown["datasets"]
    assert only["shards"] == len(reader.manifest.shards) and only["dataset"].startswith(f"s3://{bucket}/d ")
    assert only["uploads"] == [f"{reader.identity:08x}"]
    cleared = subprocess.run([str(script), "cache", "--clear"], capture_output=True, text=True, check=True,
                             env={**os.environ, "REMOTE_LOADER_CACHE_DIR": str(cache)})
    assert f"removed {_shard_bytes(reader) / 1e6:,.1f} MB" in cleared.stdout
    assert _cached(cache) == {}
    assert not list(cache.rglob("*.lock"))[1:]  # the cache's own lock alone: no shard's is left
    missing = subprocess.run([str(script), "cache", str(tmp_path / "no-such-cache")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no-such-cache is not a directory" in missing.stderr
    assert not (tmp_path / "no-such-cache").exists()
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    refused = subprocess.run([str(script), "cache", str(open_to_all), "--clear"], capture_output=True, text=True)
    assert refused.returncode == 2 and "can be written by every user and has no sticky bit" in refused.stderr


def test_persistent_dataloader_workers_share_the_cache(dataset, tmp_path):
    """Two persistent workers fill one cache in epoch 1 (each shard once between them) and
    read it in epoch 2; the counters summed over the workers say so."""
    from torch.utils.data import DataLoader

    store, bucket, reader, clean = dataset
    ds = RemoteDataset(store, bucket, "d", cache_dir=tmp_path / "cache")
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    assert _samples(loader) == clean
    fetched = ds.metrics.as_dict()
    assert fetched["bytes"] == _shard_bytes(reader)
    assert _samples(loader) == clean
    assert ds.metrics.bytes == fetched["bytes"] and ds.metrics.cached_bytes > fetched["cached_bytes"]


def test_the_first_samples_of_a_shard_come_before_the_rest_of_it(tmp_path):
    """A shard is fetched into the cache in parts, the part a reader asked for first, then
    the last one (its index); the reader reads its samples as their parts arrive, not once the
    shard is whole. Here the parts between the first and the last are held back until the
    first sample has come: two GETs at a time, one shard of four parts."""
    release, held = threading.Event(), []

    class Holding(LocalStore):
        get_range_into = Store.get_range_into  # through get_range

        def get_range(self, bucket, key, start, end):
            if key.endswith(".tar") and 0 < start and end < size:
                held.append(start)
                assert release.wait(300), "the middle parts were never released"
            return super().get_range(bucket, key, start, end)

    store = Holding(tmp_path / "store")
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(80, size=(500, 375)), maxcount=1000)
    reader = DatasetReader(store, "b", "d")
    (entry,) = reader.manifest.shards
    size = entry.size
    assert size > 3 << 20
    fetch = FetchConfig(part_size=1 << 20, concurrency=2)
    ds = RemoteDataset(store, "b", "d", cache_dir=tmp_path / "cache", fetch=fetch)
    samples = iter(ds)
    first = in_daemon_thread(lambda: next(samples))
    done, _ = wait([first], timeout=300)  # a guard against a hang, not a time to meet: seconds, however busy
    got_first_while_held = bool(done) and not release.is_set()
    release.set()
    rest = [first.result(), *samples]
    assert got_first_while_held and held
    assert _samples(rest) == _samples(reader)
    assert len(_cached(tmp_path / "cache")) == 1


def test_a_shard_read_after_many_others_is_read_through_the_cache_however_long_ago_its_index_came(
        dataset, tmp_path, monkeypatch):
    """A map-style reader keeps a hot shard's index while it reads those of many others: the
    hot shard's samples still come from the node's cache. A session that knew which objects
    were shards by the last 4,096 indexes it had read (the bound lowered to 2 here, where a
    session still has one) sent them to the store: here, where the shard is gone, an error."""
    from remote_loader.read import session as sessions

    monkeypatch.setattr(sessions, "_EXPECTED", 2, raising=False)
    store, bucket, reader, _ = dataset
    ds = RemoteMapDataset(store, bucket, "d", cache_dir=tmp_path / "cache", cache_shards=16)
    hot_shard = ds.locate(0)[0]
    hot = {i: ds[i] for i in range(SAMPLES) if ds.locate(i)[0] == hot_shard}
    for i in sorted({ds.locate(i)[0]: i for i in range(SAMPLES)}.values()):  # every shard's index read, and cached
        ds[i]
    store.delete(bucket, f"d/{reader.manifest.shards[hot_shard].name}")
    assert len(hot) == PER_SHARD and {i: ds[i] for i in hot} == hot


def test_a_running_reader_is_told_of_an_overwrite_at_its_next_pass(dataset, tmp_path):
    """Its shards all in the cache, a reader would never ask the store for one again: at the
    start of each pass it reads the manifest, and the old upload is not read on."""
    store, bucket, reader, clean = dataset
    ds = RemoteDataset(store, bucket, "d", cache_dir=tmp_path / "cache")
    assert _samples(ds) == clean
    upload(store, bucket, "d", SyntheticImages(SAMPLES, size=(64, 48), seed=7), maxcount=PER_SHARD, overwrite=True)
    with pytest.raises(DatasetChanged, match="replaced by another upload"):
        list(ds)


def test_a_shard_renamed_into_place_while_the_space_is_counted_is_counted(tmp_path, monkeypatch):
    """A fill renames its part into place while another process counts the space: the shard
    is counted at least once (a count that missed it let reservations go past the bound)."""
    from remote_loader.read import folder as folders

    cache = NodeCache(CacheConfig(str(tmp_path / "cache")))
    upload_dir = Path(cache.path) / ("0" * 20) / "0badc0de"
    cache.root()
    (upload_dir / FILL).mkdir(parents=True, mode=0o700)
    (upload_dir / FILL / "s.tar.part").write_bytes(b"x" * 8192)
    held = os.open(upload_dir / FILL / "s.tar.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # a fill under way
    listed = folders.Folder.files

    def listing_then_rename(self):
        found = listed(self)
        if (upload_dir / FILL / "s.tar.part").exists():  # between this listing and the next one
            os.rename(upload_dir / FILL / "s.tar.part", upload_dir / "s.tar")
        return found

    monkeypatch.setattr(folders.Folder, "files", listing_then_rename)
    try:
        assert sum(f.size for f in cache.files()) >= 8192
    finally:
        os.close(held)


def test_a_file_the_full_disk_refuses_leaves_no_temporary_file_behind(tmp_path, monkeypatch):
    """A write that fails (ENOSPC) is raised, and neither the file nor its temporary one is
    left (one was left at each process start, on a full disk: its ``CACHEDIR.TAG``)."""
    from remote_loader.read import folder as folders

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    folder = folders.Folder.named(str(tmp_path / "cache"))
    monkeypatch.setattr(folders.os, "write", full)
    with pytest.raises(OSError) as failed:
        folder.write("CACHEDIR.TAG", b"Signature: 8a477f597d28d172789f06886806bc55\n")
    monkeypatch.undo()
    assert failed.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path / "cache") == []


PART = 256 << 10


class _FlipFirstPartHoldFourth(FaultProxy):
    """The first GET of a shard's first part of ``PART`` bytes comes with a byte flipped; its
    fourth part is held until the proxy is released or closed, so its fill stays under way."""

    def _fault(self, handler):
        super()._fault(handler)  # counted; no rates of its own
        wanted = handler.headers.get("Range", "")
        if handler.command != "GET" or ".tar" not in handler.path:
            return None
        if wanted == f"bytes=0-{PART - 1}" and self.seen("GET", handler.path, wanted) == 1:
            with self._lock:
                self.injected["flip"] += 1
            return "flip"
        return "hold" if wanted == f"bytes={3 * PART}-{4 * PART - 1}" else None


def test_bytes_damaged_in_a_fill_under_way_are_fetched_again_from_the_store(seaweed, tmp_path):
    # The refetch of a sample read from a shard's fill under way read the same damaged part
    # file again, every attempt: CorruptSampleError where the store had good bytes.
    client = seaweed.client()
    upload_to_new_bucket(client, "cache-fill-flip", "d", SyntheticImages(40, size=(256, 256)), maxcount=40)  # a shard
    reader = DatasetReader(client, "cache-fill-flip", "d")
    (entry,) = reader.manifest.shards
    assert entry.size > 4 * PART
    index = reader.read_index(entry)
    early = [k for k in range(len(index)) if int((index.offsets[k] + index.sizes[k]).max()) < 3 * PART]
    direct = RemoteMapDataset(client, "cache-fill-flip", "d")
    clean = {k: direct[k] for k in early}
    proxy = _FlipFirstPartHoldFourth(seaweed.endpoint_url, {})
    try:
        ds = RemoteMapDataset(make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key),
                              "cache-fill-flip", "d", cache_dir=tmp_path / "cache", fetch=FetchConfig(part_size=PART))
        for k in early:  # the fourth part held: the fill is under way throughout
            assert ds[k] == clean[k]
        assert proxy.injected["flip"] == 1 and ds.metrics.retries >= 1
        assert not _cached_paths(tmp_path / "cache")  # the fill had not ended: its fourth part is held
    finally:
        proxy.close()


def test_a_write_into_cached_shards_mid_epoch_is_caught_under_cache_verify(dataset, tmp_path):
    # docs/cache.md: ranges already open are read as the file then lies; cache_verify checks them.
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    list(RemoteDataset(store, bucket, "d", cache_dir=cache))
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_verify=True)
    got = Counter()
    for k, sample in enumerate(ds):
        got[(sample["__key__"], bytes(sample["jpg"]), bytes(sample["cls"]))] += 1
        if k == 0:  # another program writes zeros into every cached file, in place
            for path in _cached_paths(cache):
                with open(path, "r+b") as file:
                    file.write(bytes(path.stat().st_size))
    assert got == clean and ds.metrics.retries >= 1


def test_shards_filling_at_once_share_fetch_concurrency(tmp_path):
    """``FetchConfig.concurrency`` bounds the GETs a process has in flight, the node cache's
    fetches of whole shards included: shards filling at once share it. (Each shard was
    filled on threads of its own, up to 8 GETs each: eight shards overflowed a client's
    32 connections.) Each GET of a shard here waits, a while, for one more to join it, so that
    any that can run at once do; how long it waits decides nothing."""
    concurrency, at_once, most = 3, [0], [0]
    changed = threading.Condition()

    class Counting(LocalStore):
        get_range_into = Store.get_range_into  # through get_range

        def get_range(self, bucket, key, start, end):
            if not key.endswith(".tar"):
                return super().get_range(bucket, key, start, end)
            with changed:
                at_once[0] += 1
                most[0] = max(most[0], at_once[0])
                changed.notify_all()
                changed.wait_for(lambda: at_once[0] > concurrency, timeout=0.2)
            try:
                return super().get_range(bucket, key, start, end)
            finally:
                with changed:
                    at_once[0] -= 1

    store = Counting(tmp_path / "store")
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(48, size=(500, 375)), maxcount=6)
    reader = DatasetReader(store, "b", "d")
    assert len(reader.manifest.shards) == 8 and min(e.size for e in reader.manifest.shards) > 3 * (64 << 10)
    fetch = FetchConfig(part_size=64 << 10, concurrency=concurrency)
    ds = RemoteDataset(store, "b", "d", cache_dir=tmp_path / "cache", fetch=fetch)
    assert _samples(ds) == _samples(reader)
    assert len(_cached(tmp_path / "cache")) == 8
    assert 1 < most[0] <= concurrency


def test_a_fill_maps_only_its_parts_on_their_way_not_the_whole_shard(tmp_path):
    """A shard filling the cache was mapped whole while its parts arrived, and every page
    written stayed in the process's memory until the fill ended: three shards of 400 MB filling
    at once held 1,063 MB of mapped file beside 156 MiB of ranges. Each part is mapped while it
    is received: a GET finds at most ``concurrency`` parts of the cache's files mapped (the
    sizes of the mappings in /proc/self/maps, not memory used)."""
    part, concurrency, mapped = 64 << 10, 2, []
    cache = tmp_path / "cache"

    def cache_mappings() -> int:
        total = 0
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().startswith(os.path.realpath(cache)):
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    total += high - low
        return total

    class Watching(LocalStore):
        def get_range_into(self, bucket, key, start, end, out):
            if key.endswith(".tar"):
                mapped.append(cache_mappings())
            super().get_range_into(bucket, key, start, end, out)

    store = Watching(tmp_path / "store")
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(48, size=(500, 375)), maxcount=12)
    reader = DatasetReader(store, "b", "d")
    assert min(e.size for e in reader.manifest.shards) > 4 * part
    ds = RemoteDataset(store, "b", "d", cache_dir=cache, fetch=FetchConfig(part_size=part, concurrency=concurrency))
    assert _samples(ds) == _samples(reader)
    assert len(_cached(cache)) == len(reader.manifest.shards)
    assert mapped and 0 < max(mapped) <= concurrency * part, f"{max(mapped):,} bytes of the cache mapped at a GET"


def test_a_part_a_reader_waits_for_takes_the_next_free_slot_before_parts_queued_earlier():
    """Of the parts waiting for a GET slot, those a reader waits for go first; the rest in the
    order they came. A part waiting when its reader is closed gives up (``Cancelled``)."""
    from remote_loader.read.shard_fill import Slots
    from remote_loader.storage.retrying import Cancelled

    slots, order, release, never = Slots(1), [], threading.Event(), threading.Event()

    def take(name, urgent, queued):
        def run():
            with slots.held(urgent, never):
                if name == "holder":
                    queued.set()
                    assert release.wait(300)
                order.append(name)
        return in_daemon_thread(run)

    def queued() -> int:
        with slots._changed:
            return len(slots._rest) + len(slots._urgent)

    holding = threading.Event()
    holder = take("holder", False, holding)
    assert holding.wait(300)
    waiting = []
    for name, urgent in [("first", False), ("second", False), ("wanted", True)]:
        waiting.append(take(name, urgent, threading.Event()))
        deadline = time.monotonic() + 300
        while queued() < len(waiting):  # each in line before the next comes
            assert time.monotonic() < deadline
            time.sleep(0.01)
    release.set()
    wait([holder, *waiting], timeout=300)
    assert order == ["holder", "wanted", "first", "second"]

    cancel = threading.Event()
    with slots.held(False, never):
        cancel.set()
        with pytest.raises(Cancelled):
            with slots.held(True, cancel):
                pass
    with slots.held(True, never):  # the slot is free again, and the queue empty
        assert not slots._urgent and not slots._rest


def _larger_shards(store_dir: Path):
    """Eight shards of about 300 kB, read in ranges of 64 KiB: several ranges a shard."""
    store = LocalStore(store_dir)
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(48, size=(500, 375)), maxcount=6)
    reader = DatasetReader(store, "b", "d")
    assert min(e.size for e in reader.manifest.shards) > 3 * (64 << 10)
    return store, reader, FetchConfig(part_size=64 << 10, range_bytes=64 << 10, concurrency=2)


def test_a_shard_that_cannot_be_put_in_place_is_fetched_whole_once_and_said(tmp_path, caplog):
    """A folder planted where a shard goes: its fetch into the cache cannot end in place. That
    shard is read from the store, as without a cache, with one warning. (Every range of it
    began another fetch of the whole shard, silently: 10-17 times its bytes.)"""
    store, reader, fetch = _larger_shards(tmp_path / "store")
    ds = RemoteDataset(store, "b", "d", cache_dir=tmp_path / "cache", fetch=fetch)
    NodeCache(ds.reader.cache).root()
    upload_dir = Path(_upload_cache(ds).path)
    upload_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    planted = reader.manifest.shards[3]
    (upload_dir / node_cache.file_name(planted.name)).mkdir()
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == _samples(reader)
        assert _samples(ds) == _samples(reader)
    said = [r.getMessage() for r in caplog.records if "cannot be put in place" in r.getMessage()]
    assert len(said) == 1 and planted.name in said[0]
    total = _shard_bytes(reader)
    # The planted one: whole once for the fill, then as without a cache: the rest of epoch 1
    # (as little as nothing, where the fill ends first) and epoch 2, with its index read each time.
    assert ds.metrics.bytes <= total + 3 * planted.size + 4096
    assert (upload_dir / node_cache.file_name(planted.name)).is_dir()  # what was planted stays


def test_a_damaged_copy_that_cannot_be_removed_is_read_from_the_store(dataset, tmp_path, caplog, monkeypatch):
    """A cached shard damaged on disk and not removable (an immutable file, a file system gone
    read-only): its samples come from the store, said once. (Each read served the same damaged
    file again, and the epoch ended in ``CorruptSampleError``.)"""
    from remote_loader.read.folder import Folder

    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache)
    assert _samples(ds) == clean
    damaged = sorted(_cached_paths(cache))[0]
    data = bytearray(damaged.read_bytes())
    data[600:664] = bytes(b ^ 0xFF for b in data[600:664])  # inside the first member
    damaged.write_bytes(bytes(data))
    unlink = Folder.unlink

    def immutable(self, name):
        if name == damaged.name:
            raise PermissionError(1, "Operation not permitted")
        return unlink(self, name)

    monkeypatch.setattr(Folder, "unlink", immutable)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
        assert _samples(ds) == clean
    said = [r.getMessage() for r in caplog.records if "cannot be removed" in r.getMessage()]
    assert len(said) == 1 and damaged.name in said[0]
    assert damaged.read_bytes() == bytes(data)  # not written to: the store's bytes are read instead


def test_a_bound_smaller_than_a_shard_is_said_once_and_leaves_no_part(dataset, tmp_path, caplog):
    store, bucket, reader, clean = dataset
    cache = tmp_path / "cache"
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
    said = [r.getMessage() for r in caplog.records if "no room" in r.getMessage()]
    assert len(said) == 1 and "under its bound" in said[0]
    assert not list(cache.rglob("*.part")) and not _cached(cache)


def test_a_full_disk_is_looked_at_again_and_the_cache_used_once_there_is_room(dataset, tmp_path, caplog,
                                                                             monkeypatch):
    """A disk found full (ENOSPC as a shard's space is allocated) keeps that shard out, with
    one warning; the cache is looked at again later (every ``_FULL_FOR`` seconds, none here),
    and shards go into it once there is room. (One full disk turned the cache off for the
    rest of the process's life.)"""
    import errno

    store, bucket, reader, clean = dataset
    allocate, refused = upload_cache._allocate, []

    def full_once(fd, size):
        if not refused:
            refused.append(size)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allocate(fd, size)

    monkeypatch.setattr(upload_cache, "_allocate", full_once)
    monkeypatch.setattr(upload_cache, "_FULL_FOR", 0.0)
    cache = tmp_path / "cache"
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        assert _samples(ds) == clean
        assert len(_cached(cache)) >= len(reader.manifest.shards) - 1  # that shard too, at a later read of it
        assert _samples(ds) == clean
    assert len(_cached(cache)) == len(reader.manifest.shards) and refused
    said = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(said) == 1 and "the disk is full" in said[0], said
    _check_whole(cache, reader)


def test_each_dataset_of_a_process_keeps_to_its_own_bound(dataset, tmp_path):
    """``cache_bytes`` bounds the fills of the dataset given it, in one process as in several:
    a dataset made after another of the same upload with a larger bound keeps to its own."""
    store, bucket, reader, clean = dataset
    total, cache = _shard_bytes(reader), tmp_path / "cache"
    large = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_bytes="1G")
    assert _samples(large) == clean and sum(len(data) for data in _cached(cache).values()) == total
    NodeCache(CacheConfig(str(cache))).clear()  # a change of mind: the cache emptied, a smaller bound
    bound = int(total * 0.45)
    small = RemoteDataset(store, bucket, "d", cache_dir=cache, cache_bytes=bound)
    assert _samples(small) == clean
    assert 0 < sum(len(data) for data in _cached(cache).values()) <= bound
    assert _samples(large) == clean  # and the first, still in use, fills to its own
    assert sum(len(data) for data in _cached(cache).values()) == total



@pytest.mark.parametrize("reader", ["a new dataset", "the same dataset"])
def test_a_cache_directory_removed_and_made_again_is_used_again(dataset, tmp_path, caplog, reader):
    """A cache directory removed (``rm -rf``, a cleaner of ``/tmp``) and made again is used
    again in the same process, by a dataset made after it and by one read before it (from its
    next pass): nothing of the removed folders is kept, and no warning says the new directory
    cannot be written."""
    import shutil

    store, bucket, _, clean = dataset
    cache = tmp_path / "cache"
    first = RemoteDataset(store, bucket, "d", cache_dir=cache)
    assert _samples(first) == clean
    total = first.metrics.bytes
    shutil.rmtree(cache)
    cache.mkdir()
    ds = RemoteDataset(store, bucket, "d", cache_dir=cache) if reader == "a new dataset" else first
    before = ds.metrics.bytes
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        for _ in range(3):
            assert _samples(ds) == clean
    assert ds.metrics.bytes - before == total and len(_cached(cache)) == len(first.reader.manifest.shards)
    assert not [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]


def _entries_listed(monkeypatch) -> list[int]:
    """From now on, the number of directory entries the cache's folders list (one cell, added to)."""
    from remote_loader.read import folder as folders

    listed, entries = [0], folders.Folder.entries

    def counted(self):
        found = entries(self)
        listed[0] += len(found)
        return found

    monkeypatch.setattr(folders.Folder, "entries", counted)
    return listed


def _a_cache(tmp_path: Path, max_bytes: int) -> tuple[NodeCache, Path, Path]:
    """A cache bounded by ``max_bytes``, made, and the folders of two uploads of two datasets in it."""
    cache = NodeCache(CacheConfig(str(tmp_path / "cache"), max_bytes=max_bytes))
    cache.root()
    own, other = Path(cache.path) / ("0" * 20) / "0badc0de", Path(cache.path) / ("1" * 20) / "0badf00d"
    for upload_dir in (own, other):
        (upload_dir / FILL).mkdir(parents=True, mode=0o700)
    return cache, own, other


def test_reserving_space_for_a_shard_lists_no_entry_a_shard_cached(tmp_path, monkeypatch):
    """Before each shard is fetched into the cache, its space is reserved under the lock every
    process of the node shares. Counting the space by listing every file cached made each
    reservation cost one stat a shard cached, and the first epoch quadratic (5,000 shards of
    2 samples: 4.7 s for the 500 after the first 500, 26 s for those after 2,000). The count
    is kept beside the lock: 100 reservations list fewer entries than the cache holds shards."""
    monkeypatch.setattr(node_cache, "_RECOUNT", 3600.0)  # no count falls due during the test
    cache, own, _ = _a_cache(tmp_path, 10**9)
    for k in range(300):
        (own / f"{k}.tar").write_bytes(b"x" * 100)
    listed = _entries_listed(monkeypatch)
    assert cache.reserve(100, str(own), lambda: None)  # the first counts what the cache holds
    assert listed[0] >= 300
    listed[0] = 0
    for k in range(300, 400):
        assert cache.reserve(100, str(own), lambda: None)
        (own / f"{k}.tar").write_bytes(b"x" * 100)  # the fill's shard, renamed into place
    assert listed[0] < 300, f"100 reservations listed {listed[0]} entries"


def test_the_first_epoch_through_the_cache_lists_its_files_not_once_a_shard(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(120, size=(16, 16)), maxcount=2)  # 60 shards
    reader = DatasetReader(store, "b", "d")
    shards = len(reader.manifest.shards)
    listed = _entries_listed(monkeypatch)
    ds = RemoteDataset(store, "b", "d", cache_dir=tmp_path / "cache", cache_bytes="1G")
    assert _samples(ds) == _samples(reader) and len(_cached(tmp_path / "cache")) == shards
    assert listed[0] < 2 * shards, f"{listed[0]} entries listed to fill {shards} shards"


_FILLING = """
import fcntl, os, sys
from remote_loader.config import CacheConfig
from remote_loader.read.node_cache import NodeCache
fill = os.path.join(sys.argv[3], ".fill")
part = os.open(fill + "/s.tar.part", os.O_RDWR | os.O_CREAT)
lock = os.open(fill + "/s.tar.lock", os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX)  # a fill under way, until this process ends
cache = NodeCache(CacheConfig(sys.argv[1], max_bytes=int(sys.argv[2])))
print(cache.reserve(600_000, sys.argv[3], lambda: os.posix_fallocate(part, 0, 600_000)), flush=True)
sys.stdin.read()
"""


def test_a_count_that_evicts_makes_room_for_the_fills_after_it(tmp_path, monkeypatch):
    """Filling a cache full of other datasets' shards counted every file at each fill, to
    evict one shard: 100 fills listed 100 times the 100 cached. A count that evicts now
    makes room for a twentieth of the bound more, so the next fills count nothing."""
    monkeypatch.setattr(node_cache, "_RECOUNT", 3600.0)
    cache, own, other = _a_cache(tmp_path, 1_000_000)
    for k in range(100):
        (other / f"s{k:03d}.tar").write_bytes(b"x" * 10_000)
    listed = _entries_listed(monkeypatch)
    for k in range(100):
        assert cache.reserve(10_000, str(own), lambda k=k: (own / f"s{k:03d}.tar").write_bytes(b"y" * 10_000))
    assert listed[0] <= 25 * 102, f"{listed[0]} entries listed for 100 fills"
    held = sum(f.stat().st_size for f in (*own.glob("*.tar"), *other.glob("*.tar")))
    assert held <= 1_000_000 and len(list(own.glob("*.tar"))) == 100  # the bound kept, every fill made


def test_a_reservation_counts_the_space_another_process_reserved(tmp_path):
    """The bound holds across the processes of a node: space another process reserved, for a
    fill still under way, keeps out a reservation that would not fit beside it (nothing is
    left to evict), whatever this process counted before."""
    cache, own, other = _a_cache(tmp_path, 1_000_000)
    assert cache.reserve(100, str(other), lambda: None)  # this process has counted the space once
    filling = subprocess.Popen([sys.executable, "-c", _FILLING, cache.config.directory, "1000000", str(own)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert filling.stdout is not None and filling.stdout.readline().split() == ["True"]
        assert not cache.reserve(600_000, str(other), lambda: None)
        assert cache.reserve(300_000, str(other), lambda: None)  # what fits beside it still fits
    finally:
        filling.communicate(timeout=120)


def test_space_a_killed_fill_reserved_is_given_back_at_the_next_count(tmp_path, monkeypatch):
    """A process killed mid-fill leaves its part, its lock no longer held. Its space stays
    counted until the space is next counted, which removes the part: a reservation that
    fits once it is gone is made, and evicts nothing for it."""
    monkeypatch.setattr(node_cache, "_RECOUNT", 3600.0)
    cache, own, other = _a_cache(tmp_path, 1_000_000)
    (other / "old.tar").write_bytes(b"x" * 300_000)  # another dataset's shard: evicted where room is needed
    part = os.open(own / FILL / "s.tar.part", os.O_RDWR | os.O_CREAT)
    lock = os.open(own / FILL / "s.tar.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        assert cache.reserve(600_000, str(own), lambda: os.posix_fallocate(part, 0, 600_000))
    finally:
        os.close(part)
        os.close(lock)  # killed: its part stays, its lock is free
    assert cache.reserve(600_000, str(own), lambda: None)
    assert not (own / FILL / "s.tar.part").exists() and (other / "old.tar").exists()


def test_a_file_the_count_did_not_see_is_counted_once_the_count_is_due(tmp_path, monkeypatch):
    """Space taken in the cache without a reservation (by a version of this library that keeps
    no count) is counted when the count is next due: no reservation misses it for good."""
    monkeypatch.setattr(node_cache, "_RECOUNT", 3600.0)
    cache, own, other = _a_cache(tmp_path, 1_000_000)
    assert cache.reserve(100, str(own), lambda: None)
    (other / "big.tar").write_bytes(b"x" * 900_000)
    monkeypatch.setattr(node_cache, "_RECOUNT", 0.0)  # the count is due
    monkeypatch.setattr(node_cache, "_RECOUNT_SHARE", 0.0)
    assert cache.reserve(200_000, str(own), lambda: None)
    assert not (other / "big.tar").exists()  # counted, and evicted to make room


def _descriptors(within: Path | None = None) -> int:
    """The descriptors this process has open (of files ``within`` a folder, where given), once
    what nothing refers to is collected."""
    gc.collect()
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed since
            found += within is None or os.readlink(f"/proc/self/fd/{fd}").startswith(f"{within}/")
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors listed in /proc/self/fd")
def test_datasets_read_through_the_cache_and_dropped_leave_no_folder_open(tmp_path):
    """Each dataset read through the cache kept three folders of it open for the rest of the
    process, one set a dataset, bound and upload read: 300 datasets made, read and dropped
    left 900 descriptors open, and past the usual limit of 1,024 the cache turned itself off
    and the user's own ``open()`` failed (EMFILE). A dataset's folders are closed once nothing
    uses them; those in use share the cache's folder."""
    store = LocalStore(tmp_path / "store")
    store.create_bucket("b")
    for k in range(30):
        upload(store, "b", f"d{k}", SyntheticImages(4, size=(8, 8), seed=k), maxcount=2)
    cache = tmp_path / "cache"

    def read(folder: str, **options) -> RemoteDataset:
        ds = RemoteDataset(store, "b", folder, cache_dir=cache, **options)
        assert len(list(ds)) == 4
        return ds

    read("d0")  # what a process makes once (not the cache's)
    before = _descriptors()
    for k in range(30):
        read(f"d{k}")
    for bound in range(10):
        read("d0", cache_bytes=10**9 + bound)
    assert _descriptors() <= before
    held = [read(f"d{k}") for k in range(10)]  # a dataset holds shared memory of its own: counted apart
    assert _descriptors(cache) <= 2 * len(held) + 1  # an upload's folder and its .fill, each; the cache's, once
    del held
    ds = read("d0")
    reading = _descriptors()
    for seed in range(1, 6):  # overwritten between passes: the pass after reads the new upload
        upload(store, "b", "d0", SyntheticImages(4, size=(8, 8), seed=seed), maxcount=2, overwrite=True)
        with pytest.raises(DatasetChanged):
            list(ds)
        assert len(list(ds)) == 4
    assert _descriptors() <= reading


_AT_EXIT = """
import atexit, os, sys
atexit.register(lambda: print(os.fstat(folder.fd).st_ino == os.stat(sys.argv[1]).st_ino, flush=True))  # runs last
from remote_loader.read.folder import Folder
folder = Folder.named(sys.argv[1])
"""


def test_a_folder_of_the_cache_in_use_at_exit_stays_open_until_the_process_ends(tmp_path):
    """Fills run on daemon threads, which go on while the interpreter exits. The folders they
    write in were closed by the exit's finalizers meanwhile: a fill's next call failed with
    EBADF (the cache said it "cannot be written" as the program ended), or reached whatever
    another thread had opened since under that descriptor. The process's end closes them."""
    there = subprocess.run([sys.executable, "-c", _AT_EXIT, str(tmp_path)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert there.stdout.split() == ["True"], there.stderr[-2000:]
