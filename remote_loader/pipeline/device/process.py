"""The decoding process: a process of its own that runs a device pipeline's DataLoader and
decodes its batches, so that the user's process touches each batch once, and a Python
thread of the user's (a training step, logging, a tokenizer) cannot starve the decoder.

In one process, every call that releases the GIL (a read from a worker's pipe, a torch
op, the codec) waits for it to come back, and a thread that holds the GIL gives it up
only every switch interval (5 ms): a decoding thread that retakes the GIL thousands of
times a batch decodes a few dozen images a second beside such a thread. The decoding
process has its own GIL; the user's process receives each batch in a few system calls,
and its tensors come without a copy across processes (``channel``), as DALI's pipeline
runs in threads of its own and touches Python once per batch.

The process starts with ``python -c`` (not ``multiprocessing``: a spawned process
re-imports the user's ``__main__``, and a daemonic one may not start DataLoader workers),
with the first device pipeline of a process (``prestart``): it imports torch and opens
the decoder while the user's process goes on. Each pass brings the user's process's
``sys.path``, working directory, environment, warning filters and logging levels as they
are then, and the pipeline where the process does not hold it. A pass's workers start
before the decoder opens, where it has not yet. The process ends when asked, when the
user's process ends (its socket's end closes, or its parent changes), and at exit; a
stream left half read or written (Ctrl-C mid-message) ends it, and the next pass starts
another.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any

import torch

from remote_loader.errors import ConfigError, DecoderExited
from remote_loader.pipeline.device.channel import Channel, loads
from remote_loader.pipeline.device.decoder import Place
from remote_loader.pipeline.stages.containers import WALK_ON, leaves, rebuild

log = logging.getLogger("remote_loader")

AHEAD = 2
"""Decoded batches the process may send before this one has received them."""
_STEP = 1.0  # waits in steps: Ctrl-C gets through, and a process that died is noticed
_CLOSE_SECONDS = 5.0
_SEND_SECONDS = 60.0  # a process that reads nothing for this long (stopped, hung) is given up
_SOCKET_BUFFER = 4 << 20
_BOOT = ("import json, sys\n"
         "sys.path[:] = json.loads(sys.argv[2])\n"
         "from remote_loader.pipeline.device.serve import serve\n"
         "serve(int(sys.argv[1]))\n")


def context() -> dict[str, Any]:
    """What a pass takes from this process as it is when the pass begins: where modules and
    files are found, the environment (``RANK``...), warning filters, logging levels."""
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger) and logger.level}
    return {"path": list(sys.path), "cwd": os.getcwd(), "env": dict(os.environ), "warnings": list(warnings.filters),
            "levels": {**levels, "": logging.root.level}}


class DecodingProcess:
    """A decoding process for one loader at a time (see the module's docstring), started now.

    Args:
        place: Where it decodes.
    """

    def __init__(self, place: Place) -> None:
        self.place = place
        self.owner = os.getpid()
        self.decoded_on: str | None = None
        self.startup: dict[str, float] = {}  # seconds from its start to its imports done, its decoder open
        self._open_error: BaseException | None = None
        self._early: deque[tuple[Any, ...]] = deque()  # messages read while waiting for another
        self._run = 0
        self._received = _Received(place.device)
        ours, theirs = socket.socketpair()
        for end in (ours, theirs):  # a message in few reads: each read lets another thread take the GIL
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        self._started = time.time()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                start_new_session=True)  # Ctrl-C is this process's to handle
        self._channel = Channel(ours, timeout=_SEND_SECONDS)
        self._finalizer = weakref.finalize(self, _close, self._process, self._channel, self.owner)
        self._send({"authkey": bytes(multiprocessing.current_process().authkey), "device": str(place.device),
                    "cpu_fallback": place.cpu_fallback, "ahead": AHEAD, "parent": self.owner, "context": context()})
        if place.device.type == "cuda" and not torch.cuda.is_initialized():
            # tensors will come by CUDA IPC: start CUDA here while the process starts
            threading.Thread(target=_start_cuda, name="remote-loader-cuda-start", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def __repr__(self) -> str:
        return f"DecodingProcess(pid={self.pid}, {self.place.device}, decoded_on={self.decoded_on!r})"

    # ---------------------------------------------------------------- passes

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
        self._send(("run", run, pipeline, to_load, world, context()))
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
                    self._send(("credit", run))
                    yield message[2], message[3]
                elif kind == "end":
                    ended = True
                    return
                else:  # "error"
                    ended = True
                    raise message[2]
        finally:
            if not ended and run == self._run and self.alive():
                with contextlib.suppress(DecoderExited):  # a process already gone needs no stop
                    self._send(("stop", run))

    def opened(self) -> str:
        """Where the process decodes JPEGs (``"hardware decoder"``, ``"CUDA"`` or ``"CPU"``),
        once it has opened its decoder; the error that kept it from opening one."""
        while self.decoded_on is None and self._open_error is None:
            message = self._next()
            if not self._reported(message):
                self._early.append(message)  # a pass's messages wait their turn
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

    def _send(self, message: Any) -> None:
        try:
            self._channel.send(message)
        except OSError:  # closed (it is gone), or it read nothing for _SEND_SECONDS (stopped, hung)
            self._abandon()
            raise self._exited() from None
        except BaseException:  # Ctrl-C mid-message: what it reads next is no message
            self._abandon()
            raise

    def _receive(self, early: bool = True) -> tuple[Any, ...]:
        """The next message of a pass (batch, end, error), having handled those that report
        (the decoder opened, warnings and log records, raised or logged here as they come);
        ``early``: one read before, while waiting for another, first."""
        while True:
            if early and self._early:
                message = self._early.popleft()
            else:
                message = self._next()
            if not self._reported(message):
                return message

    def _reported(self, message: tuple[Any, ...]) -> bool:
        """Handle ``message`` where it reports (the decoder opened, a warning, a log record):
        whether it did."""
        kind = message[0]
        if kind == "opened":
            self.decoded_on, self._open_error = message[1], message[2]
            self.startup = {name: at - self._started for name, at in message[3].items()}
        elif kind == "warning":
            warnings.warn_explicit(message[2], message[1], message[3], message[4])
        elif kind == "log":
            record = logging.makeLogRecord(message[1])
            logging.getLogger(record.name).handle(record)
        else:
            return False
        return True

    def _next(self) -> tuple[Any, ...]:
        while not self._channel.ready(_STEP):
            if self._process.poll() is not None:
                raise self._exited()
        try:
            data, buffers = self._channel.receive_raw()
        except (EOFError, ConnectionError):
            raise self._exited() from None
        except BaseException:  # Ctrl-C, or a message cut short: the stream is lost with the process
            self._abandon()
            raise
        try:
            return self._received.loads(data, buffers)
        except Exception:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=_STEP)
            if self._process.poll() is not None:  # its tensors went with it (CUDA IPC)
                raise self._exited() from None
            raise

    def _abandon(self) -> None:
        """End the process now, without a word: its stream cannot be trusted."""
        with contextlib.suppress(OSError):
            self._process.kill()
        self._finalizer()

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

    def loads(self, data: bytearray, buffers: list[bytearray]) -> Any:
        if self.device.type != "cuda":
            return loads(data, buffers)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            received = loads(data, buffers)
            own = rebuild(received, lambda _, x: x.clone() if isinstance(x, torch.Tensor) and x.is_cuda else WALK_ON)
            copied = torch.cuda.Event()
            copied.record(self._stream)
            # The IPC tensors go back to the sender here, while this stream is current: their
            # release synchronises the current stream, which must be this one, not your step's.
            del received
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        for _, tensor in leaves(own, torch.Tensor):
            if tensor.is_cuda:
                tensor.record_stream(current)
        return own


def _start_cuda() -> None:
    with contextlib.suppress(Exception):  # its error comes again, where the first batch arrives
        torch.cuda.init()


def _close(process: subprocess.Popen[bytes], channel: Channel, owner: int) -> None:
    if os.getpid() != owner:  # a forked copy leaves its parent's process alone
        return
    if process.poll() is None:
        with contextlib.suppress(OSError):
            channel.sock.settimeout(_STEP)  # a process that reads nothing is killed below
            channel.send(("close",))
        try:
            process.wait(timeout=_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    channel.close()


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


def discard(place: Place) -> None:
    """End the process kept for ``place``, if one is (a loader that decodes in its own
    process will not take it)."""
    with _IDLE_LOCK:
        idle = _IDLE.pop((str(place.device), place.cpu_fallback), None)
    if idle is not None:
        idle.close()


def give_back(process: DecodingProcess) -> None:
    """A loader's process, once the loader is collected: kept for the next loader of its
    place (one a place), else ended."""
    if not process.alive():
        return
    try:
        process.forget()
    except DecoderExited:
        return
    key = (str(process.place.device), process.place.cpu_fallback)
    with _IDLE_LOCK:
        kept = _IDLE.setdefault(key, process) is process
    if not kept:
        process.close()
