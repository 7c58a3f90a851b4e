"""The decoding process: a process of its own that runs a device pipeline's DataLoader and
decodes its batches, so that the user's process touches each batch once, and a Python
thread of the user's (a training step, logging, a tokenizer) cannot starve the decoder.

In one process, every call that releases the GIL (a read from a worker's pipe, a torch
op, the codec) waits for it to come back, and a thread that holds the GIL gives it up
only every switch interval (5 ms): a decoding thread that retakes the GIL thousands of
times a batch decodes a few dozen images a second beside such a thread. The decoding
process has its own GIL; the user's process receives each batch in about four system
calls, and its tensors come without a copy (CUDA IPC, ``channel``), as DALI's pipeline
runs in threads of its own and touches Python once per batch.

The process starts with ``python -c`` (not ``multiprocessing``: a spawned process
re-imports the user's ``__main__``, and a daemonic one may not start DataLoader workers),
imports torch and opens the decoder while the user's process goes on; at the first
epoch it receives the pipeline, starts the DataLoader's workers, and opens the decoder
while they fetch, if it has not yet. It ends when asked, when its loader is collected,
at exit, or when the user's process ends (it reads the end of its socket).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from remote_loader.errors import ConfigError, DecoderExited
from remote_loader.pipeline.device.channel import loads
from remote_loader.pipeline.device.containers import WALK_ON, leaves, rebuild
from remote_loader.pipeline.device.decoder import Place

log = logging.getLogger("remote_loader")

AHEAD = 2
"""Decoded batches the process may send before this one has received them."""
_STEP = 1.0  # waits in steps: Ctrl-C gets through, and a process that died is noticed
_CLOSE_SECONDS = 5.0
_SOCKET_BUFFER = 4 << 20
_BOOT = ("import sys\n"
         "from multiprocessing.connection import Connection\n"
         "conn = Connection(int(sys.argv[1]))\n"
         "setup = conn.recv()\n"
         "sys.path[:] = setup['path']\n"
         "from remote_loader.pipeline.device.serve import serve\n"
         "serve(conn, setup)\n")


def credit(run: int) -> bytes:
    """What tells the process that one more batch of ``run`` may come."""
    return b"c" + run.to_bytes(8, "little")


class DecodingProcess:
    """A decoding process for one loader (see the module's docstring), started now.

    Args:
        place: Where it decodes.
    """

    def __init__(self, place: Place) -> None:
        self.place = place
        self.owner = os.getpid()
        self.decoded_on: str | None = None
        self.startup: dict[str, float] = {}  # seconds from its start to its imports done, its decoder open
        self._started = time.time()
        self._open_error: BaseException | None = None
        self._early: deque[tuple[Any, ...]] = deque()  # messages read while waiting for another
        self._run = 0
        self._received = _Received(place.device)
        ours, theirs = socket.socketpair()
        for end in (ours, theirs):  # a message in few reads: each read lets another thread take the GIL
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, start_new_session=True)  # Ctrl-C is this process's to handle
        self._conn = Connection(ours.detach())
        self._conn.send({"path": list(sys.path), "authkey": bytes(multiprocessing.current_process().authkey),
                         "device": str(place.device), "cpu_fallback": place.cpu_fallback, "ahead": AHEAD,
                         "log_level": log.getEffectiveLevel()})
        self._finalizer = weakref.finalize(self, _close, self._process, self._conn, self.owner)
        if place.device.type == "cuda" and not torch.cuda.is_initialized():
            # tensors will come by CUDA IPC: start CUDA here while the process starts
            threading.Thread(target=_start_cuda, name="remote-loader-cuda-start", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def __repr__(self) -> str:
        return f"DecodingProcess(pid={self.pid}, {self.place.device}, decoded_on={self.decoded_on!r})"

    # ---------------------------------------------------------------- epochs

    def run(self, pipeline: bytes | None, to_load: Any = None, world: tuple[int, int] | None = None
            ) -> Iterator[tuple[Any, Any]]:
        """One pass of the loader in the process: each decoded batch and the loader's state
        as of it. ``pipeline`` (``channel.pipeline_bytes`` of the loader and its dataset)
        replaces the one it holds; ``to_load``, a state to load first; ``world``, the rank
        and world size where torch.distributed chose them here (the process reads them from
        its environment otherwise, as this one does). A pass begun later ends this one."""
        self._check_owner()
        self._run += 1
        run = self._run
        self._send(("run", run, pipeline, to_load, world))
        ended = False
        try:
            while True:
                if run != self._run:
                    raise ConfigError("this loader began another iteration, which ended this one: iterate a loader"
                                      " once at a time")
                message = self._receive()
                if message[1] != run:
                    continue  # a batch of a pass left early, unpickled so its memory goes back
                kind = message[0]
                if kind == "batch":
                    self._send_bytes(credit(run))
                    yield message[2], message[3]
                elif kind == "end":
                    ended = True
                    return
                else:  # "error"
                    ended = True
                    raise loads(message[2])
        finally:
            if not ended and run == self._run:
                with contextlib.suppress(DecoderExited, ValueError):  # a process already gone needs no stop
                    self._send(("stop", run))

    def opened(self) -> str:
        """Where the process decodes JPEGs (``"hardware decoder"``, ``"CUDA"`` or ``"CPU"``),
        once it has opened its decoder; the error that kept it from opening one."""
        while self.decoded_on is None and self._open_error is None:
            self._early.append(self._receive(early=False))  # a pass's messages wait their turn
        if self._open_error is not None:
            raise self._open_error
        return self.decoded_on  # type: ignore[return-value]

    def close(self) -> None:
        """End the process (its DataLoader workers with it): asked first, killed after about 5 s."""
        self._finalizer()

    def alive(self) -> bool:
        return self._finalizer.alive and self._process.poll() is None and os.getpid() == self.owner

    def forget(self) -> None:
        """Have the process drop its loader (its workers end) and the GPU memory it cached,
        ready to serve another loader."""
        self._send(("forget",))

    # ---------------------------------------------------------------- messages

    def _send(self, message: tuple[Any, ...]) -> None:
        self._send_bytes(ForkingPickler.dumps(message))

    def _send_bytes(self, data: bytes | memoryview) -> None:
        try:
            self._conn.send_bytes(data)
        except OSError:  # its end of the socket is closed: it is gone
            raise self._exited() from None

    def _receive(self, early: bool = True) -> tuple[Any, ...]:
        """The next message of a pass (batch, end, error), having handled those that report
        (the decoder opened, warnings and log records, raised or logged here as they come);
        ``early``: one read before, while waiting for another, first."""
        while True:
            if early and self._early:
                message = self._early.popleft()
            else:
                while not self._conn.poll(_STEP):
                    if self._process.poll() is not None:
                        raise self._exited()
                try:
                    data = self._conn.recv_bytes()
                except (EOFError, OSError):
                    raise self._exited() from None
                message = self._received.loads(data)
            kind = message[0]
            if kind == "opened":
                self.decoded_on, error = message[1], message[2]
                self.startup = {name: at - self._started for name, at in message[3].items()}
                if error is not None:
                    self._open_error = loads(error)
                else:
                    log.info("remote_loader decodes JPEGs on %s: %s", self.place.device, self.decoded_on)
            elif kind == "warning":
                warnings.warn_explicit(message[2], message[1], message[3], message[4])
            elif kind == "log":
                log.log(message[1], "%s", message[2])
            else:
                return message

    def _exited(self) -> DecoderExited:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=_CLOSE_SECONDS)
        code = self._process.returncode
        how = ("is gone" if code is None else f"exited with status {code}" if code >= 0
               else f"was ended by signal {-code}")
        return DecoderExited(f"remote_loader's decoding process (pid {self.pid}) {how}: the batches it held are lost;"
                             f" iterate again to start the epoch anew (or resume from a checkpoint)",
                             pid=self.pid, returncode=code)

    def _check_owner(self) -> None:
        if os.getpid() != self.owner:
            raise ConfigError(f"this loader's decoding process belongs to process {self.owner}, from which this one"
                              " was forked: make the loader in the process that iterates it")


class _Received:
    """Messages unpickled, their CUDA tensors made this process's own.

    A tensor received by CUDA IPC, once freed, waits for the whole current stream of its
    process (torch synchronises it, so that the sender reuses the memory only once it is
    read): freed in your loop, your step would wait for your previous steps. So each is
    unpickled and copied on a stream of this process's own (the copy waits for the decode
    that made it), freed there at once, and the copy handed to your stream once made."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def loads(self, data: bytes) -> Any:
        if self.device.type != "cuda":
            return loads(data)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            received = loads(data)
            own = rebuild(received, lambda _, x: x.clone() if isinstance(x, torch.Tensor) and x.is_cuda else WALK_ON)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        del received  # the IPC tensors go back to the sender: their release waits for this stream alone
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        for _, tensor in leaves(own, torch.Tensor):
            if tensor.is_cuda:
                tensor.record_stream(current)
        return own


def _start_cuda() -> None:
    with contextlib.suppress(Exception):  # its error comes again, where the first batch arrives
        torch.cuda.init()


def _close(process: subprocess.Popen[bytes], conn: Connection, owner: int) -> None:
    if os.getpid() != owner:  # a forked copy leaves its parent's process alone
        return
    with contextlib.suppress(OSError, ValueError):
        conn.send(("close",))
    try:
        process.wait(timeout=_CLOSE_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    conn.close()


_IDLE: dict[tuple[str, bool], DecodingProcess] = {}
_IDLE_LOCK = threading.Lock()


_PRESTARTED: set[tuple[int, str, bool]] = set()


def prestart(place: Place) -> None:
    """Start a decoding process for ``place`` now, once per process and place, for the first
    loader to take: it starts Python, torch, CUDA and the decoder while you make your model.
    Later loaders take the processes earlier ones left."""
    key = (os.getpid(), str(place.device), place.cpu_fallback)
    with _IDLE_LOCK:
        if key in _PRESTARTED:
            return
        _PRESTARTED.add(key)
    started = DecodingProcess(place)
    with _IDLE_LOCK:
        kept = _IDLE.setdefault(key[1:], started) is started
    if not kept:
        started.close()


def take(place: Place) -> DecodingProcess:
    """A decoding process for ``place``: one a loader collected before left (CUDA and the
    decoder started already), else a new one."""
    with _IDLE_LOCK:
        idle = _IDLE.pop((str(place.device), place.cpu_fallback), None)
    if idle is not None and idle.alive():
        return idle
    return DecodingProcess(place)


def give_back(process: DecodingProcess) -> None:
    """A loader's process, once the loader is collected: kept for the next loader of its
    place (one a place), else ended."""
    if not process.alive():
        return
    try:
        process.forget()
    except (DecoderExited, ValueError):
        process.close()
        return
    key = (str(process.place.device), process.place.cpu_fallback)
    with _IDLE_LOCK:
        kept = _IDLE.setdefault(key, process) is process
    if not kept:
        process.close()
