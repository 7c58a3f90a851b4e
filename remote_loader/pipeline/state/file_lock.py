"""A lock among a process and the DataLoader workers it starts, whichever way they start."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

from remote_loader.storage.locking import exclusive


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child that exits normally
        with contextlib.suppress(OSError):
            os.unlink(path)


class FileLock:
    """A lock among a process and the DataLoader workers it starts, forked or spawned: an
    exclusive lock (``flock``; ``msvcrt.locking`` on Windows) on a file named when the lock is
    made (created on first use, removed with the lock in the process that made it). A
    multiprocessing lock is tied to one start method, and the loader's is not known when a
    dataset is made."""

    def __init__(self, prefix: str) -> None:
        self.path = os.path.join(tempfile.gettempdir(), f"{prefix}-{uuid.uuid4().hex}")
        weakref.finalize(self, _remove, self.path, os.getpid())

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}  # a copy uses the file, never removes it

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with open(self.path, "a") as file, exclusive(file.fileno()):
            yield
