"""Data that lies: shards truncated or replaced under the reader, sizes and counts in a
manifest or an index that the objects do not back, tars whose member names are hostile, and
indexes rewritten to point samples at each other's bytes. Each is refused at once with an
error naming the object, before anything it claims is fetched or allocated."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
import tarfile

import msgpack
import numpy as np
import pytest

from remote_loader import (
    CorruptShard,
    DatasetReader,
    DecodeError,
    FetchConfig,
    IndexOutOfBounds,
    RemoteDataset,
    RemoteMapDataset,
    RetryConfig,
    TruncatedShard,
    restore,
)
from remote_loader.checksum import crc32
from remote_loader.format import MANIFEST_NAME, Manifest, ShardIndex
from remote_loader.read import whole
from remote_loader.read.node_cache import file_name
from remote_loader.storage import Location
from remote_loader.testing.synthetic import SyntheticImages
from remote_loader.upload.indexer import index_webdataset
from tests.helpers import upload

# A short outage deadline: a fault taken for an outage would fail the test in seconds, as
# EndpointUnreachable, instead of hanging it for five minutes.
QUICK = FetchConfig(retry=RetryConfig(outage_deadline=10, first_contact_deadline=10))


@pytest.fixture
def dataset(s3):
    client, bucket = s3
    upload(client, bucket, "ds", SyntheticImages(60, size=(32, 24)), maxcount=20, shuffle=False)
    return client, bucket


def _manifest(client, bucket, folder="ds") -> Manifest:
    return Manifest.decode(client.get(bucket, f"{folder}/{MANIFEST_NAME}"))


def _rewrite(client, bucket, manifest: Manifest, row: int, folder="ds", **changes) -> None:
    entries = list(manifest.shards)
    entries[row] = dataclasses.replace(entries[row], **changes)
    client.put(bucket, f"{folder}/{MANIFEST_NAME}", dataclasses.replace(manifest, shards=entries).encode())


# --------------------------------------------------------------------------- truncated shards


def test_a_shard_truncated_inside_its_index_is_named_at_once_not_retried_as_an_outage(dataset):
    client, bucket = dataset
    entry = _manifest(client, bucket).shards[1]
    data = client.get(bucket, f"ds/{entry.name}")
    client.put(bucket, f"ds/{entry.name}", data[: entry.index_offset + 100])  # ends inside its index
    ds = RemoteDataset(client, bucket, "ds", fetch=QUICK, shuffle_shards=False)
    with pytest.raises(TruncatedShard, match=rf"{entry.name}.*truncated or replaced") as caught:
        list(ds)
    assert caught.value.name == entry.name and "\n" not in str(caught.value)
    assert ds.metrics.retries <= 1  # at most one re-read, no retry loop
    skipping = RemoteDataset(client, bucket, "ds", fetch=QUICK, on_error="skip")
    assert len(list(skipping)) == 40 and skipping.metrics.skipped == 20


def test_a_shard_that_shrinks_after_its_index_was_read_fails_with_its_name(dataset):
    client, bucket = dataset
    entry = _manifest(client, bucket).shards[0]
    ds = RemoteMapDataset(client, bucket, "ds", fetch=QUICK)
    assert ds[0]["__key__"]  # its index is now cached
    data = client.get(bucket, f"ds/{entry.name}")
    client.put(bucket, f"ds/{entry.name}", data[:2000])  # replaced by a short copy, same manifest
    with pytest.raises(TruncatedShard, match=rf"{entry.name} is 2,000 bytes; the manifest says .* it was truncated"):
        ds[19]
    assert ds.metrics.retries <= 1


@pytest.mark.parametrize("cached", [False, True])
def test_a_shard_replaced_by_a_longer_one_is_refused_with_or_without_the_node_cache(dataset, tmp_path, cached):
    """Its first bytes are the manifest's, crc32 and all: through the node's cache it was
    fetched into the cache and served, though without it the same read was refused."""
    client, bucket = dataset
    entry = _manifest(client, bucket).shards[1]
    data = client.get(bucket, f"ds/{entry.name}")
    client.put(bucket, f"ds/{entry.name}", data + b"x" * 1000)
    cache = {"cache_dir": tmp_path / "cache"} if cached else {}
    said = rf"s3://{bucket}/ds/{entry.name} is {entry.size + 1000:,d} bytes; the manifest says {entry.size:,d}"
    for read in (lambda: list(RemoteDataset(client, bucket, "ds", fetch=QUICK, shuffle_shards=False, **cache)),
                 lambda: RemoteMapDataset(client, bucket, "ds", fetch=QUICK, **cache)[25]):
        with pytest.raises(TruncatedShard, match=said) as caught:
            read()
        assert caught.value.name == entry.name and "\n" not in str(caught.value)
    assert file_name(entry.name) not in {p.name for p in tmp_path.rglob("*")}  # nor kept in the cache


# --------------------------------------------------------------------------- sizes and counts


def test_an_index_size_the_shard_does_not_have_is_refused_before_it_is_fetched(dataset):
    client, bucket = dataset
    manifest = _manifest(client, bucket)
    entry = manifest.shards[0]
    _rewrite(client, bucket, manifest, 0, size=20 * 10**9, index_size=10 * 10**9)  # a 10 GB index
    ds = RemoteMapDataset(client, bucket, "ds", fetch=QUICK)
    with pytest.raises(TruncatedShard, match=rf"{entry.name}"):
        ds[0]
    assert ds.metrics.bytes < 10**6 and ds.metrics.retries <= 1


def test_a_shard_whose_size_the_manifest_misstates_is_refused_when_its_index_arrives(dataset):
    client, bucket = dataset
    manifest = _manifest(client, bucket)
    entry = manifest.shards[2]
    _rewrite(client, bucket, manifest, 2, size=entry.size + 512)  # index where it was, the object smaller than said
    with pytest.raises(TruncatedShard, match=rf"{entry.name} is {entry.size:,d} bytes; the manifest says"):
        RemoteMapDataset(client, bucket, "ds", fetch=QUICK)[45]


def _indexed_tar(client, bucket, folder: str, members: dict[str, bytes]) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    client.put(bucket, f"{folder}/part-0.tar", out.getvalue())


def _images(n: int) -> dict[str, bytes]:
    images = SyntheticImages(n, size=(16, 16))
    members = {}
    for i in range(n):
        members[f"{i:06d}.jpg"] = images.encoded(i)
        members[f"{i:06d}.cls"] = str(images.label(i)).encode()
    return members


def _rewrite_index(client, bucket, folder: str, change) -> None:
    """Rewrite the index kept beside a tar indexed in place, and the manifest to match it
    (its size and checksum): what someone who can write to the bucket can do."""
    manifest = _manifest(client, bucket, folder)
    entry = manifest.shards[0]
    index = ShardIndex.decode(client.get(bucket, f"{folder}/{entry.index_name}"), data_end=entry.size)
    offsets, sizes, crcs = index.offsets.copy(), index.sizes.copy(), index.crcs.copy()
    change(offsets, sizes, crcs)
    data = dataclasses.replace(index, offsets=offsets, sizes=sizes, crcs=crcs).encode()
    client.put(bucket, f"{folder}/{entry.index_name}", data)
    return data


def test_one_sample_claiming_50_gb_is_refused_before_anything_is_allocated(s3):
    client, bucket = s3
    _indexed_tar(client, bucket, "big", _images(10))
    index_webdataset(client, Location(bucket, "big"))
    huge = 50 * 10**9

    def claim(offsets, sizes, crcs):
        sizes[3, 0] = huge

    data = _rewrite_index(client, bucket, "big", claim)
    manifest = _manifest(client, bucket, "big")
    _rewrite(client, bucket, manifest, 0, folder="big", size=huge + 10**6, index_size=len(data),
             index_crc=crc32(data))
    for read in (lambda: RemoteMapDataset(client, bucket, "big", fetch=QUICK)[3],
                 lambda: list(RemoteDataset(client, bucket, "big", fetch=QUICK))):
        with pytest.raises(TruncatedShard, match=r"part-0.tar is [\d,]+ bytes; the manifest says 50,001,000,000"):
            read()


_SAMPLER_UNDER_A_MEMORY_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from remote_loader import LocalitySampler
claimed = int(sys.argv[1])
sampler = LocalitySampler([40, claimed, 40, 40], window=2, seed=0, rank=0, world_size=1)
it = iter(sampler)
print(len([next(it) for _ in range(10_000)]))
"""


@pytest.mark.parametrize("claimed", [4 * 10**8, 10**12])
def test_a_shard_claiming_a_huge_sample_count_costs_the_sampler_nothing(dataset, claimed):
    out = subprocess.run([sys.executable, "-c", _SAMPLER_UNDER_A_MEMORY_LIMIT, str(claimed)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "10000", out.stderr[-2000:]
    client, bucket = dataset  # and the dataset itself refuses the count once the shard's index is read
    manifest = _manifest(client, bucket)
    entry = manifest.shards[1]
    _rewrite(client, bucket, manifest, 1, samples=claimed, size=claimed * 512)
    ds = RemoteMapDataset(client, bucket, "ds", fetch=QUICK)
    with pytest.raises(CorruptShard, match=entry.name):
        ds[25]


def test_a_manifest_larger_than_any_manifest_is_refused_before_a_buffer_is_made(s3, monkeypatch):
    client, bucket = s3
    client.put(bucket, f"huge/{MANIFEST_NAME}", os.urandom(64 * 1024))
    monkeypatch.setattr(whole, "_FIRST", 4096)
    monkeypatch.setattr(whole, "MAX_MANIFEST_BYTES", 32 * 1024)
    reader = DatasetReader(client, bucket, "huge")
    with pytest.raises(CorruptShard, match="65,536 bytes, larger than any manifest this reader takes"):
        _ = reader.manifest


# --------------------------------------------------------------------------- hostile tars


@pytest.mark.parametrize("member, shown", [
    ("000001.\x1b]0;PWNED\x07jpg", r"000001.\x1b]0;PWNED\x07jpg"),
    ("../evil.jpg", "../evil.jpg"),
    ("/abs/x.jpg", "/abs/x.jpg"),
    ("sub/../../y.jpg", "sub/../../y.jpg"),
    ("new\nline.jpg", r"new\nline.jpg"),
    ("caf\udce9.jpg", r"caf\udce9.jpg"),  # not UTF-8 in the tar: b"caf\xe9.jpg"
])
def test_a_tar_member_that_cannot_be_a_sample_is_refused_naming_the_tar_and_member(seaweed, s3, member, shown):
    client, bucket = s3
    members = _images(3)
    members[member] = b"data"
    _indexed_tar(client, bucket, "hostile", members)
    with pytest.raises(CorruptShard, match=r"part-0.tar: member .* cannot be read as a sample") as caught:
        index_webdataset(client, Location(bucket, "hostile"))
    message = str(caught.value)
    assert shown in message and "\n" not in message and "\x1b" not in message and "\x07" not in message
    assert not any(o.key.endswith((".index", MANIFEST_NAME)) for o in client.list(bucket, "hostile/"))
    with pytest.raises(CorruptShard, match="cannot be read as a sample"):
        list(RemoteDataset(client, bucket, "hostile", unindexed=True))
    env = {**os.environ, **seaweed.env()}
    out = subprocess.run([sys.executable, "-m", "remote_loader", "index", f"s3://{bucket}/hostile", "--quiet"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "part-0.tar" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "\x1b" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_info_never_prints_control_characters(seaweed, s3):
    client, bucket = s3

    images = SyntheticImages(4, num_classes=2)
    images.classes = ["cat", "\x1b]0;PWNED\x07dog"]  # folder names of an image folder can hold anything
    upload(client, bucket, "cls", images)
    env = {**os.environ, **seaweed.env()}
    out = subprocess.run([sys.executable, "-m", "remote_loader", "info", f"s3://{bucket}/cls"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "\x1b" not in out.stdout and r"\x1b]0;PWNED\x07dog" in out.stdout, out.stdout


# --------------------------------------------------------------------------- rewritten indexes


def test_an_index_pointing_two_samples_at_the_same_bytes_fails_verify_and_reads(seaweed, s3):
    client, bucket = s3
    _indexed_tar(client, bucket, "over", _images(60))
    index_webdataset(client, Location(bucket, "over"))
    jpg = 1  # fields are sorted: cls, jpg

    def alias(offsets, sizes, crcs):  # sample 5's image becomes sample 50's bytes, checksum and all
        offsets[5, jpg], sizes[5, jpg], crcs[5, jpg] = offsets[50, jpg], sizes[50, jpg], crcs[50, jpg]

    data = _rewrite_index(client, bucket, "over", alias)
    _rewrite(client, bucket, _manifest(client, bucket, "over"), 0, folder="over", index_size=len(data),
             index_crc=crc32(data))
    with pytest.raises(IndexOutOfBounds, match=r"sample '000050' field 'jpg' .* overlaps sample '000005' field 'jpg'"):
        RemoteMapDataset(client, bucket, "over")[5]
    env = {**os.environ, **seaweed.env()}
    out = subprocess.run([sys.executable, "-m", "remote_loader", "verify", f"s3://{bucket}/over", "--quiet"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "0 of 1 shard ok" in out.stdout, out.stdout + out.stderr
    assert "overlaps" in out.stderr, out.stderr


def test_an_index_swapping_two_samples_bytes_fails_verify(s3):
    client, bucket = s3
    _indexed_tar(client, bucket, "swap", _images(60))
    index_webdataset(client, Location(bucket, "swap"))
    jpg = 1

    def swap(offsets, sizes, crcs):
        for column in (offsets, sizes, crcs):
            column[[5, 50], jpg] = column[[50, 5], jpg]

    data = _rewrite_index(client, bucket, "swap", swap)
    _rewrite(
        client, bucket, _manifest(client, bucket, "swap"), 0, folder="swap", index_size=len(data), index_crc=crc32(data)
    )
    reader = DatasetReader(client, bucket, "swap")
    report = reader.check_shard(reader.manifest.shards[0])
    assert report.problems == ["sample '000005': its index points at other bytes than its tar members 000005.*"]


def test_an_index_whose_ranges_overlap_is_refused_by_the_format():
    offsets = np.array([[1024, 2048], [1536, 4096]], dtype=np.uint64)  # sample b's first field inside a's
    sizes = np.array([[1000, 10], [10, 10]], dtype=np.uint64)
    index = ShardIndex(
        keys=["a", "b"], fields=("cls", "jpg"), offsets=offsets, sizes=sizes, crcs=np.zeros((2, 2), dtype=np.uint32)
    )
    with pytest.raises(IndexOutOfBounds, match="sample 'b' field 'cls' at 1536 overlaps sample 'a' field 'cls'"):
        ShardIndex.decode(index.encode(), data_end=10_000, name="s.tar")
    raw = msgpack.unpackb(index.encode())
    raw["keys"] = ["a", "../b"]
    with pytest.raises(CorruptShard, match=r"invalid sample key '../b'"):
        ShardIndex.decode(msgpack.packb(raw, use_bin_type=True), data_end=10_000, name="s.tar")


def _npy_claiming(values: int) -> bytes:
    """A small .npy whose header claims ``values`` uint8 values."""
    header = {"descr": "|u1", "fortran_order": False, "shape": (values,)}
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue() + b"\0" * 16


def _structured(hostile: dict[str, bytes]) -> dict[str, bytes]:
    """Three samples of an image and an array; the second's array is ``hostile`` instead."""
    out = io.BytesIO()
    np.save(out, np.arange(4))
    members = {}
    for i, image in enumerate(_images(3)[f"{i:06d}.jpg"] for i in range(3)):
        members[f"{i:06d}.0.jpg"] = image
        for name, data in (hostile if i == 1 else {"1.npy": out.getvalue()}).items():
            members[f"{i:06d}.{name}"] = data
    return members


@pytest.mark.parametrize("member, data, message", [
    ("1.npy", _npy_claiming(2**40), r"header claiming \(1099511627776,\)"),
    ("1.json", b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
])
def test_a_member_claiming_more_than_it_holds_is_a_decode_error_and_skipped_under_skip(s3, member, data, message):
    client, bucket = s3
    _indexed_tar(client, bucket, "claims", _structured({member: data}))
    index_webdataset(client, Location(bucket, "claims"))
    with pytest.raises(DecodeError, match=f"field '{re.escape(member)}' of sample '000001'.*{message}"):
        list(RemoteDataset(client, bucket, "claims", fetch=QUICK).decode("rgb8"))
    kept = RemoteDataset(client, bucket, "claims", fetch=QUICK, on_error="skip").decode("rgb8")
    assert sorted(sample["__key__"] for sample in kept) == ["000000", "000002"]


def test_restoring_a_member_whose_path_lands_on_a_list_of_its_skeleton_is_a_decode_error():
    sample = {"__key__": "000001", "__shard__": "part-0.tar", "1.json": b'{"boxes": [1, 2]}',
              "1.boxes.npy": _npy_claiming(0)[:-16], "0.jpg": _images(1)["000000.jpg"]}
    with pytest.raises(DecodeError, match="member 'boxes' lands on a list, not a placeholder"):
        restore(sample)
