"""Folders of the node's cache, and the locks in them, reached without following a link: each is held open as a
descriptor, and what lies in it is named relative to that descriptor with ``O_NOFOLLOW``, so a
link planted by anyone who can write there is refused, never followed; files are created with
``O_EXCL`` and replaced by a rename, never written through a name that was already there.
Removing a name (a link included) never touches what it pointed at (DESIGN.md, "Shared
directories")."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Protocol

from remote_loader.storage.locking import try_lock

# Windows has none of these, nor directory descriptors: CacheConfig refuses a cache there.
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC
_FOLLOWED = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_DIRECTORY = _FOLLOWED | _NOFOLLOW
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class Cancel(Protocol):
    """What ends a wait for a lock early (a ``threading.Event``, or what stands for one)."""

    def is_set(self) -> bool: ...


_STEP = 0.01  # seconds between tries of a lock another process holds


class Refused(OSError):
    """A directory the cache will not use, and why (one line)."""


class Folder:
    """A directory open as a descriptor (closed when the object goes): its entries are
    reached relative to it, never through a link."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        # Not at the interpreter's exit: fills on daemon threads may still use it then, and the
        # process's end closes it (closed before, their calls met EBADF or another file).
        weakref.finalize(self, os.close, fd).atexit = False

    def __repr__(self) -> str:
        return f"Folder({self.path!r})"

    @classmethod
    def named(cls, path: str) -> Folder:
        """The directory a user named (made where missing; links in its own path followed, as
        the user gave it), refused where any user could change what lies in it: owned by
        another user than this one or root, or writable by every user, without the sticky bit
        (``/tmp``'s, which lets none of them remove or rename what is not theirs). Its group
        may write it (a user's own group, under umask 002): the cache's folder in it is this
        user's alone, and every folder below it is checked as it is opened."""
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, _FOLLOWED)
        folder = cls(fd, path)
        found = os.fstat(fd)
        if not found.st_mode & stat.S_ISVTX:
            _check_owned(found, path, (os.geteuid(), 0), stat.S_IWOTH)
        return folder

    def sub(self, name: str, *, create: bool = True) -> Folder:
        """Folder ``name`` in this one (made where missing, readable by this user alone); a
        link, a file, or a folder another user owns or can write there is refused."""
        path = os.path.join(self.path, name)
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=self.fd)
        try:
            fd = os.open(name, _DIRECTORY, dir_fd=self.fd)
        except OSError as error:
            if _is_link(self, name):
                raise Refused(f"{path} is a link, which the cache never follows") from None
            if not isinstance(error, FileNotFoundError) and error.errno == errno.ENOTDIR:
                raise Refused(f"{path} is not a directory") from None
            raise
        folder = Folder(fd, path)
        _check_owned(os.fstat(fd), path, (os.geteuid(),), _OTHERS_WRITE)
        return folder

    def moved(self) -> bool:
        """Whether this folder is no longer the one at its path: removed (``rm -rf``, a cleaner
        of ``/tmp``), perhaps with another made there since."""
        try:
            there = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        here = os.fstat(self.fd)
        return (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino)

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of entry ``name``, never through a link (ELOOP where it is one)."""
        try:
            return os.open(name, flags | _NOFOLLOW, mode, dir_fd=self.fd)
        except OSError as error:
            error.filename = os.path.join(self.path, name)  # where, for a message
            raise

    def lstat(self, name: str) -> os.stat_result | None:
        """What ``name`` is (a link as a link), or None where nothing has that name."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def entries(self) -> list[tuple[str, os.stat_result]]:
        """Each entry's name and what it is (links as links); those gone meanwhile left out."""
        found = []
        with os.scandir(self.fd) as scan:
            for entry in scan:
                with contextlib.suppress(FileNotFoundError):
                    found.append((entry.name, entry.stat(follow_symlinks=False)))
        return found

    def files(self) -> list[tuple[str, os.stat_result]]:
        """The regular files in it (no link, no folder)."""
        return [(name, st) for name, st in self.entries() if stat.S_ISREG(st.st_mode)]

    def unlink(self, name: str) -> bool:
        """Remove the name ``name`` (a link is removed, not what it points at); False where it was gone."""
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except FileNotFoundError:
            return False

    def rename(self, name: str, to: Folder, new: str) -> None:
        """Move entry ``name`` to ``new`` in folder ``to``, replacing a file or link there."""
        os.rename(name, new, src_dir_fd=self.fd, dst_dir_fd=to.fd)

    def create(self, name: str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
        """A new file ``name``: whatever had the name is removed first (a link: not what it
        points at), and the file is made anew (``O_EXCL``), never opened through another name."""
        self.unlink(name)
        return self.open(name, flags | os.O_CREAT | os.O_EXCL, mode)

    def write(self, name: str, data: bytes) -> None:
        """Put file ``name`` holding ``data`` in place whole (a new file, renamed over the name);
        where it fails (a full disk), the new file is removed and the error raised."""
        apart = f".{name}.{uuid.uuid4().hex[:12]}"
        fd = self.open(apart, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                view = memoryview(data)
                while view:  # a write may take part of it
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            self.rename(apart, self, name)
        except BaseException:
            self.unlink(apart)
            raise

    def read(self, name: str, most: int) -> bytes | None:
        """The first ``most`` bytes of regular file ``name``; None where it is not one."""
        try:
            fd = self.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a fifo planted there does not block
        except OSError:
            return None
        try:
            return os.read(fd, most) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        finally:
            os.close(fd)



    def lock(self, name: str, deadline: float, cancel: Cancel) -> int | None:
        """Lock file ``name`` (``flock``; made where missing), waiting until ``deadline`` at
        most for the process that holds it: its descriptor, or None. A lock file removed
        meanwhile (``held`` being false, its remover took it) is taken anew, so that two
        processes never hold one lock through two files."""
        while True:
            fd = self.open(name, os.O_RDWR | os.O_CREAT)
            try:
                if not _lock_until(fd, deadline, cancel):
                    os.close(fd)
                    return None
                now = self.lstat(name)
                if now is not None and now.st_ino == os.fstat(fd).st_ino:
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @contextlib.contextmanager
    def locked(self, name: str, deadline: float) -> Iterator[int | None]:
        """Lock file ``name`` held for a while: its descriptor, open for reading and writing,
        or None where it was not had by ``deadline`` (a process stopped while it holds it must
        not stop the others)."""
        fd = self.lock(name, deadline, threading.Event())
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def held(self, name: str) -> bool:
        """Whether a process holds lock file ``name``."""
        try:
            fd = self.open(name, os.O_RDWR)
        except OSError:
            return False
        try:
            return not try_lock(fd)
        finally:
            os.close(fd)

    def remove_unheld(self, name: str) -> None:
        """Remove lock file ``name`` unless a process holds it (removed while this one holds
        it: a process that took the file meanwhile sees it gone, in ``lock``)."""
        try:
            fd = self.open(name, os.O_RDWR)
        except OSError:
            return
        try:
            if try_lock(fd):
                self.unlink(name)
        finally:
            os.close(fd)


def _lock_until(fd: int, deadline: float, cancel: Cancel) -> bool:
    """Take the file's lock, waiting until ``deadline`` at most for the process that holds it."""
    while not try_lock(fd):
        if time.monotonic() > deadline or cancel.is_set():
            return False
        time.sleep(_STEP)
    return True


def _is_link(folder: Folder, name: str) -> bool:
    found = folder.lstat(name)
    return found is not None and stat.S_ISLNK(found.st_mode)


def _check_owned(found: os.stat_result, path: str, owners: tuple[int, ...], writers: int) -> None:
    """Refuse a directory not owned by one of ``owners``, or that the mode bits ``writers``
    (group, others) let others write: another user could change its entries."""
    if not stat.S_ISDIR(found.st_mode):
        raise Refused(f"{path} is not a directory")
    if found.st_uid not in owners:
        raise Refused(f"{path} belongs to another user (uid {found.st_uid})")
    if found.st_mode & writers & stat.S_IWOTH:
        raise Refused(f"{path} can be written by every user and has no sticky bit")
    if found.st_mode & writers:
        raise Refused(f"{path} can be written by its group (the cache makes its folders writable by you alone)")
