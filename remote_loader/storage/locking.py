"""An exclusive lock on an open file among processes: ``flock`` where the system has it (Linux,
macOS), and ``msvcrt.locking`` of the file's first byte on Windows, which has no ``fcntl``."""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import time
from collections.abc import Iterator
from types import ModuleType


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_FCNTL = _module("fcntl")
_MSVCRT = None if _FCNTL is not None else _module("msvcrt")
_STEP = 0.01  # seconds between tries of a lock another process holds, where there is no flock


def lock(fd: int) -> None:
    """Wait for the exclusive lock of the file open as ``fd``, however long another process holds it."""
    if _FCNTL is not None:
        _FCNTL.flock(fd, _FCNTL.LOCK_EX)
        return
    while not try_lock(fd):  # msvcrt's own wait (LK_LOCK) tries once a second, however briefly the lock is held
        time.sleep(_STEP)


def unlock(fd: int) -> None:
    """Release the lock ``lock`` took of the file open as ``fd``."""
    if _FCNTL is not None:
        _FCNTL.flock(fd, _FCNTL.LOCK_UN)
    elif _MSVCRT is not None:  # released at the file's close too, but not at once: explicitly, as msvcrt asks
        os.lseek(fd, 0, os.SEEK_SET)
        _MSVCRT.locking(fd, _MSVCRT.LK_UNLCK, 1)


@contextlib.contextmanager
def exclusive(fd: int) -> Iterator[None]:
    """The file open as ``fd`` locked (``lock``) while the block runs."""
    lock(fd)
    try:
        yield
    finally:
        unlock(fd)


def try_lock(fd: int) -> bool:
    """Take the exclusive lock of the file open as ``fd`` where no process holds it: whether it was taken."""
    try:
        if _FCNTL is not None:
            _FCNTL.flock(fd, _FCNTL.LOCK_EX | _FCNTL.LOCK_NB)
        elif _MSVCRT is not None:
            os.lseek(fd, 0, os.SEEK_SET)  # msvcrt locks bytes from the file's position
            _MSVCRT.locking(fd, _MSVCRT.LK_NBLCK, 1)
        else:
            raise OSError(errno.ENOSYS, "this system locks no files: it has neither fcntl nor msvcrt")
    except BlockingIOError:
        return False
    except OSError as error:
        if _FCNTL is None and error.errno == errno.EACCES:  # msvcrt's answer for a lock held
            return False
        raise
    return True
