"""Members read with ``views=True`` (read-only memoryviews) where they leave a pipeline: as
bytes across to the main process, and as bytes where torch's default conversion would take
a view for a sequence of ints.

torch's ``default_convert`` and ``default_collate`` (what a ``DataLoader`` applies when given
no ``collate_fn``) treat a ``memoryview`` as a sequence: a view of a JPEG would become a list
of its bytes as ints. A view cannot be pickled either, so it cannot leave a DataLoader worker
as it is (and crossing copies it anyway).
"""

from __future__ import annotations

import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

from torch.utils.data import default_collate, default_convert

from remote_loader.pipeline.stages.containers import WALK_ON, holds, rebuild

_DEFAULTS = (default_convert, default_collate)
_registered = False  # pickle_views_as_bytes, in this process (a forked child inherits both)
_CALLERS = 4  # frames looked at above a dataset's __iter__ (a subclass's own __iter__ may come between)


def default_conversion(frame: types.FrameType | None) -> bool:
    """Whether the caller of a dataset's ``__iter__`` (``frame``, or one of the few frames
    above it: a subclass's generator runs it at the first ``next()``) is the fetcher of a
    torch ``DataLoader`` (or of torchdata's ``StatefulDataLoader``) in this process that
    passes each item to torch's default conversion or collation: a fetcher whose
    ``collate_fn`` is one of them. A ``collate_fn`` of the user's own takes what it is given."""
    for _ in range(_CALLERS):
        if frame is None:
            return False
        fetcher = frame.f_locals.get("self")
        if type(fetcher).__name__ == "_IterableDatasetFetcher":
            return any(getattr(fetcher, "collate_fn", None) is fn for fn in _DEFAULTS)
        frame = frame.f_back
    return False


def owned(item: Any) -> Any:
    """``item`` with every memoryview inside its tuples, lists and dicts (the containers
    torch's default conversion walks) as bytes, each container of its own type (a named
    tuple, an ``OrderedDict``); an item without one is given as it is."""
    return rebuild(item, _bytes_of_view) if holds(item, memoryview) else item


def _bytes_of_view(_: Any, node: Any) -> Any:
    return node.tobytes() if isinstance(node, memoryview) else WALK_ON


def _view_as_bytes(view: memoryview) -> tuple[type[bytes], tuple[bytes]]:
    return bytes, (view.tobytes(),)


def pickle_views_as_bytes() -> None:
    """Have this process's multiprocessing pickler (a DataLoader worker's queue to the main
    process) send each memoryview as bytes, wherever it lies in what is sent (in a dataclass
    too), rather than fail in the queue's feeder thread (which leaves the DataLoader waiting
    for an item that never comes). Done once a process; nothing else pickles views there."""
    global _registered
    if not _registered:
        ForkingPickler.register(memoryview, _view_as_bytes)
        _registered = True
