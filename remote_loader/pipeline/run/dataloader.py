"""The DataLoader ``loader()`` makes for a pipeline whose workers decode, and what it does
before it forks them (``pipeline/run/stateful.py`` holds its torchdata twin)."""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

from torch.utils.data import DataLoader


def collect_before_fork(dataloader: DataLoader) -> None:
    """Collect this process's garbage where ``dataloader`` is about to fork its workers.

    A DataLoader iterator that an error's traceback holds in a reference cycle (PyTorch
    raises a worker's error again from a frame that references it) lives until the garbage
    collector runs. A worker forked before then inherits it, and where the worker's
    collector frees it, its ``__del__`` asks after processes that are not that worker's
    children and prints ``AssertionError: can only test a child process``. Collected here
    first, it is freed in the process that made it, which ends its workers."""
    if not dataloader.num_workers:
        return
    if dataloader.persistent_workers and getattr(dataloader, "_iterator", None) is not None:
        return  # its workers are started already
    context = dataloader.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
    if method == "fork":
        gc.collect()


class Loader(DataLoader):
    """The DataLoader ``loader()`` makes: torch's, whose workers start without this process's
    garbage (``collect_before_fork``), and which says where its samples are decoded."""

    decoded_on = "CPU"
    """Where JPEGs are decoded: by the DataLoader workers, on the CPU (a pipeline that decodes
    on a device comes in a ``DeviceLoader``, which says which decoder)."""

    def __iter__(self) -> Any:
        collect_before_fork(self)
        return super().__iter__()
