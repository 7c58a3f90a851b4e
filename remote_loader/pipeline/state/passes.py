"""The passes of DataLoaders over one dataset whose workers may still begin their iteration
(see ``epochs.py``): a table in shared memory, a row a pass, each known by its loader's base
seed and number of workers (``pass_key``), kept while the pass can still have a late worker."""

from __future__ import annotations

import importlib
import os
import sys
from enum import IntEnum
from typing import Any

import torch

from remote_loader.config import MAX_WORKERS
from remote_loader.errors import ConfigError


class Row(IntEnum):
    """A row of the table of passes: several DataLoaders over one dataset may be in a pass at
    once (one begun while another's workers are still beginning), each known by its own row."""

    BASE = 0  # the loader's base seed (-1: a free row)
    WORKERS = 1  # its number of workers
    EPOCH = 2  # the epoch the pass took
    PID = 3  # the process of the worker that recorded it
    STAMP = 4  # when it was recorded, in passes recorded: of the rows free, the oldest is written over
    JOINED = 5  # per worker from here: 1 once it began its iteration of this pass


PASSES = 8
"""Passes of DataLoaders whose workers may still begin, remembered at once: a pass whose
workers have all begun, or whose recorder has ended, frees its row for the next."""
_WIDTH = Row.JOINED + MAX_WORKERS


def pass_key(worker_info: Any) -> int:
    """The pass a DataLoader worker is in: its loader's base seed (``seed - id``, the same in
    every worker of one pass)."""
    return (int(worker_info.seed) - int(worker_info.id)) % 2**62


def running(pid: int) -> bool:
    """Whether process ``pid`` is running (a worker of a pass that ended has exited)."""
    if pid <= 0:
        return False
    if sys.platform == "win32":
        return _running_on_windows(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_SYNCHRONIZE = 0x00100000  # the access right to wait for a process
_ACCESS_DENIED = 5  # ERROR_ACCESS_DENIED: a process that runs, as another user


def _running_on_windows(pid: int) -> bool:
    """``running`` on Windows, whose ``os.kill(pid, 0)`` is no question: 0 is CTRL_C_EVENT,
    which the console sends to every process attached to it (the training process too)."""
    winapi: Any = importlib.import_module("_winapi")
    try:
        handle = winapi.OpenProcess(_SYNCHRONIZE, False, pid)
    except OSError as error:  # ERROR_INVALID_PARAMETER: no such process
        return getattr(error, "winerror", None) == _ACCESS_DENIED
    try:
        return bool(winapi.WaitForSingleObject(handle, 0) == winapi.WAIT_TIMEOUT)
    finally:
        winapi.CloseHandle(handle)


class PassTable:
    """The rows of passes, in ``shared`` (``SIZE`` numbers, a view of a larger shared tensor)."""

    SIZE = PASSES * _WIDTH

    def __init__(self, shared: torch.Tensor) -> None:
        self.rows = shared.view(PASSES, _WIDTH)

    def clear(self) -> None:
        """No pass recorded."""
        self.rows[:, Row.BASE] = -1

    def join(self, base: int, workers: int, worker: int) -> int | None:
        """The epoch of this loader's pass under way, which ``worker`` joins; None where it has
        none (every worker of the pass recorded began already, or its recorder has ended)."""
        table = self.rows
        for index in torch.argsort(table[:, Row.STAMP], descending=True).tolist():  # the latest first
            row = table[index]  # a view: what is set in it is set in shared memory
            if (int(row[Row.BASE]) == base and int(row[Row.WORKERS]) == workers
                    and not int(row[Row.JOINED + worker]) and running(int(row[Row.PID]))):
                row[Row.JOINED + worker] = 1
                return int(row[Row.EPOCH])
        return None

    def record(self, base: int, workers: int, worker: int, epoch: int) -> None:
        """A new pass of this loader, taking ``epoch``, begun by ``worker``: written over the
        oldest row free (see ``free``); ConfigError where none is."""
        table = self.rows
        vacant = [index for index in range(PASSES) if free(table[index])]
        if not vacant:
            raise ConfigError(
                f"{PASSES} DataLoaders over this dataset each have a worker yet to begin its pass, and one more pass"
                " cannot begin without mixing epochs into theirs: call dataset.set_epoch(epoch) before each pass,"
                f" or start the workers of at most {PASSES} DataLoaders at once")
        row = table[min(vacant, key=lambda index: int(table[index, Row.STAMP]))]
        row.zero_()
        row[Row.BASE], row[Row.WORKERS], row[Row.EPOCH], row[Row.PID] = base, workers, epoch, os.getpid()
        row[Row.STAMP] = int(table[:, Row.STAMP].max()) + 1
        row[Row.JOINED + worker] = 1


def free(row: torch.Tensor) -> bool:
    """Whether a row of the table may be written over: its pass can have no late worker any
    more (every worker of it began, or the process that recorded it has ended), or it holds none."""
    if int(row[Row.BASE]) == -1:
        return True
    workers = int(row[Row.WORKERS])
    return bool(row[Row.JOINED:Row.JOINED + workers].all()) or not running(int(row[Row.PID]))
