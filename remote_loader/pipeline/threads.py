"""Run a function over a stream of samples on threads, keeping the input order.

For work that releases the GIL (libjpeg-turbo through simplejpeg, Pillow's decode and
resize, torch ops): one process fills several cores with one client, one manifest and one
set of buffers. At most ``2 x threads`` samples are in flight, so memory stays bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


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


def threaded_map(fn: Callable[[Any], Any], samples: Iterable[Any], threads: int) -> Iterator[Any]:
    """``fn`` over ``samples`` on ``threads`` threads, results in input order.

    An exception in ``fn`` is raised here, at its sample's turn, naming the sample. The
    threads end when the iteration ends, fails or is abandoned (closed or collected).
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix="remote-loader-stage")
    pending: deque[tuple[str, Future[Any]]] = deque()

    def take() -> Any:
        where, future = pending.popleft()
        try:
            return future.result()
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
        pool.shutdown(wait=True, cancel_futures=True)  # waits only for the samples being processed now
