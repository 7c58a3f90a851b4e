"""Threads for requests to a store that may stop answering.

They are daemon threads, which the interpreter does not join at exit: Ctrl-C ends the
process at once, whatever a hung request still waits for. Not ``ThreadPoolExecutor``,
whose threads the interpreter joins at exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_STEP = 0.5


def wait_result(future: Future[T]) -> T:
    """``future.result()``, waited for in steps of 0.5 s. A wait without a timeout can miss
    Ctrl-C: a SIGINT that lands as the thread is about to block is handled only once the
    wait ends, which for a request to a hung store is its read timeout."""
    while not future.done():
        wait([future], timeout=_STEP)
    try:
        return future.result()
    finally:
        del future  # a failed call's error, raised here, holds this frame: it must not hold the future


def in_daemon_thread(call: Callable[[], T], name: str = "remote-loader-request") -> Future[T]:
    """Run ``call`` in a daemon thread of its own; its outcome in the future."""
    future: Future[T] = Future()
    threading.Thread(target=_run, args=(future, call), name=name, daemon=True).start()
    return future


def _run(future: Future[T], call: Callable[[], T]) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)
    del future, call  # the error's traceback holds this frame: it must not hold the future, which holds the error


class DaemonPool:
    """Threads that run calls for futures, in the order submitted. Unlike
    ``ThreadPoolExecutor``'s they are daemon threads that nothing joins without a bound, so
    a call that never returns (a hung store, a user function) cannot keep Ctrl-C from ending
    a loop or the interpreter from exiting. A future cancelled before its turn is skipped.

    Args:
        threads: How many.
        name: The threads' name; with ``numbered``, ``name_0``, ``name_1``...
    """

    def __init__(self, threads: int, name: str, numbered: bool = False) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}" if numbered else name, daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, call: Callable[..., R], *args: Any) -> Future[R]:
        future: Future[R] = Future()
        self._tasks.put((future, call, args))
        return future

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, call, args = task
            del task
            if future.set_running_or_notify_cancel():  # False: cancelled before its turn, skipped
                try:
                    future.set_result(call(*args))
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(error)
            del future, call, args  # waiting for the next task, hold nothing of this one

    def shutdown(self, join: float = 0.0) -> None:
        """Stop the threads: those between calls end at once; those in a call are waited for
        ``join`` seconds in all, then left to end by themselves."""
        for _ in self._threads:
            self._tasks.put(None)
        deadline = time.monotonic() + join
        for thread in self._threads:
            if thread is not threading.current_thread():  # the last reference may go in a pool thread
                thread.join(max(0.0, deadline - time.monotonic()))


def map_on_daemon_threads(call: Callable[[T], R], items: Sequence[T], threads: int,
                          name: str = "remote-loader-request", *, settle: float = 0.0) -> list[R]:
    """``[call(item) for item in items]``, up to ``threads`` at once on a ``DaemonPool``.

    Once a call fails, or the caller is interrupted (Ctrl-C), no other item starts; the
    caller gets the error (the first item's that failed) once the calls already started have
    ended, or ``settle`` seconds after it, whichever comes first (0: at once; Ctrl-C never
    waits): a call stuck on a hung store does not hold the error back longer than that.
    """
    if len(items) <= 1 or threads <= 1:
        return [call(item) for item in items]
    stop = threading.Event()

    def one(item: T) -> R | None:
        if stop.is_set():  # a call failed, or the caller was interrupted: the rest never start
            return None
        try:
            return call(item)
        except BaseException:
            stop.set()
            raise

    pool = DaemonPool(min(threads, len(items)), name)
    futures = [pool.submit(one, item) for item in items]
    try:
        done: set[Future[R | None]] = set()
        while len(done) < len(futures) and not any(f.exception() is not None for f in done):
            done, _ = wait(futures, timeout=_STEP, return_when=FIRST_EXCEPTION)  # in steps, as wait_result
        for future in futures:
            future.cancel()  # those not yet started
        deadline = time.monotonic() + settle
        running = [f for f in futures if not f.cancelled()]
        while not all(f.done() for f in running) and time.monotonic() < deadline:
            wait(running, timeout=min(_STEP, max(0.0, deadline - time.monotonic())))
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()  # the first error raises; the threads still in a call are left to end
        return [future.result() for future in futures]  # type: ignore[misc]  # no call failed: none skipped
    finally:
        stop.set()
        for future in futures:
            future.cancel()
        pool.shutdown()
