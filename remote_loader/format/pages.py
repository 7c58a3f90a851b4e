"""A manifest read by parts (version 3): the head holds the sample counts as runs, the
name template and a directory of pages; the per-shard numbers (sizes, where each index lies,
checksums, the names' numbers) lie in pages of ``rows`` shards, each read, checked and
cached when a shard of it is first asked for.

A page of rows ``[p * rows, (p + 1) * rows)`` holds each column's values for those rows,
one column after another, each in the narrowest little-endian unsigned type that holds that
page's values; the directory gives each page's byte range, crc32 and widths. The pages'
bytes are an object of their own (``object``), or, for a small dataset, inline in the head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from remote_loader.checksum import crc32
from remote_loader.errors import CorruptShard
from remote_loader.format.columns import LIMIT, array, column, increasing, manifest_error, narrow
from remote_loader.format.index import require
from remote_loader.format.names import TemplateNames, check_name, render, template_parts
from remote_loader.format.shard_counts import RunCounts
from remote_loader.format.table import ShardEntry, Shards, ShardTable, check_table
from remote_loader.kept import Kept

PAGE_ROWS = 4096
"""Shards per page, and per block of the epoch's order, that remote_loader writes."""
MAX_ROWS = 1 << 16
"""The most shards a page (and a block of the epoch's order) may hold: a reader makes a
block's order whole, so its memory follows the head's size, not a number the head claims."""
INLINE_BYTES = 1 << 20
"""Pages of at most this many bytes in all are written inside the head: a small dataset opens with one GET."""
PAGE_COLUMNS = ("size", "index_offset", "index_size", "index_crc", "crc32")
_CACHED_PAGES = 32

Load = Callable[[str, int, int, int, Callable[[bytes], Any]], Any]
"""``load(object, size, start, end, parse)``: ``parse`` of bytes ``[start, end)`` of the pages'
object (``size`` bytes in all), fetched again while ``parse`` raises CorruptShard (as the
reader's checksum refetch does)."""


def columns_of(numbers: int) -> tuple[str, ...]:
    """A page's columns, in order, for a template of ``numbers`` number columns."""
    return PAGE_COLUMNS + tuple(f"name{j}" for j in range(numbers))


def encode_pages(table: ShardTable, rows: int | None = None) -> tuple[dict[str, Any], bytearray]:
    """The head's ``samples``, ``names`` and ``pages`` of ``table`` in pages of ``rows``
    (``PAGE_ROWS``), and the pages' bytes (the ``pages`` map still needs ``object`` or ``data``)."""
    rows = rows or PAGE_ROWS
    names = table.names
    if not isinstance(names, TemplateNames) or table.index_names is not None:
        raise ValueError("a manifest of version 3 names its shards by a template and keeps every index in its shard")
    arrays = [table.columns[c] for c in PAGE_COLUMNS] + list(names.numbers)
    starts = range(0, len(table), rows)
    # Each page's widths first, from its maxima, so the pages are written into one buffer
    # (not pieces joined into a second copy: 230 MB at ten million shards).
    widths = bytearray(narrow(np.array([int(a[first : first + rows].max())], dtype=np.uint64)).dtype.itemsize
                       for first in starts for a in arrays)
    per_row = np.frombuffer(bytes(widths), dtype=np.uint8).reshape(len(starts), len(arrays)).sum(axis=1)
    page_rows = np.minimum(rows, len(table) - np.arange(0, len(table), rows, dtype=np.int64))
    offsets = np.concatenate([[0], np.cumsum(per_row * page_rows)]).astype(np.uint64)
    body = bytearray(int(offsets[-1]))
    view = memoryview(body)
    crcs = []
    for p, first in enumerate(starts):
        at = int(offsets[p])
        for k, a in enumerate(arrays):
            data = np.asarray(a[first : first + rows]).astype(f"<u{widths[p * len(arrays) + k]}").tobytes()
            view[at : at + len(data)] = data
            at += len(data)
        crcs.append(crc32(view[int(offsets[p]) : at]))
    runs = RunCounts.of(table.samples)
    head = {
        "samples": {"runs": len(runs.values), "values": column(narrow(runs.values)),
                    "lengths": column(narrow(runs.lengths))},
        "names": {"parts": list(names.parts), "widths": list(names.widths)},
        "pages": {"rows": rows, "size": int(offsets[-1]), "offsets": column(narrow(offsets)),
                  "crcs": column(narrow(np.array(crcs, dtype=np.uint64))), "widths": bytes(widths),
                  "firsts": [column(narrow(np.asarray(a[::rows]))) for a in names.numbers]},
        "bytes": int(table.size.sum(dtype=np.uint64)),
    }
    return head, body


@dataclass(frozen=True)
class Directory:
    """Where each page lies: bytes ``[offsets[p], offsets[p + 1])`` of the pages, its crc32,
    the width of each of its columns, and the names' numbers of its first row."""

    rows: int
    offsets: np.ndarray
    crcs: np.ndarray
    widths: np.ndarray  # pages x columns
    firsts: tuple[np.ndarray, ...]
    object: str | None
    data: bytes | None

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


def decode_runs(raw: dict[str, Any], count: int, name: str | None) -> RunCounts:
    """The ``samples`` runs, checked: every count and length >= 1, the lengths adding up to the
    shards, the total within 63 bits."""
    samples = require(raw, "samples", dict, what="manifest", name=name)
    runs = require(samples, "runs", int, what="manifest samples", name=name)
    if not 0 <= runs <= count:
        raise manifest_error(name, f"{runs} runs of sample counts for {count} shards")
    values = array(samples.get("values"), runs, "samples values", name)
    lengths = array(samples.get("lengths"), runs, "samples lengths", name)
    if runs and (int(values.min()) < 1 or int(lengths.min()) < 1 or int(lengths.max()) > count):
        raise manifest_error(name, f"a run of sample counts holds a shard without samples, no shard, or more than"
                                   f" the {count} shards")
    covered = sum(lengths.tolist())  # Python integers: a sum in 64 bits could wrap around to ``count``
    if covered != count:
        raise manifest_error(name, f"the runs of sample counts cover {covered} shards, not {count}")
    if runs and int(values.max()) * count >= LIMIT:
        raise manifest_error(name, "its sample counts overflow 64 bits")
    return RunCounts(values, lengths)


def decode_directory(raw: dict[str, Any], count: int, numbers: int, name: str | None) -> Directory:
    """The ``pages`` map, checked against itself: every page's bytes where the widths say."""
    pages = require(raw, "pages", dict, what="manifest", name=name)
    rows = require(pages, "rows", int, what="manifest pages", name=name)
    if not 1 <= rows <= MAX_ROWS:
        raise manifest_error(name, f"pages of {rows} rows; a page holds 1 to {MAX_ROWS:,d}")
    n_pages = -(-count // rows)
    offsets = array(pages.get("offsets"), n_pages + 1, "pages offsets", name).astype(np.int64)
    crcs = array(pages.get("crcs"), n_pages, "pages crcs", name)
    if crcs.dtype.itemsize > 4:
        raise manifest_error(name, "a page's crc32 is over 32 bits")
    widths = require(pages, "widths", bytes, what="manifest pages", name=name)
    ncols = len(columns_of(numbers))
    if len(widths) != n_pages * ncols or any(w not in (1, 2, 4, 8) for w in set(widths)):
        raise manifest_error(name, f"pages widths: {n_pages} pages of {ncols} columns, each 1, 2, 4 or 8 bytes wide")
    table = np.frombuffer(widths, dtype=np.uint8).reshape(n_pages, ncols).astype(np.int64)
    page_rows = np.minimum(rows, count - rows * np.arange(n_pages, dtype=np.int64))
    if offsets[0] != 0 or (np.diff(offsets) != page_rows * table.sum(axis=1)).any():
        raise manifest_error(name, "pages offsets do not follow from their rows and widths")
    size = require(pages, "size", int, what="manifest pages", name=name)
    if size != int(offsets[-1]):
        raise manifest_error(name, f"pages size {size} is not where the last page ends ({int(offsets[-1])})")
    firsts_raw = require(pages, "firsts", list, what="manifest pages", name=name)
    if len(firsts_raw) != numbers:
        raise manifest_error(name, f"pages firsts: {len(firsts_raw)} columns for {numbers} name numbers")
    firsts = tuple(array(f, n_pages, f"pages firsts {j}", name) for j, f in enumerate(firsts_raw))
    if not increasing(firsts):
        raise manifest_error(name, "template name numbers are not in strictly increasing order")
    where, data = pages.get("object"), pages.get("data")
    if (where is None) == (data is None) or where is not None and not isinstance(where, str) \
            or data is not None and (not isinstance(data, bytes) or len(data) != size):
        raise manifest_error(name, "pages are neither an object's name nor their bytes inline")
    if where is not None:
        check_name(where, name)
    return Directory(rows, offsets, crcs, table, firsts, where, data)


def _inline(data: bytes, _object: str, _size: int, start: int, end: int, parse: Callable[[bytes], Any]) -> Any:
    """``load`` for pages inside the head (a function, so a table of them pickles)."""
    return parse(data[start:end])


def decode_paged(raw: dict[str, Any], name: str | None, load: Load | None) -> PagedTable:
    """Version 3's table from its head: runs, template and directory checked; pages read on use."""
    count = require(raw, "shards", int, what="manifest", name=name)
    if count < 0:
        raise manifest_error(name, f"negative shard count {count}")
    counts = decode_runs(raw, count, name)
    names = require(raw, "names", dict, what="manifest", name=name)
    parts, widths = template_parts(names, count, name)
    directory = decode_directory(raw, count, len(widths), name)
    total = require(raw, "bytes", int, what="manifest", name=name)
    if not 0 <= total < LIMIT:
        raise manifest_error(name, f"its byte total {total} is outside 63 bits")
    if directory.data is not None:
        load = partial(_inline, directory.data)
    table = PagedTable(count, counts, parts, widths, directory, load, total, name)
    if count:
        check_name(render(parts, widths, [int(f[0]) for f in directory.firsts]), name)
    return table


class PagedTable(Shards):
    """Every shard of a manifest read by parts: ``table[i]`` reads shard ``i``'s page if it is
    not among the last pages read (thread-safe; a forked process keeps the pages read before
    the fork, with a lock of its own).

    Args:
        count: Shards.
        counts: Samples per shard, as runs.
        parts, widths: The names' template.
        directory: Where each page lies.
        load: How the pages' bytes are read (None: only the head is at hand; asking for a
            page raises).
        total_bytes: Bytes of all shards.
        name: The manifest, for messages.
    """

    def __init__(self, count: int, counts: RunCounts, parts: tuple[str, ...], widths: tuple[int, ...],
                 directory: Directory, load: Load | None, total_bytes: int, name: str | None) -> None:
        self.num_shards, self.counts, self.parts, self.widths = count, counts, parts, widths
        self.directory, self.load, self.total_bytes, self.name = directory, load, total_bytes, name
        self.columns_named = columns_of(len(widths))
        self._pages: Kept[int, tuple[np.ndarray, ...]] = Kept(_CACHED_PAGES)
        self.pages_read = 0

    @property
    def keep(self) -> int:
        """Pages kept once read (the least recently used forgotten first)."""
        return self._pages.keep

    @keep.setter
    def keep(self, pages: int) -> None:
        self._pages.keep = pages

    @property
    def rows(self) -> int:
        """Shards per page: the blocks of the epoch's order."""
        return self.directory.rows

    def __len__(self) -> int:
        return self.num_shards

    def page(self, p: int) -> tuple[np.ndarray, ...]:
        """Page ``p``'s columns (``columns_of``), read and checked on first use. Threads asking
        for one page wait for one read of it; pages apart are read at once. A forked child
        keeps the pages read before the fork; a pickled copy reads them again."""
        return self._pages.get(p, partial(self._read, p))

    def _read(self, p: int) -> tuple[np.ndarray, ...]:
        if self.load is None:
            raise CorruptShard(f"manifest {self.name}: its pages were not read with it", name=self.name)
        d = self.directory
        got = self.load(d.object or "", d.size, int(d.offsets[p]), int(d.offsets[p + 1]),
                        lambda data: self._parse(p, data))
        self.pages_read += 1  # one thread a page (single flight); a count for tests and benchmarks
        return got

    def _parse(self, p: int, data: bytes) -> tuple[np.ndarray, ...]:
        data = bytes(data)  # a page's own bytes (the pages of a writer's buffer come as a bytearray)
        d = self.directory
        first = p * d.rows
        rows = min(d.rows, self.num_shards - first)
        where = f"page {p} (shards {first}-{first + rows - 1})"
        if len(data) != int(d.offsets[p + 1] - d.offsets[p]) or crc32(data) != int(d.crcs[p]):
            raise CorruptShard(f"manifest {self.name}: {where} fails its crc32 check", name=self.name)
        out, at = [], 0
        for c, width in zip(self.columns_named, d.widths[p].tolist(), strict=True):
            out.append(array({"dtype": f"<u{width}", "data": data[at : at + rows * width]}, rows,
                             f"{where} column {c!r}", self.name))
            at += rows * width
        self._check(p, first, tuple(out), where)
        return tuple(out)

    def _check(self, p: int, first: int, page: tuple[np.ndarray, ...], where: str) -> None:
        """The value checks of version 2 (``check_table``) on one page, and its names' place."""
        if page[3].dtype.itemsize > 4 or page[4].dtype.itemsize > 4:
            raise manifest_error(self.name, f"{where} holds a crc32 over 32 bits")
        numbers = page[5:]
        rows = np.arange(first, first + len(page[0]), dtype=np.int64)
        columns = {**dict(zip(PAGE_COLUMNS, page[:5], strict=True)), "samples": self.counts.take(rows)}
        check_table(ShardTable(columns, TemplateNames(self.parts, self.widths, numbers, len(rows))), self.name)
        d = self.directory
        after = [np.concatenate([n, f[p + 1 : p + 2]]) for n, f in zip(numbers, d.firsts, strict=True)]
        if any(int(n[0]) != int(f[p]) for n, f in zip(numbers, d.firsts, strict=True)) or not increasing(after):
            raise manifest_error(self.name, f"{where}: template name numbers are not in strictly increasing order"
                                            " or do not begin where the directory says")

    def entry(self, i: int) -> ShardEntry:
        page = self.page(i // self.directory.rows)
        k = i % self.directory.rows
        size, offset, index_size, index_crc, crc = (int(a[k]) for a in page[:5])
        name = render(self.parts, self.widths, [int(a[k]) for a in page[5:]])
        return ShardEntry(name, int(self.counts.take(np.array([i]))[0]), size, offset, index_size, index_crc, crc)

    def table(self) -> ShardTable:
        """Every page read: the whole table as columns (to encode it again)."""
        pages = [self.page(p) for p in range(len(self.directory.crcs))]
        joined = [np.concatenate([page[k].astype(np.uint64) for page in pages]) if pages else np.zeros(0, np.uint64)
                  for k in range(len(self.columns_named))]
        columns = dict(zip(PAGE_COLUMNS, joined[:5], strict=True))
        columns["samples"] = self.counts.take(np.arange(self.num_shards, dtype=np.int64))
        return ShardTable.from_template(columns, self.parts, self.widths, joined[5:])

    def __repr__(self) -> str:
        return f"PagedTable({self.num_shards} shards, pages of {self.directory.rows})"
