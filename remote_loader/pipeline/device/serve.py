"""The decoding process's own side (``process`` starts it): it waits for a pass, runs the
loader it was sent with the thread engine that decodes in any process
(``stream.decoded_with_states``), and sends each decoded batch back as soon as the user's
process has room for it (``process.AHEAD`` batches sent and not yet received).

Its warnings and the library's log records go to the user's process, which raises or
logs them as its own would be; an error of a pass goes there whole (type and facts) and
ends the pass, not the process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import warnings
from collections.abc import Generator
from multiprocessing.connection import Connection
from typing import Any

import torch

from remote_loader.pipeline.device.channel import batch_bytes, error_bytes, loads
from remote_loader.pipeline.device.codec import open_codec
from remote_loader.pipeline.device.decoder import Place
from remote_loader.pipeline.device.stream import decoded_with_states

_STEP = 1.0
_STOP = ("stop",)


class _Gone(BaseException):
    """The user's process has ended (its end of the socket is closed): stop, quietly. Not an
    ``Exception``, so that no handler of a pass's errors takes it for one."""


def serve(conn: Connection, setup: dict[str, Any]) -> None:
    """Serve the user's process on ``conn`` until it asks to close, or ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the user's process's to handle
    multiprocessing.current_process().authkey = setup["authkey"]  # it shares tensors' memory by file descriptor
    torch.set_num_threads(1)  # its torch ops are a GPU's (or the CPU backend's few); its cores are the workers'
    try:
        _Server(conn, setup).serve()
    except _Gone:
        pass


class _Server:
    def __init__(self, conn: Connection, setup: dict[str, Any]) -> None:
        self.conn, self.pid, self.lock = conn, os.getpid(), threading.Lock()
        self.began = time.time()
        self.place = Place(torch.device(setup["device"]), setup["cpu_fallback"])
        self.ahead: int = setup["ahead"]
        self.level: int = setup["log_level"]
        self.loader: Any = None
        self.dataset: Any = None
        self.opened = False
        self.run_id, self.credits = 0, 0
        self.environ = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
        self._forward_warnings_and_logs()

    def send(self, message: tuple[Any, ...]) -> None:
        data = batch_bytes(message)
        try:
            with self.lock:  # whole messages: a warning may come from another thread
                self.conn.send_bytes(data)
        except OSError:
            raise _Gone from None

    def serve(self) -> None:
        if not self.conn.poll(0):  # no pass waits: open the decoder while the user's process goes on
            self.open()
        pending: tuple[Any, ...] | None = None
        while True:
            message = pending or self.command()
            pending = None
            if message[0] == "close":
                return
            if message[0] == "run":
                pending = self.run(*message[1:])
            elif message[0] == "forget":
                self.forget()

    def command(self) -> tuple[Any, ...]:
        """The next pass or close (credits and stops of passes already over are dropped);
        close when the user's process has ended."""
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                return ("close",)
            if data[:1] != b"c":
                message = loads(data)
                if message[0] in ("run", "close", "forget"):
                    return message

    def forget(self) -> None:
        """Drop the loader (its workers end) and what the GPU's allocator keeps for it."""
        self.loader = self.dataset = None
        if self.place.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def open(self) -> None:
        """Open the decoder (on a GPU: CUDA's start-up, the probe of its decoders) and say
        where it decodes, or why it could not."""
        self.opened = True
        try:
            decoded_on = open_codec(self.place.device, self.place.cpu_fallback).decoded_on
        except Exception as error:  # noqa: BLE001 - reported; a pass raises it again
            self.send(("opened", None, error_bytes(error, self.pid), {}))
        else:
            self.send(("opened", decoded_on, None, {"imports": self.began, "decoder": time.time()}))

    # ---------------------------------------------------------------- one pass

    def run(self, run: int, pipeline: bytes | None, to_load: Any, world: tuple[int, int] | None
            ) -> tuple[Any, ...] | None:
        """One pass, its batches sent as credits allow; the command that ended it early, if one did."""
        self.run_id, self.credits = run, self.ahead
        try:
            batches = self.begin(pipeline, to_load, world)
            snapshot = getattr(self.loader, "state_dict", None)
            stream: Generator[tuple[Any, Any], None, None] = decoded_with_states(
                batches, self.dataset.batch_decoder(), snapshot)
            try:
                for item, state in stream:
                    ended = self.wait_for_credit()
                    if ended is not None:
                        return None if ended is _STOP else ended
                    self.send(("batch", run, item, state))
                    self.credits -= 1
                    del item, state
                    if self.place.device.type == "cuda":
                        torch.cuda.ipc_collect()  # blocks the user's process has let go of
            finally:
                stream.close()
        except _Gone:
            raise
        except BaseException as error:  # noqa: BLE001 - the pass's error (SystemExit from a map too), raised there
            if not self.opened:  # the user's process may wait to hear where it decodes
                self.open()
            self.send(("error", run, error_bytes(error, self.pid)))
            return None
        self.send(("end", run))
        return None

    def begin(self, pipeline: bytes | None, to_load: Any, world: tuple[int, int] | None) -> Any:
        """The pass's batches begun: the loader received (or the one held), its state loaded,
        its workers started, and the decoder opened while they start fetching."""
        if pipeline is not None:
            self.loader = self.dataset = None  # the workers of the one before end
            self.loader, self.dataset = loads(pipeline)
        self.set_world(world)
        if to_load is not None:
            self.loader.load_state_dict(to_load)
        batches = iter(self.loader)
        if not self.opened:
            self.open()
        return batches

    def set_world(self, world: tuple[int, int] | None) -> None:
        """The rank and world size as torch.distributed says in the user's process, where it
        is set up there (this process has no group: it reads ``RANK`` and ``WORLD_SIZE``);
        else the environment as this process began (it may serve another loader after one)."""
        for name, value in self.environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if world is not None:
            os.environ.update(RANK=str(world[0]), WORLD_SIZE=str(world[1]))

    def wait_for_credit(self) -> tuple[Any, ...] | None:
        """None once a batch may be sent; ``_STOP`` where the user's process left this pass,
        or the command (a new pass, close) that ends it."""
        while self.credits <= 0 or self.conn.poll(0):
            if not self.conn.poll(_STEP):
                continue
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                return ("close",)
            if data[:1] == b"c":
                self.credits += int.from_bytes(data[1:], "little") == self.run_id
                continue
            message = loads(data)
            if message[0] == "stop":
                if message[1] == self.run_id:
                    return _STOP
                continue
            return message
        return None

    # ---------------------------------------------------------------- what it says

    def _forward_warnings_and_logs(self) -> None:
        """Warnings and the library's log records go to the user's process; in a DataLoader
        worker forked from here (which has its own stderr and no socket of its own) they
        stay as Python shows them."""
        server, show = self, warnings.showwarning

        def showwarning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                        line: str | None = None) -> None:
            if os.getpid() != server.pid:
                show(message, category, filename, lineno, file, line)
                return
            server.send(("warning", category, str(message), filename, lineno))

        class Forward(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if os.getpid() == server.pid:
                    server.send(("log", record.levelno, record.getMessage()))

        warnings.showwarning = showwarning
        logger = logging.getLogger("remote_loader")
        logger.addHandler(Forward())
        logger.setLevel(self.level)  # the user's process's: records it would drop are not sent
        logger.propagate = False
