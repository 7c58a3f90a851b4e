"""The catalogue of bad inputs: each gets its own exception type and a one-line message."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pathlib
import re
import struct
import tarfile
import threading
import zlib

import msgpack
import pytest
from torch.utils.data import DataLoader

from remote_loader import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    CorruptShard,
    DecodeError,
    ImageFolder,
    IndexOutOfBounds,
    LocalitySampler,
    LocalStore,
    ObjectNotFound,
    RandomResizedCrop,
    RemoteDataset,
    RemoteMapDataset,
    RetryConfig,
    StorageConfig,
    StorageError,
    UnsupportedVersion,
    make_client,
    upload_cv_dataset,
)
from remote_loader.format import MANIFEST_NAME, Manifest
from remote_loader.pipeline.stages.decode import decode_sample
from remote_loader.storage import Location
from remote_loader.testing.synthetic import SyntheticImages
from remote_loader.upload.indexer import index_webdataset
from tests.helpers import upload

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "remote_loader"


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture
def small(s3):
    client, bucket = s3
    upload(client, bucket, "ok", SyntheticImages(20, size=(32, 24)), maxcount=10)
    return client, bucket


def seal(raw: dict) -> bytes:
    body = msgpack.packb(raw, use_bin_type=True)
    return body + struct.pack("<I", zlib.crc32(body))


def manifest_raw(client, bucket) -> dict:
    """The stored manifest as a version 1 map (one row per shard), to edit by hand; readers read both versions."""
    manifest = Manifest.decode(client.get(bucket, f"ok/{MANIFEST_NAME}"))
    return msgpack.unpackb(dataclasses.replace(manifest, shards=manifest.shards.table(), version=1).encode()[:-4])


def test_wrong_credentials(seaweed, small):
    _, bucket = small
    bad = make_client(seaweed.endpoint_url, seaweed.access_key, "not-the-secret")
    with pytest.raises(AccessDenied) as info:
        len(RemoteDataset(bad, bucket, "ok"))
    assert "not-the-secret" not in one_line(info.value)


def test_missing_bucket_and_manifest(small):
    client, bucket = small
    with pytest.raises(BucketNotFound) as info:
        len(RemoteDataset(client, bucket + "-missing", "ok"))
    one_line(info.value)
    with pytest.raises(ObjectNotFound, match="no dataset at .*manifest.msgpack is missing"):
        len(RemoteMapDataset(client, bucket, "nothing-here"))


def test_manifest_of_a_newer_version(small):
    client, bucket = small
    raw = manifest_raw(client, bucket)
    raw["version"] = 99
    client.put(bucket, f"ok/{MANIFEST_NAME}", seal(raw))
    with pytest.raises(UnsupportedVersion, match="version 99") as info:
        len(RemoteDataset(client, bucket, "ok"))
    one_line(info.value)


def test_truncated_manifest(small):
    client, bucket = small
    data = client.get(bucket, f"ok/{MANIFEST_NAME}")
    client.put(bucket, f"ok/{MANIFEST_NAME}", data[: len(data) // 2])
    with pytest.raises(CorruptShard, match="manifest"):
        len(RemoteDataset(client, bucket, "ok"))


def test_index_pointing_outside_the_object(small):
    client, bucket = small
    raw = manifest_raw(client, bucket)
    name, samples, size = raw["shards"][0][:3]
    raw["shards"][0][3] = size + 100  # index_offset past the end of the shard
    client.put(bucket, f"ok/{MANIFEST_NAME}", seal(raw))
    with pytest.raises(IndexOutOfBounds, match=name):
        len(RemoteMapDataset(client, bucket, "ok"))


def test_truncated_index(small):
    client, bucket = small
    raw = manifest_raw(client, bucket)
    raw["shards"][0][4] -= 10  # index_size: the index is cut short, its crc32 no longer matches
    client.put(bucket, f"ok/{MANIFEST_NAME}", seal(raw))
    ds = RemoteMapDataset(client, bucket, "ok")
    with pytest.raises(CorruptShard, match=raw["shards"][0][0]):
        ds[0]


def test_non_image_bytes_at_decode():
    with pytest.raises(DecodeError, match="field 'jpg' of sample 'k1' in s.tar is not a decodable image"):
        decode_sample({"__key__": "k1", "__shard__": "s.tar", "jpg": b"<html>not an image</html>"}, "pil")
    with pytest.raises(DecodeError, match="not an integer class"):
        decode_sample({"__key__": "k1", "__shard__": "s.tar", "cls": b"cat"}, "pil")
    with pytest.raises(DecodeError, match="field 'txt' of sample 'k1' in s.tar is not UTF-8 text") as caught:
        decode_sample({"__key__": "k1", "__shard__": "s.tar", "txt": b"caf\xe9"}, "pil")
    assert (caught.value.key, caught.value.field) == ("k1", "txt")
    with pytest.raises(DecodeError, match="not valid JSON"):
        decode_sample({"__key__": "k1", "__shard__": "s.tar", "json": b"\xff{"}, "pil")


def test_local_keys_cannot_escape_their_bucket(tmp_path):
    store = LocalStore(tmp_path / "root")
    store.create_bucket("b")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path, tmp_path / "root" / "b" / "link")
    for key in ["../../secret.txt", "/etc/passwd", "a/../../x", "link/secret.txt", ""]:
        with pytest.raises(StorageError, match="key"):
            store.get("b", key)
        with pytest.raises(StorageError):
            store.put("b", key, b"x")
    with pytest.raises(StorageError, match="bucket"):
        store.get("..", "secret.txt")


@pytest.mark.parametrize("planted", ["dangling link", "link to a file", "fifo", "directory"])
def test_a_local_conditional_write_neither_follows_nor_waits_on_what_is_planted_at_its_lock(tmp_path, planted):
    store = LocalStore(tmp_path / "root")
    store.create_bucket("b")
    lock, outside = tmp_path / "root" / "b" / ".rl-partial-lock", tmp_path / "outside"
    if planted == "dangling link":
        lock.symlink_to(outside)
    elif planted == "link to a file":
        outside.write_bytes(b"theirs")
        lock.symlink_to(outside)
    elif planted == "fifo":
        os.mkfifo(lock)  # opened for writing it would wait for a reader forever
    else:
        lock.mkdir()
    with pytest.raises(StorageError, match=r"\.rl-partial-lock .*: (remove it|remove what is there)\n"):
        store.put("b", "k", b"x", if_none_match=True)
    assert not (tmp_path / "root" / "b" / "k").exists() and [p.name for p in lock.parent.iterdir()] == [lock.name]
    assert outside.read_bytes() == b"theirs" if planted == "link to a file" else not outside.exists()


# Between a process and its decoding process: a socket pair only the two hold, as
# multiprocessing pickles between its processes. Nothing read from a store goes there.
PICKLES_BETWEEN_PROCESSES = {PACKAGE / "pipeline" / "device" / "channel.py"}


def test_no_pickle_anywhere_in_the_package():
    pattern = re.compile(r"^\s*(import pickle|from pickle|import cPickle)|pickle\.loads?\(|allow_pickle=True"
                         r"|torch\.load\(", re.M)
    offenders = [str(p) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == sorted(map(str, PICKLES_BETWEEN_PROCESSES))
    channel = (PACKAGE / "pipeline" / "device" / "channel.py").read_text()
    assert not re.search(r"^from remote_loader\.(read|storage|format)", channel, re.M)  # no stored bytes there


def test_secret_never_reaches_the_logs(seaweed, small, caplog):
    _, bucket = small
    secret = "LOG-SECRET-4d1e9b7c"
    caplog.set_level(logging.DEBUG)
    bad = make_client(seaweed.endpoint_url, seaweed.access_key, secret)
    with pytest.raises(AccessDenied):
        bad.get(bucket, "ok/manifest.msgpack")
    assert caplog.records, "botocore logs at DEBUG: the check must see them"
    assert secret not in caplog.text


# ------------------------------------------------------------------ arguments checked where they are given

_UNREACHED = "http://127.0.0.1:9"  # nothing listens: a check that came too late would meet the network


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rank": 1}, "rank and world_size together"),
        ({"world_size": 2}, "rank and world_size together"),
        ({"rank": 2, "world_size": 2}, "rank must be an integer in 0..1"),
        ({"rank": -1, "world_size": 2}, "rank must be an integer in 0..1"),
        ({"rank": 0, "world_size": 0}, "world_size must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer in 0.."),
        ({"seed": "a"}, "seed must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"open_shards": 0}, "open_shards must be an integer >= 1"),
        ({"shuffle_shards": "yes"}, "shuffle_shards must be True or False"),
        ({"equalize": 1}, "equalize must be True or False or None"),
        ({"on_error": "ignore"}, "on_error must be"),
    ],
)
def test_remote_dataset_arguments_are_checked_at_construction(kwargs, field):
    with pytest.raises(ConfigError, match=field) as caught:
        RemoteDataset(make_client(_UNREACHED, "key", "secret"), "bkt", "ds", **kwargs)
    one_line(caught.value)


def test_rank_and_world_size_from_the_environment_are_checked(monkeypatch, small):
    client, bucket = small
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match="RANK=3 and WORLD_SIZE=2 in the environment: rank must be an integer in 0..1"
    ):
        len(RemoteDataset(client, bucket, "ok"))


def test_a_world_size_in_the_environment_without_a_rank_is_refused(monkeypatch, small):
    """Every process of such a launch took itself for rank 0 and read rank 0's part."""
    client, bucket = small
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="WORLD_SIZE=4 in the environment but no RANK: set both"):
        len(RemoteDataset(client, bucket, "ok"))
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: rank 0, as without either
    assert len(RemoteDataset(client, bucket, "ok")) > 0


def test_a_rank_in_the_environment_without_a_world_size_is_refused_as_such(monkeypatch, small):
    """It was refused as 'RANK=1 and WORLD_SIZE=1 in the environment', a WORLD_SIZE nobody set."""
    client, bucket = small
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for rank in ("1", "-1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ConfigError, match=f"RANK={rank} in the environment but no WORLD_SIZE: set both"):
            len(RemoteDataset(client, bucket, "ok"))
    monkeypatch.setenv("RANK", "0")  # one process: rank 0, as without either
    assert len(RemoteDataset(client, bucket, "ok")) > 0


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: RandomResizedCrop(0), "size must be an integer >= 1"),
        (lambda: RandomResizedCrop(10**9), "size 1000000000 makes .* past PIL.Image.MAX_IMAGE_PIXELS"),
        (lambda: RandomResizedCrop(224, scale=(0.5, 0.1)), "scale must be"),
        (lambda: RandomResizedCrop(224, ratio=(0, 1)), "ratio must be"),
        (lambda: RandomResizedCrop(224, seed=-3), "seed must be an integer in"),
        (lambda: LocalitySampler([10, 10], window=0, rank=0, world_size=1), "window must be an integer >= 1"),
        (lambda: LocalitySampler([10, 10], seed=-1, rank=0, world_size=1), "seed must be an integer in"),
        (lambda: LocalitySampler([10, 10], rank=1), "rank and world_size together"),
    ],
)
def test_other_constructors_check_their_arguments(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"workers": -1}, "workers must be an integer >= 0"),
        ({"seed": -1}, "seed must be an integer in 0.."),
        ({"maxcount": 0}, "maxcount must be an integer in 1..18014398509481983, got 0"),
        ({"maxsize": "big"}, "maxsize must be a number"),
        ({"maxsize": float("inf")}, "maxsize must be a number of bytes in 4096..9223372036854775807, got inf"),
        ({"maxsize": float("nan")}, "maxsize must be a number of bytes in 4096..9223372036854775807, got nan"),
        ({"maxsize": 2.0**63}, "maxsize must be a number of bytes in 4096..9223372036854775807"),
        ({"maxcount": 2**70}, "maxcount must be an integer in 1..18014398509481983, got 1180591620717411303424"),
        ({"quality": 0}, "quality must be an integer in 1..100"),
        ({"shuffle": "no"}, "shuffle must be True or False"),
        # checked by the first shard's writer, after the upload's first requests (and never 1.5 or True)
        ({"part_size": 1024}, r"part_size \(bytes\) must be an integer in 5242880..5368709120, got 1024$"),
        ({"part_size": 6e6}, r"part_size \(bytes\) must be an integer in 5242880..5368709120, got 6000000.0$"),
        ({"part_size": 2**40}, r"part_size \(bytes\) must be an integer in 5242880..5368709120, got 1099511627776$"),
        ({"image_format": None}, "image_format must be one of jpeg, png, webp; got None"),  # an AttributeError
    ],
)
def test_upload_arguments_are_checked_before_any_request(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        upload_cv_dataset(
            SyntheticImages(4, size=(8, 8)),
            client=make_client(_UNREACHED, "key", "secret"),
            bucket="bkt",
            base_folder="ds",
            progress=False,
            **kwargs,
        )


def test_connection_options_with_a_store_are_refused():
    with pytest.raises(ConfigError, match="endpoint_url: connection options go with a URL"):
        RemoteDataset(make_client(_UNREACHED, "key", "secret"), "bkt", "ds", endpoint_url="http://elsewhere:9000")


@pytest.mark.parametrize(("cls", "given", "said"), [
    (RemoteDataset, {"prefix": "ds"}, "'prefix' (the dataset's prefix is base_folder)"),
    (RemoteDataset, {"shuffle": True}, "'shuffle' (a shuffle buffer is .shuffle(bufsize), a method of the dataset)"),
    (RemoteDataset, {"batch_size": 64}, "'batch_size' (batches are .batched(batch_size), a method of the dataset)"),
    (RemoteDataset, {"open_shard": 2}, "'open_shard' (did you mean 'open_shards'?)"),
    (RemoteMapDataset, {"transfrom": str}, "'transfrom' (did you mean 'transform'?)"),
    (RemoteMapDataset, {"shuffle": True}, "'shuffle' (the DataLoader's, or its sampler's)"),
])
@pytest.mark.parametrize("where", ["store", "url"])
def test_a_mistyped_keyword_is_named_as_such_not_taken_for_a_connection_option(cls, given, said, where):
    """``**connection`` catches every keyword: one that is no connection option is a TypeError
    naming it (with a URL it reached open_location's, with a store it was called a connection option)."""
    args = ("s3://bkt/ds",) if where == "url" else (make_client(_UNREACHED, "key", "secret"), "bkt", "ds")
    with pytest.raises(TypeError) as caught:
        cls(*args, **given)
    assert str(caught.value) == f"{cls.__name__}() got an unexpected keyword argument {said}"


@pytest.mark.parametrize(("given", "said"), [
    ({"cache_shards": 1.5}, "cache_shards must be an integer >= 1, got 1.5"),
    ({"cache_shards": True}, "cache_shards must be an integer >= 1, got True"),
    ({"cache_shards": "2"}, "cache_shards must be an integer >= 1, got '2'"),
    ({"cache_pages": 0}, "cache_pages must be an integer >= 1, got 0"),
    ({"merge_gap": -1}, "merge_gap must be an integer >= 0, got -1"),
    ({"transform": 5}, "transform must be callable (applied to each sample), got int"),
])
def test_a_map_style_dataset_s_bad_settings_are_refused_before_any_request(tmp_path, given, said):
    """A float or bool was taken as a count, a str raised a bare TypeError from a comparison,
    and a transform that is no function failed only at the first sample."""
    from remote_loader.storage.local import LocalStore

    with pytest.raises(ConfigError) as caught:
        RemoteMapDataset(LocalStore(tmp_path), "nowhere", "ds", **given)
    assert str(caught.value) == said


@pytest.mark.parametrize("delta", [+10, -3], ids=["manifest says more", "manifest says fewer"])
def test_a_manifest_that_disagrees_with_a_shard_index_names_the_shard(small, delta):
    client, bucket = small
    raw = manifest_raw(client, bucket)
    name = raw["shards"][0][0]
    raw["shards"][0][1] += delta  # the sample count no longer matches the shard's own index
    client.put(bucket, f"ok/{MANIFEST_NAME}", seal(raw))
    with pytest.raises(CorruptShard, match=f"shard {name}: its index lists 10 samples, the manifest says") as caught:
        list(RemoteDataset(client, bucket, "ok", shuffle_shards=False))
    assert caught.value.name == name
    with pytest.raises(CorruptShard, match=name):
        RemoteMapDataset(client, bucket, "ok")[0]
    skipping = RemoteDataset(client, bucket, "ok", shuffle_shards=False, on_error="skip")
    keys = [sample["__key__"] for sample in skipping]
    assert len(keys) == len(set(keys)) == 10  # the other shard, whole; the bad one skipped and counted
    assert skipping.metrics.skipped == 10 + delta


def test_a_text_label_that_is_not_utf8_is_a_decode_error_through_workers(s3):
    client, bucket = s3
    # A WebDataset tar from another tool, whose txt member is Latin-1: indexed, then decoded in a worker.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for key, text in (("000", b"plain"), ("001", b"caf\xe9")):
            member = tarfile.TarInfo(f"{key}.txt")
            member.size = len(text)
            tar.addfile(member, io.BytesIO(text))
    client.put(bucket, "latin/part-0.tar", buffer.getvalue())
    index_webdataset(client, Location(bucket, "latin"))
    ds = RemoteDataset(client, bucket, "latin", shuffle_shards=False).decode("pil")
    with pytest.raises(DecodeError, match="field 'txt' of sample '001'") as caught:
        list(DataLoader(ds, batch_size=None, num_workers=1))
    assert (caught.value.key, caught.value.field) == ("001", "txt")


def test_bench_refuses_more_workers_than_a_dataset_runs_in_before_any_request():
    from remote_loader.bench import run

    with pytest.raises(ConfigError, match="workers must be an integer in 0..1024, got 5000"):
        run(make_client(_UNREACHED, "key", "secret"), "bkt", "ds", workers=5000)


def test_a_local_upload_leaves_no_empty_folder_and_deletes_racing_writes_lose_none(tmp_path):
    """A prefix without objects is no folder in S3: a local store removes the folders its
    deletes leave empty (an upload's ``_upload/<run>/``), and a write into a folder that a
    delete in another thread removes at that moment makes it again."""
    from remote_loader import upload_cv_dataset
    from remote_loader.testing.synthetic import SyntheticImages

    store = LocalStore(tmp_path / "root")
    store.create_bucket("b")
    upload_cv_dataset(SyntheticImages(30, size=(16, 12)), client=store, bucket="b", base_folder="d", maxcount=10,
                      workers=0, progress=False)
    bucket = tmp_path / "root" / "b"
    assert [p for p in bucket.rglob("*") if p.is_dir() and not any(p.iterdir())] == []
    assert not (bucket / "d" / "_upload").exists()

    stop, failures = threading.Event(), []

    def churn(name: str) -> None:
        try:
            while not stop.is_set():
                store.put("b", f"x/y/{name}", b"1")
                store.delete("b", f"x/y/{name}")
        except Exception as error:  # noqa: BLE001 - what the test reports
            failures.append(error)

    threads = [threading.Thread(target=churn, args=(name,)) for name in "abc"]
    for thread in threads:
        thread.start()
    for k in range(300):
        store.put("b", f"x/y/z{k % 3}", b"2", if_none_match=k % 2 == 0)
        store.delete("b", f"x/y/z{k % 3}")
    stop.set()
    for thread in threads:
        thread.join()
    assert failures == [] and not (bucket / "x").exists()


@pytest.mark.parametrize("cls", [RemoteDataset, RemoteMapDataset])
@pytest.mark.parametrize(("where", "given", "said"), [
    ("bucket", 5, "bucket must be a non-empty string, got 5"),
    ("bucket", b"b", "bucket must be a non-empty string, got b'b'"),
    ("base_folder", pathlib.Path("ds"), "base_folder must be a string (the dataset's key prefix), got PosixPath('ds')"),
    ("base_folder", 5, "base_folder must be a string (the dataset's key prefix), got 5"),
    ("fetch", {"part_size": 1 << 20}, "fetch must be a FetchConfig, got dict {'part_size': 1048576}"),
    ("fetch", {}, "fetch must be a FetchConfig, got dict {}"),
    ("verify", None, "verify must be True or False, got None"),
    ("verify", "no", "verify must be True or False, got 'no'"),
    ("cache_dir", 5, "cache_dir must be a path, got int 5"),
    ("cache_verify", "yes", "cache_verify must be True or False, got 'yes'"),
    ("cache_verify", True, "cache_verify checks what a cache reads: give cache_dir too (or REMOTE_LOADER_CACHE_DIR)"),
])
def test_a_dataset_s_place_and_reading_settings_are_refused_by_name(tmp_path, monkeypatch, cls, where, given, said):
    """A Path or int as the prefix and a dict as ``fetch`` raised AttributeError from deep in the
    reader (or, an empty dict, was replaced by the defaults); ``verify=None`` turned a map-style
    dataset's checksums off, ``cache_verify="yes"`` was taken as true, or ignored without a cache."""
    monkeypatch.delenv("REMOTE_LOADER_CACHE_DIR", raising=False)
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    upload_cv_dataset(SyntheticImages(4, size=(8, 8)), client=store, bucket="b", base_folder="ds", workers=0,
                      progress=False)
    place = {"bucket": "b", "base_folder": "ds"}
    options = {}
    (place if where in place else options)[where] = given
    with pytest.raises(ConfigError) as caught:
        cls(store, place["bucket"], place["base_folder"], **options)
    assert one_line(caught.value) == said


@pytest.fixture(scope="module")
def local_dataset(tmp_path_factory):
    """A small dataset in a local directory: (store, bucket, prefix)."""
    store = LocalStore(tmp_path_factory.mktemp("local"))
    store.create_bucket("b")
    upload_cv_dataset(SyntheticImages(12, size=(16, 12)), client=store, bucket="b", base_folder="ds", maxcount=4,
                      workers=0, progress=False)
    return store, "b", "ds"


def test_numpy_integers_are_taken_where_the_chain_takes_counts(local_dataset):
    """shuffle, decode's min_size and threads, map's threads, batched and VideoClip refused
    numpy's integers (a batch size read from a config array: 'must be an integer >= 1, got
    np.int64(4)'), as the constructors did not."""
    import numpy as np

    from remote_loader import VideoClip

    ds = RemoteDataset(*local_dataset, shuffle_shards=False)
    chained = (ds.shuffle(np.int64(6), np.int32(2)).decode("torchrgb", min_size=np.int64(8), threads=np.int64(2))
               .map(dict, threads=np.int16(2)).to_tuple("jpg", "cls").batched(np.int64(5)))
    sizes = [len(labels) for _, labels in chained]
    assert sizes == [5, 5, 2] and len(chained) == 3
    clip = VideoClip(np.int64(8), np.int32(2), audio=np.int64(16000))
    assert (clip.frames, clip.step, clip.audio) == (8, 2, 16000) and type(clip.frames) is int


@pytest.mark.parametrize(("chain", "said"), [
    (lambda ds: ds.batched(4, partial="no"), "partial must be True or False, got 'no'"),
    (lambda ds: ds.batched(4, partial=None), "partial must be True or False, got None"),
    (lambda ds: ds.decode("pil", threads=100_000), "threads (0: run in the calling thread) must be an integer in"
                                                   " 0..1024, got 100000"),
    (lambda ds: ds.map(str, threads=10**6), "threads (0: run in the calling thread) must be an integer in 0..1024,"
                                            " got 1000000"),
    (lambda ds: ds.shuffle(10, 20), "shuffle's initial must be an integer in 0..10, got 20"),
    (lambda ds: ds.shuffle(2.5), "shuffle's bufsize must be an integer >= 1, got 2.5"),
])
def test_chain_arguments_are_not_taken_for_what_they_are_not(local_dataset, chain, said):
    """partial="no" was taken for True (a short last batch kept); threads had no bound: each
    DataLoader worker started them all at its first pass, and past what a process can start
    failed there, mid-epoch."""
    with pytest.raises(ConfigError) as caught:
        chain(RemoteDataset(*local_dataset))
    assert one_line(caught.value) == said


@pytest.mark.parametrize(("options", "said"), [
    ({"flip": "no"}, "RandomResizedCrop flip must be True or False, got 'no'"),
    ({"reduced": None}, "RandomResizedCrop reduced must be True or False, got None"),
    ({"scale": (0.08, float("inf"))},
     "RandomResizedCrop scale must be (low, high) with 0 < low <= high, got (0.08, inf)"),
    ({"ratio": (1, float("inf"))}, "RandomResizedCrop ratio must be (low, high) with 0 < low <= high, got (1, inf)"),
    ({"mean": (0.5, 0.5, float("nan")), "std": (1, 1, 1)},
     "RandomResizedCrop mean must be three finite numbers (one per channel), got (0.5, 0.5, nan)"),
    ({"mean": (0.5, 0.5, 0.5), "std": (1, 1, float("inf"))},
     "RandomResizedCrop std must be three finite numbers (one per channel), got (1, 1, inf)"),
    ({"boxes": ["boxes"]}, "RandomResizedCrop boxes maps field names to one of xyxy, xywh, cxcywh; got list ['boxes']"),
    ({"per_box": 5}, "RandomResizedCrop per_box is a list of field names, or a dict from each to its box field; got 5"),
])
def test_a_crop_s_options_are_refused_for_what_they_are_not(options, said):
    """flip="no" flipped; an infinite scale or ratio and a mean of nan failed at each sample; a
    list as boxes was a ValueError from dict(), an int as per_box a bare TypeError."""
    with pytest.raises(ConfigError) as caught:
        RandomResizedCrop(32, **options)
    assert one_line(caught.value) == said


def test_a_crop_reads_its_field_names_once_and_takes_numpy_numbers():
    """Field names given as a generator were read by their check and kept empty: keypoints
    left where they were, per-box rows never dropped with their boxes. numpy's floats and
    arrays were refused as scale, ratio, mean and std."""
    import numpy as np

    crop = RandomResizedCrop(32, keypoints=(f for f in ["kp.npy"]), not_spatial=iter(["1"]),
                             per_box=(f for f in ["labels.npy"]), boxes={"boxes.npy": "xyxy"})
    assert (crop.keypoints, crop.not_spatial, crop.per_box) == (("kp.npy",), ("1",), {"labels.npy": None})
    crop = RandomResizedCrop(32, np.array([0.25, 1.0]), (np.float32(0.5), np.float32(2.0)),
                             mean=np.array([0.5, 0.5, 0.5]), std=[np.float32(0.25)] * 3)
    assert (crop.scale, crop.ratio, crop.mean, crop.std) == ((0.25, 1.0), (0.5, 2.0), (0.5,) * 3, (0.25,) * 3)
    assert type(crop.scale[0]) is float and type(crop.std[0]) is float
    flags = np.array([False, True])  # a flag read from a config array, as numpy's integers are taken as counts
    crop = RandomResizedCrop(32, flip=flags[0], reduced=flags[1], fast=flags[0])
    assert (crop.flip, crop.reduced, crop.fast) == (False, True, False) and type(crop.flip) is bool


@pytest.mark.parametrize(("make", "said"), [
    (lambda: make_client(_UNREACHED, "k", "s", region=5), "region must be a region's name (us-east-1), got 5"),
    (lambda: make_client(_UNREACHED, "k", "s", region=""), "region must be a region's name (us-east-1), got ''"),
    (lambda: StorageConfig(endpoint_url=5), "endpoint_url must be a str, got int"),  # an AttributeError
    (lambda: StorageConfig(profile=5), "profile must be a str, got int 5"),
    (lambda: StorageConfig(max_attempts=1.5), "max_attempts must be an integer >= 1, got 1.5"),
    (lambda: StorageConfig(max_connections=True), "max_connections must be an integer >= 1, got True"),
    (lambda: StorageConfig(read_timeout="5"), "read_timeout must be a finite number of seconds > 0, got '5'"),
    (lambda: StorageConfig(connect_timeout=float("inf")), "connect_timeout must be a finite number of seconds > 0,"
                                                          " got inf"),
    (lambda: StorageConfig(read_timeout=float("nan")), "read_timeout must be a finite number of seconds > 0, got nan"),
    (lambda: RetryConfig(backoff=float("inf")), "backoff must be a finite number of seconds >= 0, got inf"),
    (lambda: RetryConfig(outage_deadline=float("inf")), "outage_deadline must be a finite number of seconds >= 0,"
                                                        " got inf"),
])
def test_storage_settings_are_refused_for_what_they_are_not(make, said):
    """A region of 5 or "" reached boto3; an endpoint of 5 raised AttributeError; 1.5 attempts
    and True connections were taken; a read timeout of "5" was a TypeError from a comparison;
    an infinite timeout or backoff would wait on a hung or dead store for ever, a nan one was
    taken as is."""
    with pytest.raises(ConfigError) as caught:
        make()
    assert one_line(caught.value) == said


def test_storage_settings_take_numpy_numbers():
    import numpy as np

    config = StorageConfig(max_attempts=np.int64(3), read_timeout=np.float32(2.5), connect_timeout=np.int64(4))
    assert (config.max_attempts, config.read_timeout, config.connect_timeout) == (3, 2.5, 4.0)
    assert type(config.max_attempts) is int and type(config.read_timeout) is float
    assert RetryConfig(first_contact_deadline=np.float32(0.5)).first_contact_deadline == 0.5


@pytest.mark.parametrize(("make", "said"), [
    (lambda: LocalStore(""), "LocalStore's root must be a path (a str or pathlib.Path), got str ''"),
    (lambda: LocalStore(None), "LocalStore's root must be a path (a str or pathlib.Path), got NoneType None"),
    (lambda: LocalStore(b"/tmp"), "LocalStore's root must be a path (a str or pathlib.Path), got bytes b'/tmp'"),
    (lambda: LocalStore("/tmp/a\0b"),
     r"LocalStore's root must be a path (a str or pathlib.Path), got str '/tmp/a\x00b'"),
    (lambda: ImageFolder(""), "image folder must be a path (a str or pathlib.Path), got str ''"),
    (lambda: ImageFolder(5), "image folder must be a path (a str or pathlib.Path), got int 5"),
])
def test_a_local_root_that_is_no_path_is_refused_by_name(make, said):
    """LocalStore("") and ImageFolder("") took the current directory for the root (an unset
    variable's empty string wrote the dataset under it); None, an int or bytes raised
    pathlib's TypeError, a NUL byte its ValueError."""
    with pytest.raises(ConfigError) as caught:
        make()
    assert one_line(caught.value) == said


@pytest.mark.parametrize(("options", "said"), [
    ({"num_workers": 5000}, "num_workers must be an integer in 0..1024, got 5000"),
    ({"decoding": "gpu"}, "decoding must be one of 'dali', 'process', 'thread' or None, got 'gpu'"),
    ({"decoding": 5}, "decoding must be one of 'dali', 'process', 'thread' or None, got 5"),
])
def test_loader_refuses_what_would_fail_in_its_workers_or_go_unread(local_dataset, options, said):
    """num_workers=5000 made a DataLoader whose every worker refused to start at the first pass
    ('RemoteDataset supports up to 1024 DataLoader workers'); a misspelt decoding was ignored
    wherever the pipeline decodes on the CPU (decode(device="auto") without a GPU among them)."""
    from remote_loader import loader

    with pytest.raises(ConfigError) as caught:
        loader(RemoteDataset(*local_dataset).batched(4), **options)
    assert one_line(caught.value) == said


def test_restore_names_what_it_was_given_instead_of_a_sample(local_dataset):
    """map(restore) after to_tuple raised AttributeError: 'tuple' object has no attribute 'get'."""
    from remote_loader import restore

    ds = RemoteDataset(*local_dataset).decode("pil").to_tuple("jpg", "cls").map(restore)
    with pytest.raises(TypeError) as caught:
        next(iter(ds))
    assert one_line(caught.value).startswith("restore takes a sample as the dataset gives it, a dict of fields"
                                             " (map(restore) before to_tuple and batched), got tuple")


@pytest.mark.parametrize(("bounds", "said"), [
    ((True, 5), "read_member's start is an int, got bool True"),
    ((1.5, None), "read_member's start is an int, got float 1.5"),
    ((0, 2.5), "read_member's end is an int, got float 2.5"),
    (("0", "5"), "read_member's start is an int, got str '0'"),
])
def test_read_member_refuses_bounds_that_are_no_integers(local_dataset, bounds, said):
    """start=True read from byte 1; 1.5 raised "'float' object cannot be interpreted as an
    integer" from a slice, "0" a bare TypeError from a comparison."""
    import numpy as np

    ds = RemoteMapDataset(*local_dataset)
    assert ds.read_member(0, "jpg", np.int64(1), np.int64(5)) == ds.read_member(0, "jpg")[1:5]
    with pytest.raises(TypeError) as caught:
        ds.read_member(0, "jpg", *bounds)
    assert one_line(caught.value) == said


@pytest.mark.parametrize(("options", "said"), [
    ({"allowed": 1.5}, "allowed must be an integer >= 1, got 1.5"),
    ({"allowed": 0}, "allowed must be an integer >= 1, got 0"),
    ({"machine": True}, "machine must be an integer >= 1, got True"),
    ({"env": 5}, "env must be a mapping of environment variables, got int"),
])
def test_rank_cores_refuses_counts_that_are_none(options, said):
    """rank_cores(allowed=1.5) answered 1.5 cores (a DataLoader of 1.5 workers), allowed=0 or
    -1 answered 1, env=5 raised AttributeError."""
    from remote_loader import rank_cores

    with pytest.raises(ConfigError) as caught:
        rank_cores(**options)
    assert one_line(caught.value) == said


def test_a_fetcher_s_concurrency_is_bounded():
    """Each fetcher starts ``concurrency`` threads at once, in every DataLoader worker:
    FetchConfig(concurrency=40_000) was taken, and its first pass raised RuntimeError: can't start new
    thread after 35 s and 635 MB."""
    from remote_loader import FetchConfig

    with pytest.raises(ConfigError) as caught:
        FetchConfig(concurrency=10**6)
    assert one_line(caught.value) == "concurrency must be an integer in 1..1024, got 1000000"
    assert FetchConfig(concurrency=1024).concurrency == 1024


@pytest.mark.parametrize(("options", "said"), [
    ({"audio": "no"}, "audio must be True or False, got 'no'"),
    ({"transform": 5}, "transform must be callable (applied to each clip), got int"),
    ({"ranges_over": 1.5}, "ranges_over must be a number of bytes >= 0 or None, got 1.5"),
])
def test_video_clips_check_their_options_before_reading_the_dataset(tmp_path, options, said):
    """audio="no" was taken for True, a transform of 5 failed at the first clip, and ranges_over
    was checked only once the manifest was read (here there is none: DatasetNotFound came first)."""
    from remote_loader import RemoteVideoClips

    store = LocalStore(tmp_path)
    store.create_bucket("b")
    with pytest.raises(ConfigError) as caught:
        RemoteVideoClips(store, "b", "nothing-here", **options)
    assert one_line(caught.value) == said


def test_a_local_store_refuses_keys_and_buckets_that_are_no_strings(tmp_path):
    """A key of None or 5 raised AttributeError ('int' object has no attribute 'split'), a
    bytes key a TypeError, create_bucket(5) "argument of type 'int' is not iterable"."""
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    for key in (None, 5, b"k"):
        for call in (store.get, store.head, store.delete):
            with pytest.raises(StorageError) as caught:
                call("b", key)
            assert one_line(caught.value) == f"key {key!r} is not a safe relative path"
    for bucket in (5, None, "a\0b"):
        with pytest.raises(StorageError) as caught:
            store.create_bucket(bucket)
        assert one_line(caught.value) == f"invalid bucket name {bucket!r}"
