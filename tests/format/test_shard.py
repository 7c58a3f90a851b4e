"""Shard writer and view: byte-identical round trips, tar compatibility, and hostile indexes."""

from __future__ import annotations

import io
import tarfile
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_loader.errors import CorruptSampleError, CorruptShard, IndexOutOfBounds, UnsupportedVersion
from remote_loader.format import INDEX_MEMBER, ShardIndex, ShardView, ShardWriter

field_names = st.sampled_from(["jpg", "png", "cls", "txt", "json", "seg.png"])
samples = st.lists(
    st.dictionaries(field_names, st.binary(max_size=3000), min_size=1, max_size=4), min_size=1, max_size=25
)


def build(items: list[dict[str, bytes]]) -> tuple[bytes, object]:
    out = io.BytesIO()
    writer = ShardWriter(out.write)
    for i, fields in enumerate(items):
        writer.add(f"{i:06d}", fields)
    summary = writer.close()
    return out.getvalue(), summary


def open_view(data: bytes, summary, verify: bool = True) -> ShardView:
    index_bytes = data[summary.index_offset : summary.index_offset + summary.index_size]
    index = ShardIndex.decode(index_bytes, data_end=summary.index_offset - 512, name="s.tar")
    return ShardView(data, index, name="s.tar", verify=verify)


@settings(max_examples=60, deadline=None)
@given(samples)
def test_round_trip_is_byte_identical(items):
    data, summary = build(items)
    assert summary.size == len(data) and summary.crc32 == zlib.crc32(data) and summary.samples == len(items)
    view = open_view(data, summary)
    got = [{k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in view]
    assert got == items
    assert [s["__key__"] for s in view] == [f"{i:06d}" for i in range(len(items))]


@settings(max_examples=100, deadline=None)
@given(samples, st.integers(1, 9000), st.data())
def test_cuts_make_the_longest_runs_within_the_limit_or_one_sample(items, limit, data):
    """Each run's bytes (first data byte to last) are at most ``limit`` unless it is one
    sample, and no run could take its next sample and stay within it: the fewest GETs."""
    data_, summary = build(items)
    index = open_view(data_, summary).index
    first = data.draw(st.integers(0, len(items)))
    stop = data.draw(st.integers(first, len(items)))
    cuts = index.cuts(first, stop, limit)
    assert cuts[0] == first and cuts[-1] == stop and all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
    for a, b in zip(cuts, cuts[1:], strict=False):
        size = index.extent(a, b) - index.start(a, b)
        assert size <= limit or b == a + 1, (a, b, size, limit)
        if b < stop:
            assert index.extent(a, b + 1) - index.start(a, b + 1) > limit  # the next sample would not fit


@settings(max_examples=30, deadline=None)
@given(samples)
def test_python_tarfile_reads_the_same_members(items):
    data, _ = build(items)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        expected = [f"{i:06d}.{f}" for i, fields in enumerate(items) for f in fields] + [INDEX_MEMBER]
        assert names == expected
        for member, (i, field) in zip(members, [(i, f) for i, fs in enumerate(items) for f in fs], strict=False):
            assert tar.extractfile(member).read() == items[i][field]


def test_index_is_the_last_member_and_decodes():
    data, summary = build([{"jpg": b"abc", "cls": b"7"}])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        last = tar.getmembers()[-1]
        assert last.name == INDEX_MEMBER and last.offset_data == summary.index_offset
        raw = msgpack.unpackb(tar.extractfile(last).read())
    assert raw["keys"] == ["000000"] and raw["version"] == 1


def test_same_samples_give_identical_shards():
    items = [{"jpg": bytes([i]) * 1000, "cls": str(i).encode()} for i in range(20)]
    assert build(items)[0] == build(items)[0]


def test_webdataset_reads_our_shards_and_skips_the_index(tmp_path):
    wds = pytest.importorskip("webdataset")
    items = [{"jpg": bytes([i]) * 100, "cls": str(i).encode()} for i in range(5)]
    path = tmp_path / "s.tar"
    path.write_bytes(build(items)[0])
    with path.open("rb") as stream:
        got = list(
            wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander([{"url": str(path), "stream": stream}]))
        )
    assert [(s["__key__"], s["jpg"], s["cls"]) for s in got] == [
        (f"{i:06d}", it["jpg"], it["cls"]) for i, it in enumerate(items)
    ]


def test_flipped_byte_is_reported_by_shard_and_key():
    data, summary = build([{"jpg": b"a" * 600, "cls": b"1"}, {"jpg": b"b" * 600, "cls": b"2"}])
    view = open_view(data, summary)
    offset = view.index.members(1)[0][1]
    corrupt = bytearray(data)
    corrupt[offset + 10] ^= 0xFF
    bad = open_view(bytes(corrupt), summary)
    assert bytes(bad.sample(0)["jpg"]) == b"a" * 600
    with pytest.raises(CorruptSampleError) as info:
        bad.sample(1)
    assert (info.value.name, info.value.key, info.value.field) == ("s.tar", "000001", "jpg")
    assert bytes(open_view(bytes(corrupt), summary, verify=False).sample(1)["jpg"]) != b"b" * 600


def test_view_refuses_a_buffer_shorter_than_its_index_says():
    data, summary = build([{"jpg": b"x" * 5000}])
    index = open_view(data, summary).index
    with pytest.raises(CorruptShard, match="shorter"):
        ShardView(data[:2000], index, name="s.tar")


def _index(**overrides) -> bytes:
    raw = {
        "version": 1,
        "fields": ["jpg"],
        "keys": ["a", "b"],
        "offsets": np.array([512, 2048], "<u8").tobytes(),
        "sizes": np.array([10, 10], "<u8").tobytes(),
        "crcs": np.array([0, 0], "<u4").tobytes(),
    }
    raw.update(overrides)
    return msgpack.packb(raw, use_bin_type=True)


def test_index_validation():
    assert len(ShardIndex.decode(_index(), data_end=4096, name="s")) == 2
    with pytest.raises(UnsupportedVersion, match="version 9"):
        ShardIndex.decode(_index(version=9), data_end=4096, name="s")
    with pytest.raises(CorruptShard, match="s"):
        ShardIndex.decode(_index()[:-7], data_end=4096, name="s")
    with pytest.raises(CorruptShard):
        ShardIndex.decode(b"\x00garbage", data_end=4096, name="s")
    with pytest.raises(CorruptShard, match="offsets"):
        ShardIndex.decode(_index(offsets=b"\x01" * 8), data_end=4096, name="s")
    with pytest.raises(CorruptShard, match="missing"):
        ShardIndex.decode(_index(keys=None), data_end=4096, name="s")
    with pytest.raises(CorruptShard, match="no field"):
        ShardIndex.decode(_index(offsets=np.array([512, 0], "<u8").tobytes()), data_end=4096, name="s")


@pytest.mark.parametrize(
    "offset, size",
    [(2048, 4096), (8192, 1), (100, 5), (2048, 2**64 - 1), (2**63, 2**63)],
)
def test_index_pointing_outside_the_shard_is_refused(offset, size):
    bad = _index(offsets=np.array([512, offset], "<u8").tobytes(), sizes=np.array([10, size], "<u8").tobytes())
    with pytest.raises(IndexOutOfBounds, match="'b'"):
        ShardIndex.decode(bad, data_end=4096, name="s")


def test_huge_declared_lengths_do_not_allocate():
    # A msgpack array header claiming 2**32 - 1 elements in a 10-byte buffer.
    with pytest.raises(CorruptShard):
        ShardIndex.decode(b"\x81\xa4keys\xdd\xff\xff\xff\xff", data_end=4096, name="s")


def test_writer_refuses_bad_keys_and_fields():
    writer = ShardWriter(io.BytesIO().write)
    for key in ["a.b", "a/b", "", "x" * 91]:
        with pytest.raises(ValueError, match="key"):
            writer.add(key, {"jpg": b""})
    with pytest.raises(ValueError, match="field"):
        writer.add("k", {"__index__": b""})
    with pytest.raises(ValueError, match="no field"):
        writer.add("k", {})
