"""Plain WebDataset tars without a manifest (``unindexed=True``): whole tars dealt to ranks
and workers in the epoch's order, read ``open_shards`` at once, then the shuffle buffer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from remote_loader.errors import ConfigError, DatasetNotFound, OnError
from remote_loader.format import Sample
from remote_loader.format.epoch_order import shard_order
from remote_loader.pipeline.order.delivery import Mixing, Shuffler, worker_seeds
from remote_loader.pipeline.state.resume import Entry, Layout
from remote_loader.read.fetch import Fetched, Prefetcher
from remote_loader.read.reader import DatasetReader
from remote_loader.read.session import ReadSession
from remote_loader.read.shards import DAMAGE, OpenRange, Skipped, TarRead, skip_tar, tar_job
from remote_loader.storage.base import ObjectInfo

_LOCATE_AHEAD = 16
"""Tars located at once: each is a GET of its first bytes and size, a round trip, so as
many as a store's first GETs in flight (the fetcher's own default, 4, held 160 small tars
to 4 round trips at a time)."""


class Unindexed:
    """The ``.tar`` objects under a prefix without a manifest: no ``len()``, no states. With
    ``on_error="skip"``, a tar that cannot be read is skipped whole (counted, logged)."""

    resumable = False
    classes: list[str] = []

    def __init__(self, reader: DatasetReader, on_error: OnError) -> None:
        if reader.has_manifest():
            raise ConfigError(f"{reader.location} has a manifest: unindexed=True is for tars without one")
        self.reader, self.on_error = reader, on_error

    def samples(self) -> int:
        raise TypeError("len() of unindexed tars is unknown: their sample counts are read as they stream")

    def prepare(self, seed: int, epoch: int, shuffle: bool) -> None:
        pass

    def source(self, layout: Layout, epoch: int, worker: int, num_workers: int, entry: Entry | None,
               session: ReadSession) -> TarSource:
        tars = self.reader.listed_tars(warn=layout.rank == 0 and worker == 0)  # one process says what it left out
        if not tars:
            raise DatasetNotFound(f"no .tar objects under {self.reader.location} to stream unindexed",
                                  bucket=self.reader.location.bucket, key=self.reader.location.key(""))
        slots, slot = layout.world_size * num_workers, layout.rank * num_workers + worker
        order = shard_order(len(tars), layout.seed, epoch, layout.shuffle)
        mine = [tars[k] for position, k in enumerate(order) if position % slots == slot]
        seeds = worker_seeds(layout.seed, epoch, layout.rank, worker)
        return TarSource(self.reader, session, mine, layout.mixing, seeds, self.on_error)


class TarSource:
    """The samples of whole unindexed tars as listed (``ObjectInfo``: name, size, version):
    ``open_shards`` read at once (each next sample from one of them, by the seed), then the
    shuffle buffer if any. It keeps no positions, so its iterations have no state. A tar that
    cannot be read raises, or with ``on_error="skip"`` is skipped whole: none of its samples is
    given (a tar is read whole before its first sample is)."""

    def __init__(self, reader: DatasetReader, session: ReadSession, tars: Sequence[ObjectInfo],
                 mixing: Mixing, seeds: tuple[Sequence[int], Sequence[int]], on_error: OnError) -> None:
        self.reader, self.session, self.tars, self.mixing, self.seeds = reader, session, tars, mixing, seeds
        self.on_error = on_error
        self.emitted = 0

    @property
    def outputs(self) -> int:
        return self.emitted

    def output_of(self, emitted: int) -> int:
        return emitted

    def trim(self, delivered: int) -> None:
        pass

    def undelivered(self, delivered: int) -> list[tuple[int, int]]:
        return []

    def describe(self, emitted: int) -> str | None:
        return None

    def __iter__(self) -> Iterator[Sample]:
        # Made as the fetcher takes them: each holds its tar's first bytes once they are in.
        jobs = (tar_job(self.reader, self.session, tar.key, tar.size, tar.etag, self.on_error) for tar in self.tars)
        with Prefetcher(self.reader.location.bucket, jobs, self.session, self.reader.round_trip,
                        locate_ahead=_LOCATE_AHEAD) as prefetcher:
            fetched = iter(prefetcher)
            try:
                samples = self._mixed(fetched)
                if self.mixing.bufsize:
                    samples = Shuffler(self.mixing.bufsize, self.mixing.initial, self.seeds[1]).run(samples)
                for sample in samples:
                    self.emitted += 1
                    yield sample
            finally:
                fetched.close()

    def _mixed(self, fetched: Iterator[Fetched[TarRead | Skipped]]) -> Iterator[Sample]:
        rng = np.random.default_rng(list(self.seeds[0]))
        reading: list[OpenRange] = []
        exhausted = False
        try:
            while True:
                # Tars read to their end make room first: ``open_shards`` are read at once until
                # the last is fetched (one read whole, with none left open, is not the end).
                for done in [r for r in reading if r.done]:
                    reading.remove(done)
                    done.close()
                while not exhausted and len(reading) < self.mixing.open_shards:
                    item = next(fetched, None)
                    if item is None:
                        exhausted = True
                    else:
                        opened = self._open(item)
                        if opened is not None:
                            reading.append(opened)
                if not reading:
                    return
                current = reading[int(rng.integers(len(reading)))] if len(reading) > 1 else reading[0]
                sample = current.next_sample()
                if sample is not None:
                    yield sample
        finally:
            for r in reading:
                r.close()

    def _open(self, item: Fetched[TarRead | Skipped]) -> OpenRange | None:
        """The fetched tar opened (its members found); None for a tar that cannot be read,
        skipped under ``on_error="skip"`` (counted and logged, here or when it was located)."""
        try:
            opened = OpenRange(self.reader, item, item.context, self.session, self.on_error)
        except DAMAGE as error:
            item.done_with()
            if not self.on_error.skips:
                raise
            skip_tar(item.context.name, error, self.session)
            return None
        if opened.done:  # skipped when located
            opened.close()
            return None
        return opened
