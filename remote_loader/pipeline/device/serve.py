"""The decoding process's own side (``process`` starts it): it waits for a pass, runs the
loader it was sent with the thread engine that decodes in any process
(``stream.decoded_with_states``), and sends each decoded batch back as soon as the user's
process has room for it (``process.AHEAD`` batches sent and not yet received).

A thread reads the socket all along, so the user's process never waits to send while this
one sends to it; it also ends this process once the user's has ended (its end of the
socket closes, or this process's parent changes: a fork of the user's process may hold the
socket open). Warnings and log records go to the user's process, which raises or logs them
as its own would be (a DataLoader worker forked from here, which has no socket of its own,
shows its warnings as Python does); an error of a pass goes there whole (type and facts)
and ends the pass, not the process.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Generator
from typing import Any

import torch

from remote_loader.pipeline.device.channel import Channel, load_pipeline, sendable
from remote_loader.pipeline.device.codec import open_codec
from remote_loader.pipeline.device.decoded import decoded_with_states
from remote_loader.pipeline.device.decoder import Place

_STEP = 1.0
_STOP = ("stop",)
_RECORD = ("name", "msg", "levelname", "levelno", "pathname", "filename", "module", "lineno", "funcName", "created",
           "msecs", "relativeCreated", "thread", "threadName", "processName", "process", "exc_text", "stack_info")


class _Gone(BaseException):
    """The user's process has ended (its end of the socket is closed): stop, quietly. Not an
    ``Exception``, so that no handler of a pass's errors takes it for one."""


def serve(fd: int) -> None:
    """Serve the user's process on the socket ``fd`` until it asks to close, or ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the user's process's to handle
    channel = Channel(socket.socket(fileno=fd))
    try:
        setup = channel.receive()
    except (EOFError, OSError):
        return
    multiprocessing.current_process().authkey = setup["authkey"]  # it shares tensors' memory by file descriptor
    torch.set_num_threads(1)  # its torch ops are a GPU's (or the CPU backend's few); its cores are the workers'
    try:
        _Server(channel, setup).serve()
    except _Gone:
        pass


def _drop_frames(error: BaseException | None) -> None:
    """Let go now of what the frames of ``error``'s tracebacks hold (a failed pass's
    DataLoader iterator, whose workers end with it): a frame there may hold the error itself
    (torch's ``reraise`` does), a cycle only the garbage collector would free, minutes later."""
    seen: set[int] = set()
    chained = [error]
    while chained:
        error = chained.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # those still running (this pass's own) are skipped
        error.__traceback__ = None
        chained += [error.__cause__, error.__context__]  # "raise X from Y" in a handler has both


def _end() -> None:
    """End this process now, quietly, and its DataLoader workers with it (one stuck in a
    user's function would not see its parent go)."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            child.kill()
    os._exit(0)


class _Server:
    def __init__(self, channel: Channel, setup: dict[str, Any]) -> None:
        self.channel, self.pid = channel, os.getpid()
        self.began = time.time()
        self.place = Place(torch.device(setup["device"]), setup["cpu_fallback"])
        self.ahead: int = setup["ahead"]
        self.loader: Any = None
        self.dataset: Any = None
        self.opened = False
        self.run_id, self.credits = 0, 0
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._forward_warnings_and_logs()
        self.adopt(setup["context"])
        threading.Thread(target=self._read, args=(setup["parent"],), name="remote-loader-commands",
                         daemon=True).start()

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            self.channel.send(message)  # whole messages: a warning may come from another thread
        except OSError:
            raise _Gone from None

    def _read(self, parent: int) -> None:
        """The socket, read into ``commands`` as messages come; this process ended (quietly,
        its workers with it) once the user's process has ended, or closed its end: whatever
        the main thread waits for then (a batch from a stuck worker) is for no one."""
        while True:
            try:
                if not self.channel.ready(_STEP):
                    if os.getppid() != parent:
                        _end()
                    continue
                self.commands.put(self.channel.receive())
            except (EOFError, OSError):
                _end()

    def command(self, timeout: float | None = None) -> tuple[Any, ...] | None:
        try:
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def serve(self) -> None:
        pending: tuple[Any, ...] | None = None
        while True:
            if not self.opened and pending is None and self.commands.empty():
                self.open()  # no pass waits: the decoder opens while the user's process goes on
            message = pending or self.command()
            pending = None
            if message is None or message[0] in ("credit", "stop"):  # of a pass already over
                continue
            if message[0] == "close":
                return
            if message[0] == "run":
                pending = self.run(*message[1:])
            elif message[0] == "forget":
                self.forget()

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
            self.send(("opened", None, sendable(error, self.pid), {}))
        else:
            self.send(("opened", decoded_on, None, {"imports": self.began, "decoder": time.time()}))

    # ---------------------------------------------------------------- one pass

    def run(self, run: int, pipeline: bytes | None, to_load: Any, world: tuple[int, int] | None,
            context: dict[str, Any]) -> tuple[Any, ...] | None:
        """One pass, its batches sent as credits allow; the command that ended it early, if one did."""
        self.run_id, self.credits = run, self.ahead
        try:
            batches = self.begin(pipeline, to_load, world, context)
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
            self.send(("error", run, sendable(error, self.pid)))
            _drop_frames(error)
            return None
        self.send(("end", run))
        return None

    def begin(self, pipeline: bytes | None, to_load: Any, world: tuple[int, int] | None,
              context: dict[str, Any]) -> Any:
        """The pass's batches begun: the user's process's context taken, the loader received
        (or the one held), its state loaded, its workers started, and the decoder opened
        while they start fetching."""
        self.adopt(context)
        if world is not None:  # as torch.distributed says there: this process has no group
            os.environ.update(RANK=str(world[0]), WORLD_SIZE=str(world[1]))
        if pipeline is not None:
            self.loader = self.dataset = None  # the workers of the one before end
            self.loader, self.dataset = load_pipeline(pipeline)
        if self.loader is None:
            raise RuntimeError("the decoding process holds no pipeline: the one sent before did not arrive whole")
        if to_load is not None:
            self.loader.load_state_dict(to_load)
        batches = iter(self.loader)
        if not self.opened:
            self.open()
        return batches

    def adopt(self, context: dict[str, Any]) -> None:
        """The user's process's ``sys.path``, working directory, environment, warning filters
        and logging levels as a pass begins there (this process may serve many loaders)."""
        sys.path[:] = context["path"]
        os.chdir(context["cwd"])
        os.environ.clear()
        os.environ.update(context["env"])
        warnings.filters[:] = context["warnings"]  # type: ignore[index]
        for name, level in context["levels"].items():
            logging.getLogger(name or None).setLevel(level)

    def wait_for_credit(self) -> tuple[Any, ...] | None:
        """None once a batch may be sent; ``_STOP`` where the user's process left this pass,
        or the command (a new pass, close, forget) that ends it."""
        while True:
            message = self.command(timeout=0 if self.credits > 0 else _STEP)
            if message is None:
                if self.credits > 0:
                    return None
                continue
            if message[0] == "credit":
                self.credits += message[1] == self.run_id
            elif message[0] == "stop":
                if message[1] == self.run_id:
                    return _STOP
            else:
                return message

    # ---------------------------------------------------------------- what it says

    def _forward_warnings_and_logs(self) -> None:
        """Warnings and log records go to the user's process; in a DataLoader worker forked
        from here they stay as Python shows them where nothing is set up (on stderr, from
        the level of a warning)."""
        server, show = self, warnings.showwarning

        def showwarning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                        line: str | None = None) -> None:
            if os.getpid() != server.pid:
                show(message, category, filename, lineno, file, line)
                return
            server.send(("warning", category, str(message), filename, lineno))

        class Forward(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if os.getpid() != server.pid:
                    if logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                        logging.lastResort.handle(record)
                    return
                if record.exc_info and not record.exc_text:
                    record.exc_text = logging.Formatter().formatException(record.exc_info)
                fields = {name: getattr(record, name, None) for name in _RECORD}
                fields["msg"] = record.getMessage()
                server.send(("log", fields))

        warnings.showwarning = showwarning
        logging.root.addHandler(Forward())
