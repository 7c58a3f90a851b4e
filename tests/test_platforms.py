"""macOS and Windows, simulated on Linux: what each system lacks of Linux's os, signal and
fcntl is taken away (for Windows in a subprocess, and in the processes it spawns, by a
``sitecustomize``), and the main paths must still work, or say in one line what is missing."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from remote_loader import RemoteDataset, upload_cv_dataset
from remote_loader.cli import main as cli_main
from remote_loader.pipeline.state import passes
from remote_loader.storage.local import LocalStore
from remote_loader.testing.synthetic import SyntheticImages

ROOT = Path(__file__).resolve().parents[1]

# What CPython on Windows lacks of Linux's modules. torch and the parts of the standard
# library that choose their Windows code by sys.platform (still "linux" here) are imported
# before the removal; msvcrt's file locks are stood in for by flock.
WINDOWS_SITE = '''
import os, sys, signal, select
import multiprocessing.resource_tracker, multiprocessing.synchronize, multiprocessing.popen_spawn_posix  # noqa
import multiprocessing.connection, multiprocessing.queues, multiprocessing.util, subprocess  # noqa
import torch, torch.utils.data  # noqa
import fake_msvcrt
for name in ("fcntl", "resource", "pwd", "grp", "termios"):
    sys.modules[name] = None
for name in ("register_at_fork", "sched_getaffinity", "pread", "pwrite", "preadv", "pwritev", "posix_fadvise",
             "posix_fallocate", "memfd_create", "pidfd_open", "geteuid", "getuid", "getgid", "fork", "killpg",
             "getpgid", "setsid", "O_NOFOLLOW", "O_DIRECTORY", "O_CLOEXEC", "O_NONBLOCK", "getloadavg",
             "fchmod", "fchown", "chown", "lchown", "getxattr", "setxattr"):
    if hasattr(os, name):
        delattr(os, name)
os.supports_dir_fd = set()
for name in ("SIGKILL", "SIGSTOP", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCONT",
             "pthread_sigmask", "sigwait", "pthread_kill", "setitimer", "alarm"):
    if hasattr(signal, name):
        delattr(signal, name)
for name in ("epoll", "poll"):
    if hasattr(select, name):
        delattr(select, name)
multiprocessing.resource_tracker._HAVE_SIGMASK = False
multiprocessing.set_start_method("spawn", force=True)
sys.modules["msvcrt"] = fake_msvcrt
'''

FAKE_MSVCRT = '''
"""msvcrt.locking, stood in for by flock of the whole file: LK_LOCK raises EDEADLOCK where the
lock is held (as Windows' does after its ten tries), LK_NBLCK raises EACCES."""
import errno
import fcntl

LK_UNLCK, LK_LOCK, LK_NBLCK = 0, 1, 2
calls = []


def locking(fd, mode, nbytes):
    calls.append(mode)
    if mode == LK_UNLCK:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OSError(errno.EDEADLOCK if mode == LK_LOCK else errno.EACCES, "locked") from None
'''

WINDOWS_RUN = '''
import os
import sys
import msvcrt
from remote_loader import ConfigError, PreconditionFailed, RemoteDataset, RemoteMapDataset, loader, upload_cv_dataset
from remote_loader.storage.local import LocalStore
from remote_loader.storage.locking import exclusive, try_lock
from remote_loader.testing.synthetic import SyntheticImages


def main():
    store = LocalStore(sys.argv[1])
    store.create_bucket("b")
    upload_cv_dataset(SyntheticImages(32, num_classes=4), client=store, bucket="b", base_folder="ds", maxcount=8,
                      workers=0, progress=False)
    store.put("b", "once", b"1", if_none_match=True)
    try:
        store.put("b", "once", b"2", if_none_match=True)
    except PreconditionFailed:
        print("refused")
    ds = RemoteDataset(store, "b", "ds").to_tuple("jpg", "cls").batched(8)
    batches = loader(ds, num_workers=2, multiprocessing_context="spawn", pin_memory=False)
    print("streamed", sum(len(labels) for _, labels in batches))
    print("map", len(RemoteMapDataset(store, "b", "ds")))
    print("unlocked", msvcrt.calls.count(msvcrt.LK_UNLCK) > 0)
    path = os.path.join(sys.argv[1], "lock")
    first, second = os.open(path, os.O_RDWR | os.O_CREAT), os.open(path, os.O_RDWR)
    with exclusive(first):
        held = not try_lock(second)
    print("exclusive", held, try_lock(second))
    try:
        RemoteDataset(store, "b", "ds", cache_dir=sys.argv[2])
    except ConfigError as error:
        print("cache:", error)


if __name__ == "__main__":
    main()
'''


def test_windows_uploads_streams_with_spawned_workers_and_refuses_the_cache(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(WINDOWS_SITE))
    (site / "fake_msvcrt.py").write_text(textwrap.dedent(FAKE_MSVCRT))
    (site / "run.py").write_text(textwrap.dedent(WINDOWS_RUN))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run([sys.executable, str(site / "run.py"), str(tmp_path / "root"), str(tmp_path / "cache")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:5] == ["refused", "streamed 32", "map 32", "unlocked True", "exclusive True True"], done.stdout
    assert lines[5].startswith("cache: the shard cache (cache_dir, REMOTE_LOADER_CACHE_DIR) needs O_NOFOLLOW")
    assert "flock (fcntl)" in lines[5] and len(lines) == 6


def test_macos_node_cache_without_fallocate_xattrs_or_preadv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("posix_fallocate", "getxattr", "setxattr", "preadv"):  # Linux's alone
        monkeypatch.delattr(os, name, raising=False)
    store = LocalStore(tmp_path / "root")
    store.create_bucket("b")
    upload_cv_dataset(SyntheticImages(48, num_classes=4), client=store, bucket="b", base_folder="ds", maxcount=16,
                      workers=0, progress=False)
    ds = RemoteDataset(store, "b", "ds", cache_dir=tmp_path / "cache")
    first = sorted(sample["__key__"] for sample in ds)
    fetched, cached = ds.metrics.bytes, ds.metrics.cached_bytes
    assert sorted(sample["__key__"] for sample in ds) == first and len(first) == 48
    assert ds.metrics.bytes == fetched and ds.metrics.cached_bytes > cached  # epoch 2 from the cache alone
    shards = [p for p in (tmp_path / "cache").rglob("*.tar") if p.parent.name != ".fill"]
    assert len(shards) == 3 and all(p.stat().st_size > 0 for p in shards)


class _FakeWinapi(types.ModuleType):
    """Windows' _winapi as ``passes.running`` uses it, over /proc: a process is waited for,
    never signalled."""

    WAIT_OBJECT_0, WAIT_TIMEOUT = 0, 0x102

    def __init__(self) -> None:
        super().__init__("_winapi")

    def OpenProcess(self, access: int, inherit: bool, pid: int) -> int:  # noqa: N802
        if not os.path.exists(f"/proc/{pid}"):
            raise OSError(errno.EINVAL, "The parameter is incorrect")
        return pid

    def WaitForSingleObject(self, handle: int, timeout: int) -> int:  # noqa: N802
        with open(f"/proc/{handle}/stat") as stat:
            ended = stat.read().rpartition(")")[2].split()[0] == "Z"
        return self.WAIT_OBJECT_0 if ended else self.WAIT_TIMEOUT

    def CloseHandle(self, handle: int) -> None:  # noqa: N802
        pass


def test_windows_asks_whether_a_pass_recorder_runs_without_signalling_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def console_ctrl_event(pid: int, sig: int) -> None:
        raise AssertionError(f"os.kill({pid}, {sig}) on Windows sends CTRL_C_EVENT to every process of the console")

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        monkeypatch.setattr(sys, "platform", "win32")
        monkeypatch.setitem(sys.modules, "_winapi", _FakeWinapi())
        monkeypatch.setattr(os, "kill", console_ctrl_event)
        assert passes.running(os.getpid()) and passes.running(child.pid)
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        assert not passes.running(child.pid)
    finally:
        monkeypatch.undo()
        child.kill()
        child.wait()


def test_serve_says_where_the_embedded_server_runs(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("pthread_sigmask", "sigwait"):  # Windows lacks them, and os.killpg
        monkeypatch.delattr(signal, name)
    monkeypatch.delattr(os, "killpg")
    assert cli_main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remote-loader: error: the embedded S3 server runs on Linux and macOS") and "killpg" in err
