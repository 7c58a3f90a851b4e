"""Manifest round trip and validation."""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest

from remote_loader.errors import CorruptShard, IndexOutOfBounds, UnsupportedVersion
from remote_loader.format import Manifest, ShardEntry


def manifest(**overrides) -> Manifest:
    values = dict(
        shards=(ShardEntry("shard-000000-000.tar", 10, 50_000, 48_000, 300, 1, 2), ShardEntry("shard-000001-000.tar", 5, 9_000, 7_000, 100, 3, 4)),
        fields=("cls", "jpg"),
        params={"upload": {"seed": 3}, "classes": ["a", "b"]},
        skipped=2,
        skipped_indices=(4, 17),
    )
    values.update(overrides)
    return Manifest(**values)


def test_round_trip():
    m = manifest()
    again = Manifest.decode(m.encode(), name="m")
    assert again == m
    assert again.num_samples == 15 and again.num_bytes == 59_000


def seal(body: bytes) -> bytes:
    """Append the crc32 trailer, as the writer does."""
    return body + struct.pack("<I", zlib.crc32(body))


def edit(**changes) -> bytes:
    raw = msgpack.unpackb(manifest().encode()[:-4])
    raw.update(changes)
    return seal(msgpack.packb(raw, use_bin_type=True))


def test_any_flipped_byte_fails_the_checksum():
    data = manifest().encode()
    for position in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        with pytest.raises(CorruptShard):
            Manifest.decode(bytes(damaged), name="m")


def test_newer_version_is_refused_with_a_clear_message():
    with pytest.raises(UnsupportedVersion, match="version 2.*upgrade"):
        Manifest.decode(edit(version=2), name="s3://b/p/manifest.msgpack")


@pytest.mark.parametrize("cut", [1, 10, 50, -1])
def test_truncated_manifest(cut):
    with pytest.raises(CorruptShard, match="manifest"):
        Manifest.decode(manifest().encode()[:cut], name="manifest")


def test_not_a_manifest():
    with pytest.raises(CorruptShard):
        Manifest.decode(seal(msgpack.packb({"format": "other", "version": 1})), name="m")
    with pytest.raises(CorruptShard):
        Manifest.decode(seal(msgpack.packb([1, 2, 3])), name="m")


@pytest.mark.parametrize(
    "row, error",
    [
        (["../../etc/passwd", 1, 5000, 2000, 10, 0, 0, ""], CorruptShard),
        (["/abs.tar", 1, 5000, 2000, 10, 0, 0, ""], CorruptShard),
        (["ok.tar", 1, 5000, 4990, 100, 0, 0, ""], IndexOutOfBounds),
        (["ok.tar", -1, 5000, 2000, 10, 0, 0, ""], CorruptShard),
        (["ok.tar", 1, 5000], CorruptShard),
        (["ok.tar", 1, 5000, 2000, 10, 0, 0, "../idx"], CorruptShard),
        (["ok.tar", 1, 5000, 2000, 10, 0, 0, 7], CorruptShard),
        (["ok.tar", "1", 5000, 2000, 10, 0, 0, ""], CorruptShard),
    ],
)
def test_bad_shard_entries(row, error):
    with pytest.raises(error):
        Manifest.decode(edit(shards=[row]), name="m")


def test_duplicate_shard_is_refused():
    row = ["a.tar", 1, 5000, 2000, 10, 0, 0, ""]
    with pytest.raises(CorruptShard, match="twice"):
        Manifest.decode(edit(shards=[row, row]), name="m")
