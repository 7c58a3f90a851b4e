"""Manifest round trip and validation, versions 1 and 2."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import msgpack
import numpy as np
import pytest

from remote_loader.errors import CorruptShard, IndexOutOfBounds, UnsupportedVersion
from remote_loader.format import Manifest, ShardEntry

OURS = (
    ShardEntry("shard-0a1b2c3d-000000-000.tar", 10, 50_000, 48_000, 300, 1, 2),
    ShardEntry("shard-0a1b2c3d-000000-001.tar", 5, 9_000, 7_000, 100, 3, 4),
    ShardEntry("shard-0a1b2c3d-000003-000.tar", 70_000, 2**40, 2**40 - 9000, 8000, 2**32 - 1, 0),
)
INDEXED = (
    ShardEntry("train/a.tar", 3, 5_000, 0, 120, 7, 8, "train/a.tar.index"),
    ShardEntry("train/b-final.tar", 4, 6_000, 0, 130, 9, 10, "train/b-final.tar.index"),
)


def manifest(version: int = 2, shards=OURS, **overrides) -> Manifest:
    values = dict(shards=shards, fields=("cls", "jpg"), params={"upload": {"seed": 3}, "classes": ["a", "b"]},
                  skipped=2, skipped_indices=(4, 17), version=version)
    values.update(overrides)
    return Manifest(**values)


def seal(body: bytes) -> bytes:
    """Append the crc32 trailer, as the writer does."""
    return body + struct.pack("<I", zlib.crc32(body))


def edit(written_as: int = 2, **changes) -> bytes:
    raw = msgpack.unpackb(manifest(written_as).encode()[:-4])
    raw.update(changes)
    return seal(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize("shards", [OURS, INDEXED], ids=["template-names", "blob-names"])
def test_versions_1_and_2_read_the_same(shards):
    one, two = (Manifest.decode(manifest(v, shards).encode(), name="m") for v in (1, 2))
    assert list(one.shards) == list(two.shards) == list(shards)
    assert (one.num_samples, one.num_bytes) == (two.num_samples, two.num_bytes) == (
        sum(s.samples for s in shards), sum(s.size for s in shards))
    assert (one.fields, one.params, one.skipped, one.skipped_indices) == (two.fields, two.params, 2, (4, 17))
    assert (one.version, two.version) == (1, 2)
    assert two.shards.samples.dtype.kind == "u" and not two.shards.samples.flags.writeable


def test_our_names_are_stored_as_a_template_and_others_as_a_blob():
    ours = msgpack.unpackb(manifest(2, OURS).encode()[:-4])
    assert ours["names"]["parts"] == ["shard-0a1b2c3d-", "-", ".tar"] and ours["names"]["widths"] == [6, 3]
    assert "index_names" not in ours
    unordered = msgpack.unpackb(manifest(2, OURS[::-1]).encode()[:-4])  # not increasing: no template
    assert "blob" in unordered["names"]
    indexed = msgpack.unpackb(manifest(2, INDEXED).encode()[:-4])
    assert "blob" in indexed["names"] and "blob" in indexed["index_names"]


def test_a_million_shards_take_tens_of_bytes_each_and_decode_as_arrays():
    n = 1_000_000
    shards = [
        ShardEntry(f"shard-0a1b2c3d-{t:06d}-000.tar", 1000, 10_000_000, 9_990_000, 9000, t, t)
        for t in range(0, n, 1000)
    ]
    m = Manifest(shards=shards, fields=("cls",))
    assert len(m.encode()) < 40 * len(shards) + 1000
    again = Manifest.decode(m.encode(), name="m")
    assert again.shards[-1] == shards[-1] and again.shards[-len(shards)] == shards[0]
    with pytest.raises(IndexError, match="shard 1000 out of range"):
        again.shards[len(shards)]


@pytest.mark.parametrize("version", [1, 2])
def test_any_flipped_byte_fails_the_checksum(version):
    data = manifest(version).encode()
    for position in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        with pytest.raises(CorruptShard):
            Manifest.decode(bytes(damaged), name="m")


def test_newer_version_is_refused_with_a_clear_message():
    with pytest.raises(UnsupportedVersion, match="version 4.*upgrade"):
        Manifest.decode(edit(2, version=4), name="s3://b/p/manifest.msgpack")


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
        (["ok.tar", 0, 5000, 2000, 10, 0, 0, ""], CorruptShard),
        (["ok.tar", 1, 5000], CorruptShard),
        (["ok.tar", 1, 5000, 2000, 10, 0, 0, "../idx"], CorruptShard),
        (["ok.tar", 1, 5000, 2000, 10, 0, 0, 7], CorruptShard),
        (["ok.tar", "1", 5000, 2000, 10, 0, 0, ""], CorruptShard),
        (["ok.tar", 2**64 - 1, 2**64 - 1, 2000, 10, 0, 0, ""], CorruptShard),
    ],
)
def test_bad_version_1_rows(row, error):
    with pytest.raises(error):
        Manifest.decode(edit(1, shards=[row]), name="m")


def test_duplicate_shard_is_refused():
    row = ["a.tar", 1, 5000, 2000, 10, 0, 0, ""]
    with pytest.raises(CorruptShard, match="twice"):
        Manifest.decode(edit(1, shards=[row, row]), name="m")
    raw = msgpack.unpackb(manifest(2, INDEXED).encode()[:-4])
    raw["names"]["blob"] = b"train/a.tar" * 2
    raw["names"]["offsets"] = {"dtype": "<u1", "data": np.array([0, 11, 22], "<u1").tobytes()}
    with pytest.raises(CorruptShard, match="twice"):
        Manifest.decode(seal(msgpack.packb(raw, use_bin_type=True)), name="m")


# ---------------------------------------------------------------------------- version 2 from its spec


def narrowest(values) -> str:
    """The type the spec has writers pick: the narrowest of the four that holds every value."""
    top = max(values, default=0)
    return next(f"<u{w}" for w in (1, 2, 4, 8) if top < 2 ** (8 * w))


def column(values, dtype=None) -> dict:
    dtype = dtype or narrowest(values)
    return {"dtype": dtype, "data": np.asarray(values, dtype=dtype).tobytes()}


def spec_manifest(**changes) -> bytes:
    """A version 2 manifest written from docs/FORMAT.md with msgpack and numpy only."""
    body = {
        "format": "remote_loader",
        "version": 2,
        "fields": ["cls", "jpg"],
        "shards": 3,
        "columns": {
            "samples": column([1000, 1000, 7]),
            "size": column([1_000_000, 1_100_000, 9_000]),
            "index_offset": column([990_000, 1_090_000, 7_000]),
            "index_size": column([9_000, 9_500, 120]),
            "index_crc": column([1, 2, 3]),
            "crc32": column([4, 5, 6]),
        },
        "names": {
            "parts": ["part-", "/shard-", ".tar"],
            "widths": [2, 5],
            "numbers": [column([0, 0, 1]), column([0, 12345, 7])],
        },
        "params": {},
        "skipped": 0,
        "skipped_indices": [],
    }
    body.update(changes)
    return seal(msgpack.packb(body, use_bin_type=True))


def test_a_manifest_written_from_the_spec_opens():
    m = Manifest.decode(spec_manifest(), name="spec")
    assert [s.name for s in m.shards] == [
        "part-00/shard-00000.tar",
        "part-00/shard-12345.tar",
        "part-01/shard-00007.tar",
    ]
    assert m.shards[2] == ShardEntry("part-01/shard-00007.tar", 7, 9_000, 7_000, 120, 3, 6)
    assert m.num_samples == 2007 and m.version == 2


def test_a_blob_named_manifest_with_separate_indexes_written_from_the_spec_opens():
    names = ["a.tar", "dir/b.tar"]
    blob = "".join(names).encode()
    m = Manifest.decode(
        spec_manifest(
            shards=2,
            columns={
                "samples": column([3, 4]),
                "size": column([5000, 6000]),
                "index_offset": column([0, 5000]),
                "index_size": column([100, 200]),
                "index_crc": column([1, 2]),
                "crc32": column([3, 4]),
            },
            names={"blob": blob, "offsets": column([0, 5, 14])},
            index_names={"blob": b"a.tar.index", "offsets": column([0, 11, 11])},
        ),
        name="spec",
    )
    assert list(m.shards) == [
        ShardEntry("a.tar", 3, 5000, 0, 100, 1, 3, "a.tar.index"),
        ShardEntry("dir/b.tar", 4, 6000, 5000, 200, 2, 4, ""),
    ]


def _columns(**changes) -> dict:
    raw = msgpack.unpackb(spec_manifest()[:-4])["columns"]
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"columns": _columns(size=column([1, 2], "<u4"))}, "column 'size' holds 8 bytes; 3 values of <u4 need 12"),
        ({"columns": _columns(size=column([1, 2, 3, 4], "<u4"))}, "column 'size' holds 16 bytes"),
        ({"columns": _columns(crc32={"dtype": "<i4", "data": b"\0" * 12})}, "column 'crc32' is not a map"),
        ({"columns": _columns(crc32=column([1, 2, 2**40]))}, "'crc32' holds a value over 32 bits"),
        ({"columns": {k: v for k, v in _columns().items() if k != "crc32"}}, "columns are"),
        ({"shards": 4}, "3 values|4 values"),
        ({"shards": -1}, "negative shard count"),
        ({"columns": _columns(samples=column([2**62, 2**62, 1]))}, "overflow"),
        ({"columns": _columns(samples=column([1, 0, 1]))}, "has no samples"),
        ({"columns": _columns(size=column([2**63, 1_100_000, 9000]))}, "over 63 bits"),
        (
            {"names": {"parts": ["part-", "/shard-", ".tar"], "widths": [2, 5], "numbers": [column([0, 0, 1], "<u1")]}},
            "neither a blob",
        ),
        (
            {
                "names": {
                    "parts": ["../", "/", ".tar"],
                    "widths": [2, 5],
                    "numbers": [column([0, 0, 1]), column([1, 2, 3])],
                }
            },
            "unsafe",
        ),
        (
            {
                "names": {
                    "parts": ["x", "", ".tar"],
                    "widths": [2, 5],
                    "numbers": [column([0, 0, 1]), column([1, 2, 3])],
                }
            },
            "non-empty",
        ),
        (
            {
                "names": {
                    "parts": ["a-", "/b-", ".tar"],
                    "widths": [2, 5],
                    "numbers": [column([0, 0, 0]), column([1, 1, 3])],
                }
            },
            "strictly increasing",
        ),
        ({"names": {"blob": b"a.tarb.tarc.tar", "offsets": column([0, 5, 10])}}, "names offsets holds"),
        ({"names": {"blob": b"a.tarb.tarc.tar", "offsets": column([0, 10, 5, 15])}}, "in order"),
        ({"names": {"blob": b"a.tarb.tarc.tar", "offsets": column([0, 5, 10, 99])}}, "blob's end"),
        ({"names": {"blob": b"a.tar\xffb.tarc.tar", "offsets": column([0, 6, 11, 16])}}, "not UTF-8"),
    ],
)
def test_malformed_version_2_columns_name_the_manifest(changes, message):
    with pytest.raises(CorruptShard, match=message) as caught:
        Manifest.decode(spec_manifest(**changes), name="s3://b/p/manifest.msgpack")
    assert "s3://b/p/manifest.msgpack" in str(caught.value)


def test_index_outside_its_shard_is_refused():
    with pytest.raises(IndexOutOfBounds, match="shard-12345"):
        Manifest.decode(spec_manifest(columns=_columns(index_offset=column([990_000, 1_095_000, 7_000]))), name="m")


def test_a_huge_claimed_count_fails_before_any_large_allocation():
    tracemalloc.start()
    try:
        with pytest.raises(CorruptShard, match="need"):
            Manifest.decode(spec_manifest(shards=10**15), name="m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


# ------------------------------------------------------------ points a reader written from the spec alone raised


def test_a_template_without_numbers_names_one_shard_only():
    one = {
        "samples": column([5]),
        "size": column([9000]),
        "index_offset": column([7000]),
        "index_size": column([100]),
        "index_crc": column([1]),
        "crc32": column([2]),
    }
    assert (
        Manifest.decode(
            spec_manifest(shards=1, columns=one, names={"parts": ["only.tar"], "widths": [], "numbers": []}), name="m"
        ).shards.names[0]
        == "only.tar"
    )
    with pytest.raises(CorruptShard, match="without numbers names one shard, not 3"):
        Manifest.decode(spec_manifest(names={"parts": ["same.tar"], "widths": [], "numbers": []}), name="m")


def test_a_part_between_numbers_that_starts_with_a_digit_is_refused():
    # Rows (1, 13) and (11, 3) both render s1113.tar with these parts: increasing rows alone
    # do not make names unique when a part between two numbers starts with a digit.
    two = {
        "samples": column([5, 5]),
        "size": column([9000, 9000]),
        "index_offset": column([7000, 7000]),
        "index_size": column([100, 100]),
        "index_crc": column([1, 2]),
        "crc32": column([3, 4]),
    }
    names = {"parts": ["s", "1", ".tar"], "widths": [1, 1], "numbers": [column([1, 11]), column([13, 3])]}
    with pytest.raises(CorruptShard, match="start with a character that is not a digit"):
        Manifest.decode(spec_manifest(shards=2, columns=two, names=names), name="m")
    names["parts"] = ["s", "-1", ".tar"]  # a part that only ends in digits is fine: s1-113.tar, s11-13.tar
    assert list(Manifest.decode(spec_manifest(shards=2, columns=two, names=names), name="m").shards.names) == [
        "s1-113.tar",
        "s11-13.tar",
    ]


@pytest.mark.parametrize(
    "bad", [".hidden.tar", "-x.tar", "\u00e9.tar", "a//b.tar", "a/../b.tar", "a/.b.tar", "a b.tar"]
)
def test_names_follow_the_specs_rule_exactly(bad):
    good = ["a.tar", "_x/b-1.c.tar", "0/9.tar"]
    blob = "".join([bad, *good[1:]]).encode()
    offsets = np.cumsum([0, *(len(n.encode()) for n in [bad, *good[1:]])])
    with pytest.raises(CorruptShard, match="unsafe"):
        Manifest.decode(spec_manifest(names={"blob": blob, "offsets": column(offsets)}), name="m")
    blob = "".join(good).encode()
    offsets = np.cumsum([0, *(len(n) for n in good)])
    assert (
        list(Manifest.decode(spec_manifest(names={"blob": blob, "offsets": column(offsets)}), name="m").shards.names)
        == good
    )


def _big_shards(n: int, samples: list[int]) -> bytes:
    """A manifest of ``n`` shards of 2**62 bytes each, with these sample counts."""
    size = 2**62
    columns = {
        "samples": column(samples),
        "size": column([size] * n),
        "index_offset": column([size - 2000] * n),
        "index_size": column([1000] * n),
        "index_crc": column([1] * n),
        "crc32": column([2] * n),
    }
    names = {"parts": ["s", ".tar"], "widths": [4], "numbers": [column(list(range(n)))]}
    return spec_manifest(shards=n, columns=columns, names=names)


def test_the_sample_total_may_reach_just_below_two_to_the_63():
    # Each shard holds at most size / 512 samples (one tar header each), and sizes are below
    # 2**63: 1023 shards of 2**53 samples fit (2**63 - 2**53); one sample more overflows.
    top = 2**53
    assert Manifest.decode(_big_shards(1023, [top] * 1023), name="m").num_samples == 1023 * top
    with pytest.raises(CorruptShard, match="overflow"):
        Manifest.decode(_big_shards(1024, [top] * 1024), name="m")


def test_a_shard_claiming_more_samples_than_its_size_holds_is_refused():
    columns = _columns(samples=column([1000, 1000, 18]))  # 9,000 bytes hold at most 17 samples of 512
    with pytest.raises(CorruptShard, match=r"part-01/shard-00007.tar claims 18 samples in 9,000 bytes"):
        Manifest.decode(spec_manifest(columns=columns), name="m")
    assert Manifest.decode(spec_manifest(columns=_columns(samples=column([1000, 1000, 17]))), name="m")


def test_an_index_kept_apart_starts_at_offset_0_of_its_object():
    columns = {
        "samples": column([3, 4]),
        "size": column([5000, 6000]),
        "index_offset": column([64, 5000]),
        "index_size": column([100, 200]),
        "index_crc": column([1, 2]),
        "crc32": column([3, 4]),
    }
    names = {"blob": b"a.tardir/b.tar", "offsets": column([0, 5, 14])}
    with pytest.raises(CorruptShard, match="a.tar keeps its index in a.tar.index at offset 64"):
        Manifest.decode(
            spec_manifest(
                shards=2,
                columns=columns,
                names=names,
                index_names={"blob": b"a.tar.index", "offsets": column([0, 11, 11])},
            ),
            name="m",
        )


@pytest.mark.parametrize("key", ["params", "skipped", "skipped_indices"])
def test_params_and_skipped_are_required(key):
    raw = msgpack.unpackb(spec_manifest()[:-4])
    del raw[key]
    with pytest.raises(CorruptShard, match=key):
        Manifest.decode(seal(msgpack.packb(raw, use_bin_type=True)), name="m")


def test_the_epoch_shard_order_is_the_generator_the_spec_names():
    from remote_loader.format.epoch_order import block_shards, shard_order

    assert shard_order(1000, 7, 3).tolist() == np.random.default_rng([7, 3]).permutation(1000).tolist()
    # version 3: block 2 of pages of 64 rows, in a manifest of 150 shards (the last block shorter)
    expected = 128 + np.random.default_rng([7, 3, 1, 2]).permutation(22)
    assert block_shards(2, 64, 150, 7, 3).tolist() == expected.tolist()


def test_a_column_wider_than_its_values_need_is_refused():
    wide = _columns(samples=column([1000, 1000, 7], "<u8"))
    with pytest.raises(CorruptShard, match="column 'samples' is stored as <u8 but its values fit <u2"):
        Manifest.decode(spec_manifest(columns=wide), name="m")
    names = {
        "parts": ["part-", "/shard-", ".tar"],
        "widths": [2, 5],
        "numbers": [column([0, 0, 1], "<u2"), column([0, 12345, 7])],
    }
    with pytest.raises(CorruptShard, match="names number column 0 is stored as <u2"):
        Manifest.decode(spec_manifest(names=names), name="m")
    assert (
        Manifest.decode(
            spec_manifest(
                shards=0, columns={c: column([]) for c in _columns()}, names={"blob": b"", "offsets": column([0])}
            ),
            name="m",
        ).num_samples
        == 0
    )


@pytest.mark.parametrize(
    "names, parts, widths",
    [
        (
            ["shard-ab12cd34-000000-000.tar", "shard-ab12cd34-000000-001.tar", "shard-ab12cd34-000001-000.tar"],
            ("shard-ab12cd34-", "-", ".tar"),
            (6, 3),
        ),
        (["shard-ab12cd34-000000-000.tar", "shard-ab12cd34-000001-000.tar"], ("shard-ab12cd34-", "-000.tar"), (6,)),
        (["shard-ab12cd34-000000-000.tar"], ("shard-ab12cd34-000000-000.tar",), ()),
    ],
)
def test_our_shard_names_take_the_templates_format_md_describes(names, parts, widths):
    entries = [ShardEntry(n, 1, 2048, 1024, 10, 1, 2) for n in names]
    raw = msgpack.unpackb(Manifest(shards=entries, fields=("jpg",)).encode()[:-4])
    assert (tuple(raw["names"]["parts"]), tuple(raw["names"]["widths"])) == (parts, widths)
