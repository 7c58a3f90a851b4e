"""``loader``: the DataLoader a pipeline is fast in, sized from the cores this rank may use."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from remote_loader.config import rank_cores, require_bool, require_int
from remote_loader.errors import ConfigError


def loader(dataset: IterableDataset, *, num_workers: int | None = None, stateful: bool = False,
           **options: Any) -> Any:
    """A ``DataLoader`` over ``dataset`` set up to fill this rank's cores.

    One Python process runs its Python on one core at a time, so cores are filled by
    DataLoader worker processes: one per core this rank may use (``rank_cores()``: its CPU
    affinity, the container's CPU quota, and its share of the node under torchrun's
    ``LOCAL_WORLD_SIZE``). Items come as the pipeline makes them (``batch_size=None``:
    batch with ``.batched``), workers persist across epochs, and batches land in pinned
    memory when CUDA is available, so their copy to the GPU can overlap the step.

    Args:
        dataset: A ``RemoteDataset`` pipeline (any iterable dataset works).
        num_workers: Worker processes; default one per core of this rank.
        stateful: A torchdata ``StatefulDataLoader`` (its ``state_dict()`` gathers each
            worker's position: see docs/checkpointing.md); needs the ``torchdata`` extra.
        **options: Any other ``DataLoader`` argument, overriding these defaults
            (``pin_memory``, ``persistent_workers``, ``prefetch_factor``...).

    Examples:
        >>> for images, labels in loader(ds):
        ...     train_step(images.cuda(non_blocking=True), labels)
    """
    workers = rank_cores() if num_workers is None else require_int("num_workers", num_workers, 0)
    require_bool("stateful", stateful)
    settings: dict[str, Any] = {"batch_size": None, "num_workers": workers,
                                "pin_memory": torch.cuda.is_available()}
    if workers:
        settings.update(persistent_workers=True, prefetch_factor=2)
    settings.update(options)
    if not stateful:
        return DataLoader(dataset, **settings)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ConfigError("stateful=True needs torchdata's StatefulDataLoader: install the torchdata extra"
                          " (pip install '.[torchdata]' in remote_loader's checkout)") from None
    return StatefulDataLoader(dataset, **settings)
