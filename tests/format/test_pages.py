"""Manifest version 3, read by pages: round trips, only the pages asked for are read, and
every malformed head or page is refused by name (pure, no server)."""

from __future__ import annotations

import pickle
import struct
import zlib

import msgpack
import numpy as np
import pytest

from remote_loader.errors import CorruptShard, IndexOutOfBounds
from remote_loader.format import Manifest, ShardTable
from remote_loader.format import pages as paging
from remote_loader.format.shard_counts import ArrayCounts, RunCounts, block_totals

PAGES = "shard-0a1b2c3d-manifest.pages"


def table(n: int = 10, samples=None) -> ShardTable:
    samples = np.array(samples if samples is not None else [7] * (n - 1) + [3], dtype=np.uint64)
    columns = {"samples": samples, "size": 10_000 + np.arange(n, dtype=np.uint64) * 300,
               "index_offset": np.full(n, 5_000, dtype=np.uint64), "index_size": np.full(n, 100, dtype=np.uint64),
               "index_crc": np.arange(n, dtype=np.uint64) * 2**24, "crc32": np.full(n, 2**32 - 1, dtype=np.uint64)}
    tasks = np.arange(n, dtype=np.uint64) // 2
    return ShardTable.from_template(columns, ("shard-0a1b2c3d-", "-", ".tar"), (6, 3), (tasks, np.arange(n) % 2))


def parts(t: ShardTable, rows: int = 3, monkeypatch=None) -> tuple[bytes, bytes]:
    monkeypatch.setattr(paging, "PAGE_ROWS", rows)
    monkeypatch.setattr(paging, "INLINE_BYTES", 0)
    head, body = Manifest(shards=t, fields=("cls",), version=3).encode_parts(PAGES)
    assert body is not None
    return head, body


class Pages:
    """The pages' object, as a store would serve it, counting the reads."""

    def __init__(self, body: bytes) -> None:
        self.body, self.reads = body, []

    def __call__(self, name, size, start, end, parse):
        assert name == PAGES and size == len(self.body)
        self.reads.append((start, end))
        return parse(self.body[start:end])


def test_a_table_comes_back_entry_for_entry_and_encodes_again_byte_for_byte(monkeypatch):
    t = table(10)
    head, body = parts(t, 3, monkeypatch)
    decoded = Manifest.decode(head, name="m", load=Pages(body))
    assert decoded.version == 3 and len(decoded.shards) == 10
    assert list(decoded.shards) == list(t)
    assert decoded.num_samples == 7 * 9 + 3 and decoded.num_bytes == int(t.size.sum())
    assert decoded.encode_parts(PAGES) == (head, body)
    inline = Manifest(shards=t, fields=("cls",), version=3).encode()  # small: one object, pages inside
    assert list(Manifest.decode(inline, name="m").shards) == list(t)


def test_only_the_page_of_a_shard_asked_for_is_read_and_then_kept(monkeypatch):
    head, body = parts(table(10), 3, monkeypatch)
    pages = Pages(body)
    shards = Manifest.decode(head, name="m", load=pages).shards
    assert pages.reads == []  # the head alone opens it
    assert shards[7].name == "shard-0a1b2c3d-000003-001.tar"
    assert shards[8].samples == 7 and shards[6].size == 10_000 + 6 * 300
    assert len(pages.reads) == 1  # shards 6, 7 and 8 are page 2
    shards[0]
    assert len(pages.reads) == 2


def test_counts_as_runs_answer_as_one_count_per_shard():
    counts = np.array([5, 5, 5, 2, 9, 9, 1], dtype=np.int64)
    runs, array = RunCounts.of(counts), ArrayCounts(counts)
    assert len(runs.values) == 4 and len(runs) == len(array) == 7 and runs.total == array.total == 36
    shards = np.array([6, 0, 3, 4], dtype=np.int64)
    assert runs.take(shards).tolist() == array.take(shards).tolist() == [1, 5, 2, 9]
    edges = np.arange(8, dtype=np.int64)
    assert runs.prefix(edges).tolist() == array.prefix(edges).tolist() == [0, 5, 10, 15, 17, 26, 35, 36]
    samples = np.arange(36, dtype=np.int64)
    assert [a.tolist() for a in runs.locate(samples)] == [a.tolist() for a in array.locate(samples)]
    assert block_totals(runs, 3).tolist() == block_totals(array, 3).tolist() == [15, 20, 1]


def head_map(monkeypatch, n: int = 10) -> tuple[dict, bytes]:
    head, body = parts(table(n), 3, monkeypatch)
    return msgpack.unpackb(head[:-4]), body


def sealed(raw: dict) -> bytes:
    data = msgpack.packb(raw, use_bin_type=True)
    return data + struct.pack("<I", zlib.crc32(data))


def column(values, width: int | None = None) -> dict:
    """A column in the narrowest width that holds ``values``, or in ``width``."""
    values = np.asarray(values, dtype=np.uint64)
    top = int(values.max()) if len(values) else 0
    width = width or next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    return {"dtype": f"<u{width}", "data": values.astype(f"<u{width}").tobytes()}


@pytest.mark.parametrize("change, message", [
    (lambda r: r["samples"].update(lengths=column([8, 1])), "cover 9 shards, not 10"),
    (lambda r: r["samples"].update(runs=2, values=column([7, 0]), lengths=column([9, 1])), "without samples"),
    (lambda r: r["samples"].update(runs=11), "11 runs of sample counts for 10 shards"),
    (lambda r: r["pages"].update(rows=0), "pages of 0 rows"),
    (lambda r: r["pages"].update(rows=5), "pages offsets"),
    (lambda r: r["pages"].update(widths=b"\x03" * 28), "each 1, 2, 4 or 8 bytes wide"),
    (lambda r: r["pages"].update(size=r["pages"]["size"] + 1), "is not where the last page ends"),
    (lambda r: r["pages"].update(firsts=[column([0, 1, 1, 4]), column([0, 1, 0, 1])]), "strictly increasing"),
    (lambda r: r["pages"].update(object="../elsewhere"), "unsafe"),
    (lambda r: r["pages"].update(data=b"x"), "neither an object's name nor their bytes inline"),
    (lambda r: r["names"].update(parts=["shard-", "7", ".tar"]), "must be non-empty and start with"),
    (lambda r: r.update(bytes=-1), "byte total"),
    # lengths whose 64-bit sum wraps around to the shard count
    (lambda r: r["samples"].update(runs=2, values=column([7, 3]), lengths=column([2**64 - 5, 15])), "more than the"),
    (lambda r: r["pages"]["crcs"].update(dtype={"<u4": 1}), "pages crcs is not a map of a dtype"),
    (lambda r: r["pages"].update(rows=1 << 17), "a page holds 1 to 65,536"),  # a block made whole: bounded
])
def test_a_malformed_head_is_refused_saying_what_is_wrong(monkeypatch, change, message):
    raw, body = head_map(monkeypatch)
    change(raw)
    with pytest.raises(CorruptShard, match=message):
        Manifest.decode(sealed(raw), name="m", load=Pages(body))


def forge(body: bytes, raw: dict, page: int, column_at: int, values, width=None) -> tuple[bytes, dict]:
    """Page ``page`` with its column ``column_at`` replaced by ``values`` (its width, crc32 and
    the offsets after it made to agree, as a careful forger would)."""
    pages = raw["pages"]
    offsets = np.frombuffer(pages["offsets"]["data"], dtype=pages["offsets"]["dtype"]).astype(np.int64)
    ncols = len(pages["widths"]) // (len(offsets) - 1)
    widths = bytearray(pages["widths"])
    rows = min(3, 10 - 3 * page)
    data = body[offsets[page] : offsets[page + 1]]
    at = sum(widths[page * ncols + k] for k in range(column_at)) * rows
    old = widths[page * ncols + column_at] * rows
    new = column(values, width)
    data = data[:at] + new["data"] + data[at + old :]
    widths[page * ncols + column_at] = int(new["dtype"][-1])
    body = body[: offsets[page]] + data + body[offsets[page + 1] :]
    offsets[page + 1 :] += len(new["data"]) - old
    crcs = np.frombuffer(pages["crcs"]["data"], dtype=pages["crcs"]["dtype"]).astype(np.uint64).copy()
    crcs[page] = zlib.crc32(data)
    pages.update(offsets=column(offsets), crcs=column(crcs), widths=bytes(widths), size=int(offsets[-1]))
    return body, raw


@pytest.mark.parametrize("column_at, values, width, error, message", [
    (0, [10_000, 300, 10_600], None, CorruptShard, "claims 7 samples in 300 bytes"),
    (1, [5_000, 20_000, 5_000], None, IndexOutOfBounds, "outside its"),
    (3, [2**33, 0, 0], None, CorruptShard, "crc32 over 32 bits"),
    (5, [1, 1, 2], None, CorruptShard, "strictly increasing"),
    (6, [1, 0, 1], 2, CorruptShard, "stored as <u2 but its values fit <u1"),
])
def test_a_page_whose_values_break_a_rule_is_refused_naming_the_page_and_shard(monkeypatch, column_at, values, width,
                                                                               error, message):
    raw, body = head_map(monkeypatch)
    body, raw = forge(body, raw, 1, column_at, values, width)
    shards = Manifest.decode(sealed(raw), name="m", load=Pages(body)).shards
    assert shards[0].samples == 7  # page 0 is sound
    with pytest.raises(error, match=message):
        shards[4]


def test_a_page_that_fails_its_crc32_is_refused_naming_it(monkeypatch):
    raw, body = head_map(monkeypatch)
    damaged = bytearray(body)
    damaged[-1] ^= 1
    shards = Manifest.decode(sealed(raw), name="m", load=Pages(bytes(damaged))).shards
    with pytest.raises(CorruptShard, match=r"page 3 \(shards 9-9\) fails its crc32 check"):
        shards[9]
    assert shards[8].samples == 7


def test_a_head_without_its_pages_at_hand_says_so():
    raw = Manifest(shards=table(10), fields=("cls",), version=3)
    head, body = raw.encode_parts(PAGES)
    assert body is None  # small: inline
    with pytest.MonkeyPatch.context() as m:
        m.setattr(paging, "INLINE_BYTES", 0)
        head, body = raw.encode_parts(PAGES)
    shards = Manifest.decode(head, name="m").shards
    assert len(shards) == 10 and shards.counts.total == 66
    with pytest.raises(CorruptShard, match="its pages were not read with it"):
        shards[0]


def test_a_manifest_of_ten_million_shards_opens_from_a_head_of_kilobytes(monkeypatch):
    n = 10_000_000
    full = np.full(n, 1000, dtype=np.uint64)
    columns = {"samples": full, "size": full * 600, "index_offset": full * 500, "index_size": full // 10,
               "index_crc": full, "crc32": full}
    big = ShardTable.from_template(columns, ("shard-0a1b2c3d-", "-", ".tar"), (6, 3),
                                   (np.arange(n), np.zeros(n, dtype=np.uint8)))
    head, body = Manifest(shards=big, fields=("cls",), version=3).encode_parts(PAGES)
    assert body is not None and len(head) < 200_000, len(head)
    pages = Pages(body)
    shards = Manifest.decode(head, name="m", load=pages).shards
    assert shards.counts.total == 10**10 and len(shards.counts.values) == 1
    assert shards[9_999_999].name == "shard-0a1b2c3d-9999999-000.tar" and len(pages.reads) == 1


def test_a_table_with_its_pages_inline_pickles_and_reads_the_same():
    t = table(10)
    shards = Manifest.decode(Manifest(shards=t, fields=("cls",), version=3).encode(), name="m").shards
    assert list(pickle.loads(pickle.dumps(shards))) == list(t)
