"""Which upload of a dataset each pass reads, in whatever process it runs.

A pass that finds its dataset overwritten (or removed) raises ``DatasetChanged``, and the
passes after it read the new upload. A few numbers in shared memory, made with the pipeline,
carry what one process saw (a DataLoader worker, usually) to the pipeline's copies in the
others, persistent workers included: the upload found, and when it was seen, counted in
passes: the epoch the pipeline's clock would deal next (``EpochClock.epoch``), and the
``set_epoch`` calls made by then.

A pass began after the change was seen where its epoch was dealt since (epochs taken by
themselves: the clock deals each pass the next one), where ``set_epoch`` was called since
(epochs set), or where it is an iteration without DataLoader workers (which is the whole
pass). Such a pass reads the new upload; one that began before reads none of it, and raises
as well: the workers of one pass read one upload, or the pass raises.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class _Slot(IntEnum):
    SEEN = 0  # 1 once a change was seen
    UPLOAD = 1  # the identity of the upload found in place of the one read (-1: none, removed)
    EPOCH = 2  # the epoch the clock would deal next when it was seen
    SETS = 3  # the set_epoch calls made by then
    SET = 4  # the set_epoch calls made


class Uploads:
    """What a pipeline's processes saw of its dataset's uploads (see the module's docstring)."""

    def __init__(self) -> None:
        self.shared = torch.zeros(len(_Slot), dtype=torch.int64).share_memory_()

    @property
    def upload(self) -> int | None:
        """The identity of the upload passes read from now on (-1: the dataset was removed);
        None while no change was seen."""
        return int(self.shared[_Slot.UPLOAD]) if int(self.shared[_Slot.SEEN]) else None

    def seen(self, upload: int, next_epoch: int) -> None:
        """A process found ``upload`` (-1: none) in place of the upload it read, while the
        clock would deal ``next_epoch`` next. The same upload seen again changes nothing: the
        passes that began since its first sighting read it."""
        shared = self.shared
        if self.upload == upload:
            return
        shared[_Slot.UPLOAD], shared[_Slot.EPOCH], shared[_Slot.SETS] = upload, next_epoch, shared[_Slot.SET]
        shared[_Slot.SEEN] = 1  # last: a reader of SEEN finds the rest written

    def epoch_set(self) -> None:
        """``set_epoch`` was called (in the main process, between passes)."""
        self.shared[_Slot.SET] += 1

    def began_after(self, epoch: int, auto: bool) -> bool:
        """Whether a DataLoader worker's pass of ``epoch`` began after the change was seen:
        ``auto`` where each pass takes the next epoch by itself, else by ``set_epoch``."""
        if auto:
            return epoch >= int(self.shared[_Slot.EPOCH])
        return int(self.shared[_Slot.SET]) > int(self.shared[_Slot.SETS])
