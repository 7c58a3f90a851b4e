"""The StatefulDataLoader ``loader(ds, stateful=True)`` makes. This module imports torchdata
(an optional extra): ``loader()`` imports it only where it is asked for."""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from remote_loader.pipeline.run.dataloader import made_here, start_iteration


class StatefulLoader(StatefulDataLoader):
    """torchdata's StatefulDataLoader, whose workers start without this process's garbage
    (``dataloader.start_iteration``), and which says where its samples are decoded."""

    decoded_on = "CPU"
    """Where JPEGs are decoded: by the DataLoader workers, on the CPU."""

    def __iter__(self) -> Any:
        return start_iteration(self, super().__iter__)

    def _get_iterator(self) -> Any:
        return made_here(self, super()._get_iterator)
