"""What a ``RemoteDataset`` does when its prefix is uploaded again while it is read: the pass
that finds the new upload raises ``DatasetChanged``, and the passes after it, in every
process of the pipeline, read the new upload (what each process saw: ``state/uploads.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from torch.utils.data import get_worker_info

from remote_loader.errors import DatasetChanged, OnError
from remote_loader.pipeline.sources.indexed import Indexed
from remote_loader.pipeline.state.epochs import EpochClock
from remote_loader.pipeline.state.resume import Handover
from remote_loader.pipeline.state.stream import Data
from remote_loader.pipeline.state.uploads import Uploads
from remote_loader.read import DatasetReader
from remote_loader.storage.daemon import in_daemon_thread, wait_result

NEXT_PASS = "the next pass reads the new upload (iterate again; where you call set_epoch, call it first)"
"""What a ``DatasetChanged`` advises, by default."""
_CHECKPOINT = ("a checkpoint of the old upload cannot resume the new one: to read it, make a new RemoteDataset and"
               " load no state taken before the change")


class FollowsUploads:
    """The part of ``RemoteDataset`` that follows an overwrite of its dataset: it tells one at
    a pass's start, raises ``DatasetChanged`` once, and reopens the new upload for the passes
    after it. A base class, so that the dataset's attributes (what it pickles) stay its own."""

    reader: DatasetReader
    unindexed: bool
    on_error: OnError
    seed: int
    shuffle_shards: bool
    _data: Data
    _epochs: EpochClock
    _uploads: Uploads
    _handover: Handover
    _check: Future[None] | None  # the latest pass's manifest check, until that pass takes its answer
    _loaded_state: Any

    def _check_current(self, followed: bool) -> Future[None] | None:
        """With shards from the node's cache, nothing else would tell an overwrite: the manifest
        read again, beside the pass's start (a round trip to the store), or before it where it
        would take a loaded state, which a pass that raises must leave for the next. A check
        whose pass ended before its answer came is taken first (DatasetChanged raised now)."""
        previous, self._check = self._check, None
        if followed or self.reader.cache is None or self.unindexed:
            return None
        if previous is not None:
            try:
                wait_result(previous)
            finally:
                del previous  # as in _taken
        if self._handover.loaded is not None:
            self.reader.check_current()
            return None
        self._check = in_daemon_thread(self.reader.check_current, "remote-loader-manifest")
        return self._check

    def _follow(self, epoch: int, in_worker: bool) -> bool:
        """Whether this pass reads an upload that replaced the one read, seen by any process
        of this pipeline: reopened now where the pass began after that was seen
        (``uploads.py``); DatasetChanged where it began before, so that it reads one upload."""
        upload = self._uploads.upload
        if upload is None or self.unindexed or self.reader.upload_read == upload:
            return False
        if in_worker and not self._uploads.began_after(epoch, self._epochs.auto):
            raise self.reader.changed(None if upload < 0 else upload,
                                      "while this pass was under way (another DataLoader worker or loader saw it)")
        self._reopen(upload)
        return True

    def _current(self) -> None:
        """In the process that makes and iterates the pipeline: the upload a change seen in
        any of its processes (a DataLoader worker's) put in place of the one read, for
        ``len()``, ``set_epoch`` and the next DataLoader's workers."""
        upload = self._uploads.upload
        if upload is None or self.unindexed or self.reader.upload_read == upload or get_worker_info() is not None:
            return
        if self._handover.owed() is None and self._handover.own_epoch() is None:  # else the next pass says why not
            self._reopen(upload)
            self._data.prepare(self.seed, self._epochs.epoch, self.shuffle_shards)

    def _reopen(self, upload: int) -> None:
        """Read the dataset's upload ``upload`` (-1: none) from now on: its manifest, its epoch
        orders; a loaded state of the old upload is refused, or dropped once its pass began."""
        if self._handover.owed() is not None or self._handover.own_epoch() is not None:
            raise self.reader.changed(None if upload < 0 else upload, "since the checkpoint loaded was taken",
                                      _CHECKPOINT)
        reader = self.reader.reopened()
        if reader.identity != upload:  # replaced again, or removed and uploaded again
            error = reader.changed(reader.identity, "once more")
            self.reader.replaced_by = reader.replaced_by  # the newest: what every sighting of this pass says
            self._saw(reader)
            try:
                raise error
            finally:
                del error  # the error's traceback holds this frame: it must not hold the error
        self.reader, self._data = reader, Indexed(reader, self.on_error)
        self._handover, self._loaded_state = Handover(), None

    def _saw(self, reader: DatasetReader) -> None:
        """Tell this pipeline's processes of the upload ``reader`` found in place of its own."""
        if reader.replaced_by is not None:
            self._uploads.seen(reader.replaced_by, self._epochs.epoch)

    def _watched(self, items: Iterator[Any], reader: DatasetReader, check: Future[None] | None) -> Iterator[Any]:
        """``items``, raising DatasetChanged where the read or ``check`` (the manifest read
        again as the pass began, under way) finds the dataset replaced: the check's answer is
        taken once it has come, and waited for before the pass ends."""
        try:
            if check is not None:
                for item in items:
                    if check.done():
                        self._taken(check)
                        yield item
                        break
                    yield item
                self._taken(check)
            yield from items
        except DatasetChanged:
            self._saw(reader)
            raise
        finally:
            del check  # as in _taken: the frames an error's traceback holds must not hold the check

    def _taken(self, check: Future[None]) -> None:
        """The answer of a pass's manifest check, taken by the pass (raised if it is DatasetChanged)."""
        if self._check is check:
            self._check = None
        try:
            wait_result(check)
        finally:
            del check  # the error raised holds this frame: it must not hold the future, which holds the error
