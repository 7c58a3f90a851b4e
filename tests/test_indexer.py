"""Existing WebDataset shards, indexed in place, read by both datasets."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from torch.utils.data import DataLoader

from remote_loader import (
    ConfigError,
    CorruptShard,
    DatasetNotFound,
    DatasetReader,
    LocalStore,
    RemoteDataset,
    ResumeError,
    UploadError,
    make_client,
)
from remote_loader.format import MANIFEST_NAME
from remote_loader.mapstyle.dataset import RemoteMapDataset
from remote_loader.storage import Location
from remote_loader.testing.synthetic import SyntheticImages
from remote_loader.upload.indexer import index_webdataset
from tests.faultproxy import FaultProxy
from tests.helpers import FlakyImages, upload


def write_wds_shards(tmp_path: Path, shards: int = 3, per_shard: int = 30) -> dict[str, dict[str, bytes]]:
    """Tars written by webdataset's own TarWriter, as img2dataset writes them."""
    ds = SyntheticImages(shards * per_shard, size=(40, 30))
    expected = {}
    for s in range(shards):
        with wds.TarWriter(str(tmp_path / f"data-{s:05d}.tar")) as sink:
            for i in range(s * per_shard, (s + 1) * per_shard):
                sample = {"__key__": f"sample{i:06d}", "jpg": ds[i][0], "cls": str(ds.label(i)).encode(),
                          "json": json.dumps({"i": i, "caption": "x" * (i % 7)}).encode()}
                sink.write(sample)
                expected[sample["__key__"]] = {k: v for k, v in sample.items() if k != "__key__"}
    return expected


def put_dir(client, bucket, folder, tmp_path):
    for path in sorted(tmp_path.glob("*.tar")):
        client.put(bucket, f"{folder}/{path.name}", path.read_bytes())


def as_bytes(sample):
    return {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}


def test_indexed_webdataset_shards_read_identically(s3, tmp_path):
    client, bucket = s3
    expected = write_wds_shards(tmp_path)
    put_dir(client, bucket, "wds", tmp_path)
    originals = {o.key: client.get(bucket, o.key) for o in client.list(bucket, "wds/")}
    summary = index_webdataset(client, Location(bucket, "wds"))
    assert (summary.shards, summary.samples) == (3, 90)
    streamed = {s["__key__"]: as_bytes(s) for s in RemoteDataset(client, bucket, "wds")}
    mapped = RemoteMapDataset(client, bucket, "wds")
    by_index = {mapped[i]["__key__"]: as_bytes(mapped[i]) for i in range(len(mapped))}
    assert streamed == by_index == expected
    assert all(client.get(bucket, key) == data for key, data in originals.items())  # never modified


def test_index_cli_and_verify(seaweed, s3, tmp_path):
    client, bucket = s3
    write_wds_shards(tmp_path, shards=2)
    put_dir(client, bucket, "cli", tmp_path)
    env = {**os.environ, **seaweed.env()}
    script = Path(sys.executable).with_name("remote-loader")
    out = subprocess.run(
        [str(script), "index", f"s3://{bucket}/cli", "--json"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["samples"] == 60
    verify = subprocess.run(
        [str(script), "verify", f"s3://{bucket}/cli", "--quiet"], env=env, capture_output=True, text=True
    )
    assert verify.returncode == 0 and "2 of 2 shards ok" in verify.stdout


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_broken_tars_are_named(s3, tmp_path, damage):
    client, bucket = s3
    write_wds_shards(tmp_path, shards=2)
    data = (tmp_path / "data-00001.tar").read_bytes()
    data = (
        data[: len(data) // 2 + 100] if damage == "truncate" else os.urandom(512) + data[512:]
    )  # a header that fails its checksum
    (tmp_path / "data-00001.tar").write_bytes(data)
    put_dir(client, bucket, "broken", tmp_path)
    with pytest.raises(CorruptShard, match="data-00001.tar") as info:
        index_webdataset(client, Location(bucket, "broken"))
    assert info.value.name == "data-00001.tar"


@pytest.mark.parametrize("world_size, num_workers", [(1, 0), (1, 2), (2, 1)])
def test_plain_webdataset_shards_stream_without_an_index(s3, tmp_path, world_size, num_workers):
    client, bucket = s3
    expected = write_wds_shards(tmp_path, shards=4)
    put_dir(client, bucket, "plain", tmp_path)
    got = {}
    for rank in range(world_size):
        ds = RemoteDataset(client, bucket, "plain", rank=rank, world_size=world_size, unindexed=True)
        for sample in DataLoader(ds, batch_size=None, num_workers=num_workers):
            assert sample["__key__"] not in got
            got[sample["__key__"]] = as_bytes(sample)
    assert got == expected
    assert not client.exists(bucket, "plain/manifest.msgpack")


def test_plain_tars_have_no_checkpoints_whichever_way_asked(s3, tmp_path):
    client, bucket = s3
    write_wds_shards(tmp_path, shards=2)
    put_dir(client, bucket, "plain", tmp_path)
    ds = RemoteDataset(client, bucket, "plain", unindexed=True)
    for ask in (ds.state_dict, lambda: ds.state_dict(consumed=1, num_workers=1), lambda: ds.load_state_dict({})):
        with pytest.raises(ResumeError, match="needs? an indexed dataset: run remote-loader index on it"):
            ask()


def test_a_prefix_without_a_manifest_is_no_dataset_and_says_why(s3, tmp_path):
    client, bucket = s3
    write_wds_shards(tmp_path, shards=2)
    put_dir(client, bucket, "plain", tmp_path)
    with pytest.raises(DatasetNotFound, match=f"remote-loader index s3://{bucket}/plain.*unindexed=True"):
        RemoteDataset(client, bucket, "plain")
    with pytest.raises(UploadError, match="sample 50"):  # an upload that stops part-way leaves shards behind
        upload(client, bucket, "cut", FlakyImages(60, {50}, size=(32, 24)), maxcount=10, shuffle=False)
    assert any(o.key.endswith(".tar") for o in client.list(bucket, "cut/"))
    for make in (
        lambda: RemoteDataset(client, bucket, "cut"),
        lambda: DatasetReader(client, bucket, "cut").manifest,
        lambda: RemoteMapDataset(client, bucket, "cut"),
    ):
        with pytest.raises(DatasetNotFound, match="an upload to it has not finished") as caught:
            make()
        assert caught.value.key == "cut/manifest.msgpack"
    with pytest.raises(DatasetNotFound, match="mistyped"):
        RemoteDataset(client, bucket, "nothing-here")
    upload(client, bucket, "whole", SyntheticImages(20, size=(32, 24)), maxcount=10)
    with pytest.raises(ConfigError, match="unindexed=True is for tars without one"):
        RemoteDataset(client, bucket, "whole", unindexed=True)


def test_indexing_an_uploaded_dataset_is_refused_unless_forced(s3, seaweed):
    client, bucket = s3
    upload(client, bucket, "up", SyntheticImages(30, size=(32, 24)), maxcount=10)
    before = client.get(bucket, "up/manifest.msgpack")
    with pytest.raises(UploadError, match=r"uploaded by remote_loader.*--force"):
        index_webdataset(client, Location(bucket, "up"))
    env = {**os.environ, **seaweed.env()}
    out = subprocess.run(
        [sys.executable, "-m", "remote_loader.cli", "index", f"s3://{bucket}/up", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "--force" in out.stderr and "Traceback" not in out.stderr
    assert client.get(bucket, "up/manifest.msgpack") == before
    assert not any(o.key.endswith(".index") for o in client.list(bucket, "up/"))
    assert index_webdataset(client, Location(bucket, "up"), force=True).samples == 30


@pytest.mark.parametrize("bad", ["with space.tar", "café.tar", "-dash.tar"])
def test_tar_names_no_reader_could_open_are_refused_before_anything_is_written(s3, tmp_path, bad):
    client, bucket = s3
    write_wds_shards(tmp_path, shards=2)
    (tmp_path / "data-00001.tar").rename(tmp_path / bad)
    put_dir(client, bucket, "names", tmp_path)
    with pytest.raises(UploadError, match=re.escape(repr(bad))):
        index_webdataset(client, Location(bucket, "names"))
    assert {o.key for o in client.list(bucket, "names/")} == {"names/data-00000.tar", f"names/{bad}"}


def test_tars_indexed_in_place_are_read_from_the_node_cache_in_the_second_epoch(seaweed, s3, tmp_path):
    """Their indexes lie in objects apart: both are cached whole, and the tars' sizes are read
    from the cache, not by HEAD requests: the second epoch sends the store one request, for the
    manifest (a dataset replaced meanwhile is told so)."""
    client, bucket = s3
    expected = write_wds_shards(tmp_path)
    put_dir(client, bucket, "wds", tmp_path)
    index_webdataset(client, Location(bucket, "wds"))
    proxy = FaultProxy(seaweed.endpoint_url, {})
    try:
        through = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        ds = RemoteDataset(through, bucket, "wds", cache_dir=tmp_path / "cache")
        first = {s["__key__"]: as_bytes(s) for s in ds}
        requests = proxy.requests
        second = {s["__key__"]: as_bytes(s) for s in ds}
        through.close()
    finally:
        proxy.close()
    assert first == second == expected
    assert proxy.requests == requests + 1 and ds.metrics.cached_bytes > 0  # the manifest, as the pass began
    assert len(list((tmp_path / "cache").rglob("*.tar.index"))) == len(list((tmp_path / "cache").rglob("*.tar"))) == 3


def tar_bytes(*members: tuple[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def local_tars(tmp_path: Path, objects: dict[str, bytes]) -> tuple[LocalStore, Location]:
    """``objects`` under the prefix ``ds`` of bucket ``bkt`` in a local store."""
    (tmp_path / "store" / "bkt").mkdir(parents=True)
    store = LocalStore(tmp_path / "store")
    for name, data in objects.items():
        store.put("bkt", f"ds/{name}", data)
    return store, Location("bkt", "ds")


def test_a_tar_with_more_field_names_than_an_index_holds_is_refused_before_its_index_is_written(tmp_path):
    store, location = local_tars(tmp_path, {"s0.tar": tar_bytes(*((f"a.F{j:02d}", b"x") for j in range(70))),
                                            "s1.tar": tar_bytes(("b.jpg", b"B"))})
    with pytest.raises(CorruptShard, match=r"^s0.tar holds more field names than the 64 an index holds"
                                           r" \(MAX_FIELDS\): member 'a.F64' brings the 65th\n") as caught:
        index_webdataset(store, location)
    assert caught.value.name == "s0.tar"
    assert not any(o.key.endswith((".index", MANIFEST_NAME)) for o in store.list("bkt", "ds/"))


def test_compressed_tars_under_the_prefix_are_reported_not_silently_left_out(tmp_path, caplog):
    store, location = local_tars(tmp_path, {"s0.tar": tar_bytes(("a.jpg", b"A")),
                                            "s1.tar.gz": gzip.compress(tar_bytes(("c.jpg", b"C"))),
                                            "s2.tgz": gzip.compress(tar_bytes(("d.jpg", b"D")))})
    said = (f"index {location}: left out 2 compressed tars ('s1.tar.gz' and 1 more): a compressed tar cannot be"
            " read by byte range; decompress them to .tar and index again to include them")
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        summary = index_webdataset(store, location)
    assert (summary.shards, summary.samples, summary.left_out) == (1, 1, ("s1.tar.gz", "s2.tgz"))
    assert [r.getMessage() for r in caplog.records if r.name == "remote_loader"] == [said]
    folder = tmp_path / "store" / "bkt" / "ds"  # the command line, on the same objects as a local path
    out = subprocess.run([sys.executable, "-m", "remote_loader", "index", str(folder), "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "indexed 1 sample in 1 shard" in out.stdout, out.stdout + out.stderr
    assert out.stderr.splitlines() == [said.replace(str(location), str(folder))]


def test_a_prefix_of_compressed_tars_only_says_so(tmp_path):
    store, location = local_tars(tmp_path, {"s1.tar.gz": gzip.compress(tar_bytes(("c.jpg", b"C")))})
    with pytest.raises(UploadError, match=r"^no .tar objects under .*, only 1 compressed tar \('s1.tar.gz'\)"):
        index_webdataset(store, location)
