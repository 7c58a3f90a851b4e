"""The DataLoader ``loader()`` makes for a pipeline whose workers decode, and what it does
before it forks them (``pipeline/run/stateful.py`` holds its torchdata twin)."""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import threading
from typing import Any

from torch.utils.data import DataLoader

from remote_loader.errors import ResumeError
from remote_loader.pipeline.state.resume.handover import LOADED_LATE


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


def start_iteration(dataloader: DataLoader, start: Any) -> Any:
    """``start()`` (the DataLoader's own ``__iter__``) after what a fork calls for: persistent
    workers that another process started are let go of, so that this one starts its own (the
    workers, their queues and threads are the parent's: torch's iterator would ask after
    processes that are not this one's children), and garbage is collected before workers
    are forked (``collect_before_fork``)."""
    inherited = getattr(dataloader, "_iterator", None)
    if inherited is not None and dataloader.__dict__.get("_made_in") != os.getpid():
        inherited._shutdown = True  # its end would stop the parent's workers, which serve the parent
        dataloader._iterator = None
    elif inherited is not None and dataloader.persistent_workers and dataloader.num_workers:
        _refuse_late_loads(dataloader)
    collect_before_fork(dataloader)
    return start()


def _refuse_late_loads(dataloader: DataLoader) -> None:
    """A ResumeError, in this process and in one line, where a state was loaded into the
    dataset after the loader's persistent workers started: they would not resume from it
    (each would refuse it in its own process, in PyTorch's many-line wrapper)."""
    loads = getattr(dataloader.dataset, "states_loaded", None)
    if isinstance(loads, int) and loads != dataloader.__dict__.get("_states_loaded", loads):
        raise ResumeError(LOADED_LATE)


def made_here(dataloader: DataLoader, make: Any) -> Any:
    """``make()`` (the DataLoader's own ``_get_iterator``), noting the process that made the
    iterator; where it starts workers, a process forked from this one later forgets them
    (``_forget_children_in_forks``)."""
    dataloader.__dict__["_made_in"] = os.getpid()
    dataloader.__dict__["_states_loaded"] = getattr(dataloader.dataset, "states_loaded", None)
    if dataloader.num_workers:
        _forget_children_in_forks()
        if not isinstance(dataloader.worker_init_fn, EndWithParent):
            dataloader.worker_init_fn = EndWithParent(dataloader.worker_init_fn)
    return make()


class EndWithParent:
    """A ``worker_init_fn`` that ends the worker as soon as the process that started it ends,
    then calls ``then`` (the DataLoader's own).

    torch's worker notes its parent's pid only after its ``worker_init_fn`` has run (its
    watchdog): a parent killed before then (by the OOM killer, or a decoding process ended
    while its spawned workers import torch) leaves a worker that takes pid 1 for its parent
    and waits for work for ever, holding its memory. A thread of the worker waits on
    multiprocessing's sentinel of the parent instead, from the worker's start."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        parent = multiprocessing.parent_process()
        if parent is not None and parent.sentinel is not None:
            threading.Thread(target=_end_with, args=(parent.sentinel,), name="remote-loader-parent",
                             daemon=True).start()
        if self.then is not None:
            self.then(worker_id)


def _end_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


_forgetting = False


def _forget_children_in_forks() -> None:
    """Once a process: a process it forks with ``os.fork`` forgets the child processes it
    inherits in multiprocessing's records (DataLoader workers among them), as one that
    multiprocessing forks does. Otherwise, at its exit, multiprocessing would terminate
    this process's workers, which are not its own, and its persistent loaders would fail."""
    global _forgetting
    if not _forgetting and hasattr(os, "register_at_fork"):  # Windows has no fork
        _forgetting = True
        os.register_at_fork(after_in_child=_forget_inherited_children)


def _forget_inherited_children() -> None:
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]


class Loader(DataLoader):
    """The DataLoader ``loader()`` makes: torch's, whose workers start without this process's
    garbage (``collect_before_fork``), and which says where its samples are decoded."""

    decoded_on = "CPU"
    """Where JPEGs are decoded: by the DataLoader workers, on the CPU (a pipeline that decodes
    on a device comes in a ``DeviceLoader``, which says which decoder)."""

    def __iter__(self) -> Any:
        return start_iteration(self, super().__iter__)

    def _get_iterator(self) -> Any:
        return made_here(self, super()._get_iterator)
