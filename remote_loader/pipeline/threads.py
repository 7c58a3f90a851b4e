"""Run a function over a stream of samples on threads, keeping the input order.

For work that releases the GIL (libjpeg-turbo through simplejpeg, Pillow's decode and
resize, torch ops): one process fills several cores with one client, one manifest and one
set of buffers. At most ``2 x threads`` samples are in flight, so memory stays bounded.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from remote_loader.storage.daemon import wait_result

_JOIN_SECONDS = 1.0
"""How long shutting a stage down waits for its threads; one still in user code after
that is left behind (a daemon thread: it never holds up the interpreter's exit)."""


def describe(sample: Any, position: int) -> str:
    """Where a sample came from, for error messages: its key and shard when it still has them."""
    if isinstance(sample, dict) and "__key__" in sample:
        return f"sample {sample['__key__']!r} of {sample.get('__shard__', 'an unknown shard')}"
    return f"item {position} of this worker's stream"


def name_failure(error: BaseException, where: str) -> None:
    """Add to an exception which sample it was working on, keeping its type."""
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(f"while processing {where}")


def apply(fn: Callable[[Any], Any], samples: Iterable[Any]) -> Iterator[Any]:
    """``fn`` over ``samples`` in this thread; a failure names its sample."""
    for position, sample in enumerate(samples):
        try:
            result = fn(sample)
        except Exception as error:
            name_failure(error, describe(sample, position))
            raise
        yield result


class _DaemonPool:
    """Threads that run ``fn(sample)`` for futures. Unlike ``ThreadPoolExecutor``'s, they
    are daemon threads that nothing joins without a bound, so a user function that never
    returns cannot keep Ctrl-C from ending the loop or the interpreter from exiting."""

    def __init__(self, threads: int) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[Any], Any], Any] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"remote-loader-stage_{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[Any], Any], sample: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._tasks.put((future, fn, sample))
        return future

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, fn, sample = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(sample))
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                future.set_exception(error)
            del task, future, sample

    def shutdown(self) -> None:
        """Stop the threads: those between samples end at once; one in user code is given
        about a second, then left to end by itself."""
        for _ in self._threads:
            self._tasks.put(None)
        deadline = time.monotonic() + _JOIN_SECONDS
        for thread in self._threads:
            if thread is not threading.current_thread():  # the last reference may go in a stage thread
                thread.join(max(0.0, deadline - time.monotonic()))


def threaded_map(fn: Callable[[Any], Any], samples: Iterable[Any], threads: int) -> Iterator[Any]:
    """``fn`` over ``samples`` on ``threads`` threads, results in input order.

    An exception in ``fn`` is raised here, at its sample's turn, naming the sample. The
    threads end when the iteration ends, fails or is abandoned (closed or collected); a
    thread stuck in ``fn`` is not waited for longer than about a second.
    """
    pool = _DaemonPool(threads)
    pending: deque[tuple[str, Future[Any]]] = deque()

    def take() -> Any:
        where, future = pending.popleft()
        try:
            return wait_result(future)
        except Exception as error:
            name_failure(error, where)
            raise

    try:
        for position, sample in enumerate(samples):
            pending.append((describe(sample, position), pool.submit(fn, sample)))
            if len(pending) >= 2 * threads:
                yield take()
        while pending:
            yield take()
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown()


class InFlight:
    """Where each sample inside a pipeline came from, by id: an error in a later stage, whose
    items are tuples or tensors without a key, still names its sample. Bounded by what the
    pipeline holds (the shuffle buffer, threads in flight, a partial batch)."""

    def __init__(self) -> None:
        self._where: dict[Any, Any] = {}  # id -> the sample dict's key and shard, formatted on failure only

    def entering(self, pairs: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        for i, item in pairs:
            if isinstance(item, dict) and "__key__" in item:
                self._where[i] = (item["__key__"], item.get("__shard__"))
            yield i, item

    def left(self, ids: Any) -> None:
        """Forget samples delivered or dropped (an id, or a batch's list of ids)."""
        if isinstance(ids, list):
            for i in ids:
                self.left(i)
        else:
            self._where.pop(ids, None)

    def name(self, ids: Any) -> str | None:
        first = ids
        while isinstance(first, list) and first:
            first = first[0]
        where = self._where.get(first)
        return None if where is None else describe({"__key__": where[0], "__shard__": where[1]}, 0)
