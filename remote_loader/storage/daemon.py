"""Threads for requests to a store that may stop answering.

They are daemon threads, which the interpreter does not join at exit: Ctrl-C ends the
process at once, whatever a hung request still waits for. Not ``ThreadPoolExecutor``,
whose threads the interpreter joins at exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_STEP = 0.5


def wait_result(future: Future[T]) -> T:
    """``future.result()``, waited for in steps of 0.5 s. A wait without a timeout can miss
    Ctrl-C: a SIGINT that lands as the thread is about to block is handled only once the
    wait ends, which for a request to a hung store is its read timeout."""
    while not future.done():
        wait([future], timeout=_STEP)
    return future.result()


def in_daemon_thread(call: Callable[[], T], name: str = "remote-loader-request") -> Future[T]:
    """Run ``call`` in a daemon thread of its own; its outcome in the future."""
    future: Future[T] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def map_on_daemon_threads(call: Callable[[T], R], items: Sequence[T], threads: int,
                          name: str = "remote-loader-request", *, settle: float = 0.0) -> list[R]:
    """``[call(item) for item in items]``, up to ``threads`` at once on daemon threads.

    Once a call fails, or the caller is interrupted (Ctrl-C), no thread starts another item;
    the caller gets the error once the calls already started have ended, or ``settle``
    seconds after it, whichever comes first (0: at once; Ctrl-C never waits): a call stuck
    on a hung store does not hold the error back longer than that.
    """
    if len(items) <= 1 or threads <= 1:
        return [call(item) for item in items]
    results: list[R | None] = [None] * len(items)
    positions = iter(range(len(items)))
    lock = threading.Lock()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                k = next(positions, None)
            if k is None:
                return
            try:
                results[k] = call(items[k])
            except BaseException:
                stop.set()
                raise

    workers = [in_daemon_thread(work, name) for _ in range(min(threads, len(items)))]
    try:
        done: set[Future[None]] = set()
        while len(done) < len(workers) and not any(w.exception() is not None for w in done):
            done, _ = wait(workers, timeout=_STEP, return_when=FIRST_EXCEPTION)  # in steps, as wait_result
        stop.set()
        deadline = time.monotonic() + settle
        while len(done) < len(workers) and time.monotonic() < deadline:
            done, _ = wait(workers, timeout=min(_STEP, max(0.0, deadline - time.monotonic())))
        for worker in done:
            worker.result()  # the first error raises; the threads still in a request are left to end
    finally:
        stop.set()
    return results  # type: ignore[return-value]
