"""Samples out of fetched shard ranges: indexes (cached), checksum refetch, damaged shards.

A range is read while its parts arrive. Bytes failing their checksum are fetched again;
what stays damaged, or a shard that is missing, raises, or with ``on_error="skip"`` is
skipped, counted and logged. Before blaming damage, the manifest is read again: a dataset
overwritten under the reader raises ``DatasetChanged`` instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from remote_loader.checksum import crc32
from remote_loader.errors import CorruptShard, InvalidRange, ObjectNotFound, OnError, PreconditionFailed, TruncatedShard
from remote_loader.format import Sample, ShardEntry, ShardIndex, ShardView
from remote_loader.format.tar import scan_tar
from remote_loader.kept import Kept
from remote_loader.read.fetch import Fetched, Job, fetch_range
from remote_loader.read.reader import DatasetReader
from remote_loader.read.session import Pinned, ReadSession
from remote_loader.storage.daemon import in_daemon_thread

log = logging.getLogger("remote_loader")

SMALL_SAMPLES = 16 * 1024
"""Mean bytes a sample under which a range of a cached shard is read whole and its members
copied out (``SpanRead._read_small``), not read one ``pread`` a member."""

DAMAGE = (CorruptShard, ObjectNotFound)
"""What ``on_error="skip"`` skips: bytes that stay corrupt, a shard or index that is gone."""

TAR_HEAD = 64 << 10
"""The first bytes of an unindexed tar, fetched with the object's size as its range's first
part (a tar under twice this is fetched whole so). Small: that GET runs where the range is
located, beside a few others, and the rest goes through the fetcher's GETs, whose number
grows with the store's speed (at 1 MiB, 160 tars of 1.45 MiB took 2.8 s against 1.0 s)."""


def fetch_index(reader: DatasetReader, entry: ShardEntry, session: ReadSession) -> ShardIndex:
    """Fetch a shard's index with one ranged GET; again if its bytes fail their checksum.

    Raises DatasetChanged if the index is missing or damaged because the dataset was replaced.
    """
    try:
        return reader.read_index(entry, session)
    except DAMAGE as error:
        reader.check_unchanged(error)
        raise


class IndexCache:
    """Shard indexes fetched on first use, or ahead (``prefetch``), and kept in an LRU of
    ``keep`` (``kept.Kept``: an index is fetched once however many threads ask for
    it); an index found damaged is not fetched again."""

    def __init__(self, reader: DatasetReader, session: ReadSession, keep: int) -> None:
        self.reader, self.session, self.keep = reader, session, keep
        self._kept: Kept[int, ShardIndex] = Kept(keep)
        self._damaged: dict[int, BaseException] = {}

    def cached(self, shard: int) -> ShardIndex | None:
        """The shard's index if it is kept, else None (nothing is fetched)."""
        return self._kept.cached(shard)

    def get(self, shard: int) -> ShardIndex:
        """The shard's index: kept, on its way (waited for), or fetched now."""
        damaged = self._damaged.get(shard)
        if damaged is not None:
            raise damaged
        return self._kept.get(shard, partial(self._fetch, shard))

    def _fetch(self, shard: int) -> ShardIndex:
        try:
            return fetch_index(self.reader, self.reader.manifest.shards[shard], self.session)
        except DAMAGE as exc:
            self._damaged[shard] = exc
            raise

    def prefetch(self, shards: Iterable[int]) -> None:
        """Start fetching the indexes of ``shards`` not kept or on their way, each on a daemon
        thread; a failure is raised by the ``get`` that needs it."""
        for shard in shards:
            if not self._kept.known(shard):
                in_daemon_thread(partial(self.get, shard), "remote-loader-index")


def own(sample: Sample) -> Sample:
    """Copy a sample's fields out of the range buffer, which is reused once the range is read."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def as_views(sample: Sample) -> Sample:
    """A sample's members as read-only memoryviews (what ``views=True`` gives)."""
    return {k: memoryview(v) if isinstance(v, bytes) else v for k, v in sample.items()}


def read_run(
    reader: DatasetReader, shard: int, index: ShardIndex, positions: list[int], session: ReadSession,
    once: bool = False,
) -> list[Sample]:
    """Samples ``positions`` (sorted) of one shard with one GET, fetched again while their
    bytes fail their checksums (up to ``refetch_attempts`` fetches; ``once``: one fetch)."""
    entry = reader.manifest.shards[shard]
    first, stop = positions[0], positions[-1] + 1
    start, end = index.start(first, stop), index.extent(first, stop)
    shard_object = reader.shard(entry)

    def parse(data: bytes | bytearray) -> list[Sample]:
        view = ShardView(data, index, name=entry.name, verify=reader.verify, base=start, first=first, stop=stop)
        return [own(view.sample(j)) for j in positions]

    def fetch() -> bytes | bytearray:
        try:
            return fetch_range(session, reader.location.bucket, shard_object, start, end)
        except InvalidRange:
            raise reader.refused(entry.name, start, end, entry.size, session) from None

    try:
        return parse(fetch()) if once else session.refetch(fetch, parse, shard_object)
    except DAMAGE as error:
        reader.check_unchanged(error)
        raise


def read_cached(
    reader: DatasetReader, shard: int, index: ShardIndex, positions: list[int], session: ReadSession
) -> list[Sample] | None:
    """Samples ``positions`` (sorted) of a shard the node's cache holds whole, each member read
    from its file straight into its bytes (checked where the file is not trusted as it is);
    None where the cache does not hold it whole, or a member comes short or fails its check
    (``read_run`` then reads them: from the cache, and fetched again while damaged)."""
    entry = reader.manifest.shards[shard]
    file = session.whole(reader.shard(entry))
    if file is None:
        return None
    try:
        check = reader.verify and not file.checked
        out, read = [], 0
        for j in positions:
            sample: Sample = {"__key__": index.keys[j], "__shard__": entry.name}
            for field, offset, size, crc in index.members(j):
                data = file.read(offset, size)
                if data is None or (check and crc32(data) != crc):
                    return None
                sample[field] = data
                read += size
            out.append(sample)
        session.metrics.add(cached_bytes=read)
        return out
    finally:
        file.close()


class _Opened(NamedTuple):
    view: ShardView | None
    shard_index: ShardIndex | None  # None: nothing to refetch a sample by (an unindexed tar, or nothing to read)
    shard: int
    next: int
    stop: int
    in_file: bool = False  # members read from the cached file one by one, not from the view's bytes


@dataclass(frozen=True)
class SpanRead:
    """Samples ``[first, stop)`` of shard number ``shard``, located with its index."""

    shard: int
    entry: ShardEntry
    first: int
    stop: int
    index: ShardIndex

    def open(self, fetched: Fetched[Any], reader: DatasetReader, wait: Callable[[int | None], object]) -> _Opened:
        buffer: bytes | memoryview = fetched.buffer
        if fetched.file is not None:  # the whole shard on the node's disk: no bytes at hand, offsets in the file
            read = self._read_small(fetched, reader)
            if read is None:
                whole = ShardView(fetched.buffer, self.index, name=self.entry.name, verify=reader.verify, stop=0)
                return _Opened(whole, self.index, self.shard, self.first, self.stop, in_file=True)
            buffer = read
        view = ShardView(
            buffer,
            self.index,
            name=self.entry.name,
            verify=reader.verify,
            base=fetched.start,
            first=self.first,
            stop=self.stop,
        )
        return _Opened(view, self.index, self.shard, self.first, self.stop)

    def _read_small(self, fetched: Fetched[Any], reader: DatasetReader) -> bytes | None:
        """The range's bytes read from its cached file with one ``pread``, where its samples are
        small (``SMALL_SAMPLES``: a system call a member would cost more than copying them out)
        and the reader takes copies, not views of the file; else None, as where the file ends
        first (cut short since it was opened: each member's own read then says which came short)."""
        assert fetched.file is not None
        if reader.views or fetched.end - fetched.start >= SMALL_SAMPLES * (self.stop - self.first):
            return None
        return fetched.file.read(fetched.start, fetched.end - fetched.start)


@dataclass(frozen=True)
class TarRead:
    """A whole unindexed WebDataset tar, indexed from its bytes once they are in."""

    name: str

    def open(self, fetched: Fetched[Any], reader: DatasetReader, wait: Callable[[int | None], object]) -> _Opened:
        try:
            wait(None)
        except InvalidRange:  # cut short after its first bytes came with the size listed
            size = reader.session().store.head(reader.location.bucket, reader.location.key(self.name))
            raise tar_changed(reader, self.name, size, fetched.end) from None
        except PreconditionFailed:  # written again, to the size listed, since the pass listed it
            raise TruncatedShard(f"{reader.location}/{self.name} was written again while this pass read it: its"
                                 " version tag changed (the next pass lists the tars again)", name=self.name) from None
        index, _ = scan_tar(lambda start, end: memoryview(fetched.buffer)[start:end], self.name, len(fetched.buffer))
        return _Opened(ShardView(fetched.buffer, index, name=self.name, verify=False), None, -1, 0, len(index))


@dataclass(frozen=True)
class Skipped:
    """A range whose shard could not be read, skipped under ``on_error="skip"``: it reads as
    ``samples`` skipped samples (counted and logged when it was located)."""

    name: str
    samples: int
    reason: str

    def open(self, fetched: Fetched[Any], reader: DatasetReader, wait: Callable[[int | None], object]) -> _Opened:
        return _Opened(None, None, -1, 0, self.samples)


RangePlan = SpanRead | TarRead | Skipped
"""What a fetched range holds and how to read it: each kind opens itself."""


def skip(what: str, samples: int, error: BaseException, session: ReadSession) -> None:
    """Count and log samples skipped under ``on_error="skip"``."""
    session.metrics.add(skipped=samples)
    log.warning("skipped %s (%d sample%s): %s", what, samples, "" if samples == 1 else "s", error)


def tar_job(reader: DatasetReader, session: ReadSession, name: str, listed: int, etag: str,
            on_error: OnError) -> Job[TarRead | Skipped]:
    """The fetch of unindexed tar ``name``, which the pass listed as ``listed`` bytes of version
    ``etag``: its first bytes come with the object's size (``locate_tar``), and are the range's
    first part; the rest is fetched from that version only (``Pinned``): a tar written again
    while it is read, even to the same size, fails to open rather than mixing two versions."""
    first = listed if listed < 2 * TAR_HEAD else TAR_HEAD
    head: Future[bytes | bytearray] | None = Future() if first else None
    locate = partial(locate_tar, reader, session, name, listed, first, head, on_error)
    key = reader.location.key(name)
    return Job(Pinned(key, etag) if etag else key, locate, None if head is None else (0, first, head))


def locate_tar(reader: DatasetReader, session: ReadSession, name: str, listed: int, first: int,
               head: Future[bytes | bytearray] | None, on_error: OnError) -> tuple[int, int, TarRead | Skipped]:
    """The whole of unindexed tar ``name``, the ``listed`` bytes the pass listed: its ``first``
    bytes fetched with the object's size, given to ``head`` (which the fetcher takes as the
    range's first part). A tar of another size was rewritten or cut since the listing: read
    as listed, its samples would end short, silently where the cut fell between members, so
    it raises ``TruncatedShard``. With ``on_error="skip"``, a tar not its listed size, or
    gone, is skipped (counted, logged): an empty range stands for it."""
    try:
        session.metrics.add(gets=1)
        data, size = session.store.get_first_bytes(reader.location.bucket, reader.location.key(name), first)
        session.metrics.add(bytes=len(data))
        if size != listed:
            raise tar_changed(reader, name, size, listed)
    except DAMAGE as error:
        if not on_error.skips:
            raise
        skip_tar(name, error, session)
        return 0, 0, Skipped(name, 0, str(error))
    if head is not None:
        head.set_result(data)
    return 0, listed, TarRead(name)


def tar_changed(reader: DatasetReader, name: str, size: int, listed: int) -> TruncatedShard:
    """The error for unindexed tar ``name``, found ``size`` bytes though the pass listed ``listed``."""
    return TruncatedShard(f"{reader.location}/{name} is {size:,d} bytes; this pass listed it at {listed:,d}: it was"
                          " rewritten or truncated since (the next pass lists the tars again)", name=name)


def skip_tar(name: str, error: BaseException, session: ReadSession) -> None:
    """Count and log an unindexed tar skipped whole under ``on_error="skip"``: as one in
    ``metrics.skipped``, its samples never having been counted."""
    session.metrics.add(skipped=1)
    log.warning("skipped unindexed tar %s (its samples unknown: counted as 1 skipped): %s", name, error)


class OpenRange:
    """A range being read while its parts arrive, opened as its plan says (``SpanRead``, ``TarRead``, ``Skipped``).

    ``next_sample()`` gives the range's samples in order, fetching damaged ones again;
    with ``on_error="skip"`` it returns None for one it skipped (all the rest of the range
    if the shard is gone, and every sample of a ``Skipped`` range). Where each member lies
    is read from the index once, when the range opens, as plain lists: a sample costs a few
    slices of the one buffer, its checksums and a copy of its bytes; from a shard the node's
    cache holds whole, one read of the file a member, straight into its bytes (one read a range
    where its samples are small, ``SMALL_SAMPLES``), and no checksum
    where the file was checked whole and is unchanged since (``read/cached_shard.py``); with
    ``views``, a slice of the file's mapping a member, no copy.
    """

    def __init__(
        self, reader: DatasetReader, fetched: Fetched[Any], plan: RangePlan, session: ReadSession, on_error: OnError
    ) -> None:
        self.reader, self.fetched, self.session, self.on_error = reader, fetched, session, on_error
        self.view, self.index, self.shard, self.next, self.stop, in_file = plan.open(fetched, reader, self._wait)
        self._first = self.next
        self._arrived = fetched.start
        self._file = fetched.file if in_file else None
        self._trusted = fetched.file is not None and fetched.file.checked  # read from a file checked whole
        self._columns: list[tuple[str, list[int], list[int], list[int]]] = []
        self._mapped: memoryview | None = None
        self._again: tuple[int, list[Sample]] | None = None  # samples from a position on, read once more
        if self.view is not None:
            self._read_columns(self.view)

    def _read_columns(self, view: ShardView) -> None:
        index, first, stop, base = view.index, self.next, self.stop, view.base
        self._name = view.name
        self._keys = list(index.keys[first:stop])
        offsets, sizes = index.offsets[first:stop], index.sizes[first:stop]
        self._ends = (offsets + sizes).max(axis=1, initial=0).astype(np.int64).tolist() if stop > first else []
        for j, field in enumerate(index.fields):
            column = offsets[:, j]
            if not column.any():
                continue
            relative = np.where(column == 0, -1, column.astype(np.int64) - base)  # -1: the sample lacks the field
            self._columns.append((field, relative.tolist(), sizes[:, j].astype(np.int64).tolist(),
                                  index.crcs[first:stop, j].tolist()))
        self._buffer: memoryview | None = view.buffer
        self._check = view.verify and not self._trusted
        # Views of a cached file trusted as it is: each member a slice of its mapping, as the
        # index says (the index was checked to lie inside the shard, the file to be its size).
        self._mapped = self._file.mapped() if self._file is not None and self.reader.views and not self._check \
            else None

    @property
    def done(self) -> bool:
        return self.next >= self.stop

    def _wait(self, upto: int | None) -> int:
        waited = time.perf_counter()
        arrived = self.fetched.wait(upto)
        self.session.metrics.add(wait_seconds=time.perf_counter() - waited)
        return arrived

    def next_sample(self) -> Sample | None:
        j = self.next - self._first
        self.next += 1
        if self._again is not None:
            return self._again[1][self.next - 1 - self._again[0]]
        mapped = self._mapped
        if mapped is not None:  # the one path that runs per sample with views from the cache: kept short
            sample: Sample = {"__key__": self._keys[j], "__shard__": self._name}
            for field, offsets, sizes, _ in self._columns:
                offset = offsets[j]
                if offset >= 0:
                    sample[field] = mapped[offset : offset + sizes[j]]
            return sample
        if self.view is None:
            return None  # a range skipped whole
        try:
            end = self._ends[j]
            if end > self._arrived:
                self._arrived = self._wait(end)
            buffer, check, file, views = self._buffer, self._check, self._file, self.reader.views
            assert buffer is not None
            sample = {"__key__": self._keys[j], "__shard__": self.view.name}
            for field, offsets, sizes, crcs in self._columns:
                offset = offsets[j]
                if offset < 0:
                    continue
                if file is None:
                    data = buffer[offset : offset + sizes[j]]
                    if check and crc32(data) != crcs[j]:
                        return self._damaged(j + self._first)
                    sample[field] = memoryview(bytes(data)) if views else bytes(data)
                    continue
                read = file.view(offset, sizes[j]) if views else file.read(offset, sizes[j])
                if read is None or (check and crc32(read) != crcs[j]):  # cut short, or changed, since it was opened
                    return self._damaged(j + self._first)
                sample[field] = read
            return sample
        except (ObjectNotFound, InvalidRange) as error:  # the shard went away under us, or shrank
            self.reader.check_unchanged(error)
            damage: Exception = error
            if isinstance(error, InvalidRange) and self.index is not None:
                entry = self.reader.manifest.shards[self.shard]
                damage = self.reader.refused(entry.name, self.fetched.start, self.fetched.end, entry.size, self.session)
                if type(damage) is InvalidRange:  # answered short, though the shard is the manifest's size
                    return self._read_again(j)
            if not self.on_error.skips:
                raise damage from None
            skip(f"the rest of shard {self.view.name}", self.stop - self.next + 1, damage, self.session)
            self.view = None
            return None

    def _read_again(self, j: int) -> Sample | None:
        """The range's samples from its ``j``-th on, which the store answered short though the
        shard is the size the manifest says: the range read once more, with the same GET, and
        given from there (a second such answer raises, or skips the rest under ``skip``)."""
        assert self.index is not None and self.view is not None
        first = self._first + j
        try:
            positions = list(range(self._first, self.stop))
            again = read_run(self.reader, self.shard, self.index, positions, self.session, once=True)[j:]
        except (InvalidRange, *DAMAGE) as error:
            if not self.on_error.skips:
                raise
            skip(f"the rest of shard {self.view.name}", self.stop - first, error, self.session)
            self.view = None
            return None
        self.session.metrics.add(retries=1)
        self._again = (first, [as_views(sample) for sample in again] if self.reader.views else again)
        return self._again[1][0]

    def _damaged(self, i: int) -> Sample | None:
        """Sample ``i`` of the shard, whose bytes here failed their checksum, fetched again."""
        assert self.index is not None and self.view is not None  # unindexed tars are not verified
        try:
            sample = read_run(self.reader, self.shard, self.index, [i], self.session)[0]
        except DAMAGE as error:
            if not self.on_error.skips:
                raise
            skip(f"sample {self.view.index.keys[i]!r} of {self.view.name}", 1, error, self.session)
            return None
        return as_views(sample) if self.reader.views else sample

    def close(self) -> None:
        self.view = None  # no view of the buffer may outlive it
        self._buffer = self._file = self._mapped = None
        self.fetched.done_with()


def locate_span(cache: IndexCache, shard: int, first: int, stop: int, on_error: OnError) -> tuple[int, int, RangePlan]:
    """The byte range of samples ``[first, stop)`` of a shard, from its cached index; with
    ``on_error="skip"``, an empty range standing for a shard whose index cannot be read."""
    entry = cache.reader.manifest.shards[shard]
    try:
        index = cache.get(shard)
    except DAMAGE as error:
        if not on_error.skips:
            raise
        skip(f"shard {entry.name}", stop - first, error, cache.session)
        return 0, 0, Skipped(entry.name, stop - first, str(error))
    return index.start(first, stop), index.extent(first, stop), SpanRead(shard, entry, first, stop, index)
