"""Run a function over a stream of samples on threads, keeping the input order.

For work that releases the GIL (libjpeg-turbo through simplejpeg, Pillow's decode and
resize, torch ops): one process fills several cores with one client, one manifest and one
set of buffers. At most ``2 x threads`` samples are in flight, so memory stays bounded.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from remote_loader.storage.daemon import DaemonPool, wait_result

_JOIN_SECONDS = 1.0
"""How long shutting a stage down waits for its threads; one still in user code after
that is left behind (a daemon thread: it never holds up the interpreter's exit)."""


ITEM = "_remote_loader_item"
"""The attribute an exception raised on an item without a key gets: the item's number in
its stage's input, from which the pipeline names the sample it came from."""


def describe(sample: Any) -> str | None:
    """Where a sample came from, for error messages, when it still says: its key and shard."""
    if isinstance(sample, dict) and "__key__" in sample:
        return f"sample {sample['__key__']!r} of {sample.get('__shard__', 'an unknown shard')}"
    return None


def name_failure(error: BaseException, sample: Any, position: int) -> None:
    """Add to an exception which sample it was working on, keeping its type: its key and
    shard when it has them, else its number in the stage's input (``ITEM``)."""
    where = describe(sample)
    if where is None:
        if not hasattr(error, ITEM):
            with contextlib.suppress(AttributeError, TypeError):  # an exception without a __dict__
                setattr(error, ITEM, position)
        return
    note(error, f"while processing {where}")


def note(error: BaseException, text: str) -> None:
    """Add ``text`` to an exception's notes, once (Python 3.11 and later have notes)."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None and text not in getattr(error, "__notes__", []):
        add_note(text)


def apply(fn: Callable[[Any], Any], samples: Iterable[Any]) -> Iterator[Any]:
    """``fn`` over ``samples`` in this thread; a failure names its sample."""
    for position, sample in enumerate(samples):
        try:
            result = fn(sample)
        except Exception as error:
            name_failure(error, sample, position)
            raise
        yield result


def threaded_map(fn: Callable[[Any], Any], samples: Iterable[Any], threads: int) -> Iterator[Any]:
    """``fn`` over ``samples`` on ``threads`` threads, results in input order.

    An exception in ``fn`` is raised here, at its sample's turn, naming the sample. The
    threads end when the iteration ends, fails or is abandoned (closed or collected); a
    thread stuck in ``fn`` is not waited for longer than about a second.
    """
    pool = DaemonPool(threads, "remote-loader-stage", numbered=True)
    pending: deque[tuple[Any, int, Future[Any]]] = deque()

    def take() -> Any:
        sample, position, future = pending.popleft()
        try:
            return wait_result(future)
        except Exception as error:
            name_failure(error, sample, position)
            raise
        finally:
            del future  # a failure's traceback holds this frame: it must not hold the future, which holds the error

    try:
        for position, sample in enumerate(samples):
            pending.append((sample, position, pool.submit(fn, sample)))
            if len(pending) >= 2 * threads:
                yield take()
        while pending:
            yield take()
    finally:
        for _, _, future in pending:
            future.cancel()
        pool.shutdown(join=_JOIN_SECONDS)  # a thread stuck in fn is given about a second
