"""Child processes that end with the process that started them, even when it is killed outright:
the embedded server's, and the benchmark suite's servers."""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any


def die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the thread that started it ends.

    Linux ties PR_SET_PDEATHSIG to the starting *thread*, so start children through
    ``spawn_tied`` (one thread that lives as long as the process) to tie them to the process.
    A test run or demo that is killed outright cannot stop its server; this does.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Spawner:
    """One daemon thread per process that starts tied children: it never ends before the
    process does, so their death signal comes when the process dies, not a caller's thread."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        self._pid = -1
        self._lock = threading.Lock()

    def run(self, start: Callable[[], Any]) -> Any:
        with self._lock:
            if self._pid != os.getpid():  # a fresh thread in a forked child
                self._requests = queue.Queue()
                threading.Thread(target=self._serve, args=(self._requests,), name="embedded-s3-spawner",
                                 daemon=True).start()
                self._pid = os.getpid()
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._requests.put((start, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(requests: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]]) -> None:
        while True:
            start, answer = requests.get()
            try:
                answer.put((True, start()))
            except BaseException as exc:
                answer.put((False, exc))


_SPAWNER = _Spawner()


def spawn_tied(args: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **popen)`` for a child that gets SIGTERM when this process dies.

    util-linux's ``setpriv --pdeathsig`` sets the signal when it is there: Python code in a
    ``preexec_fn`` can deadlock in the child of a process with other threads.
    """
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if setpriv:
        command, extra = [setpriv, "--pdeathsig", "TERM", "--", *args], dict[str, Any]()
    else:
        command, extra = args, {"preexec_fn": die_with_parent}
    process: subprocess.Popen[bytes] = _SPAWNER.run(lambda: subprocess.Popen(command, **extra, **popen))
    return process


def cpu_seconds(pid: int) -> float:
    """CPU-seconds (user + system) a running process has used, from ``/proc`` (Linux): what a
    benchmark reads of a server or relay it started, whose CPU it shares."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def started_at(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks since boot, from /proc), or None if it has
    ended (a zombie has ended) or this system has no /proc: with the pid, it names one process
    even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields[19]


OWNER = ".remote-loader-owner"
"""The file in a temporary directory of the embedded server naming the processes that use it."""


def claim(directory: str | os.PathLike[str], pid: int | None = None) -> None:
    """Mark ``directory`` as used by process ``pid`` (this one by default), for
    ``remove_abandoned`` in later processes; a directory may name several."""
    pid = os.getpid() if pid is None else pid
    with open(os.path.join(directory, OWNER), "a") as f:
        f.write(f"{pid} {started_at(pid)}\n")


def remove_abandoned(parent: str, prefixes: tuple[str, ...]) -> list[str]:
    """Remove the directories in ``parent`` named with one of ``prefixes`` that this user owns
    and ``claim`` marked for processes that have all ended (killed outright, the owner could
    not remove them; its server, still ending, could write there again). A directory without
    the mark, another user's, or one a live process uses stays; so does everything on a system
    without /proc. Returns what was removed."""
    if started_at(os.getpid()) is None:
        return []
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            if not name.startswith(prefixes) or os.lstat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER)) as f:
                users = [line.split() for line in f.read().splitlines()]
            ended = all(started_at(int(pid)) != started for pid, started in users)
        except (OSError, ValueError):
            continue
        if users and ended:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
