"""``Kept``: the one cache of the package, for what is costly to make and read again and again
(shard indexes, manifest pages, blocks of an epoch's order).

An LRU of at most ``keep`` values, thread-safe, each made once however many threads ask for
it at once (the first makes it, the others wait for it: single flight); a failure is raised
to every thread that waited and the next ask makes it again. A forked child keeps the values
made before the fork, with a lock and flights of its own (a parent thread may have held the
lock at the fork); a pickled copy starts empty.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Kept(Generic[K, V]):
    """At most ``keep`` values, the least recently used forgotten first; see the module."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._reset(OrderedDict())

    def _reset(self, values: OrderedDict[K, V]) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._values = values
        self._making: dict[K, Future[V]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.keep = state["keep"]
        self._reset(OrderedDict())

    def _own(self) -> None:
        if self._pid != os.getpid():
            self._reset(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def cached(self, key: K) -> V | None:
        """The value if it is kept, else None (nothing is made)."""
        self._own()
        with self._lock:
            return self._values.get(key)

    def known(self, key: K) -> bool:
        """Whether the value is kept or being made."""
        self._own()
        with self._lock:
            return key in self._values or key in self._making

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The value: kept, being made (waited for), or made now by ``make()``."""
        self._own()
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            making = self._making.get(key)
            mine = making is None
            if making is None:
                making = self._making[key] = Future()
        if not mine:
            error = making.exception()  # waits
            if error is None:
                return making.result()
            del making  # the error's traceback will hold this frame: neither it nor the Future may hold the error
            try:
                raise error
            finally:
                del error
        try:
            value = make()
        except BaseException as exc:
            with self._lock:
                self._making.pop(key, None)
            making.set_exception(exc)
            del making  # its error's traceback holds this frame: a cycle only the garbage collector would free
            raise
        with self._lock:
            self._making.pop(key, None)
            self._values[key] = value
            while len(self._values) > self.keep:
                self._values.popitem(last=False)
        making.set_result(value)
        return value
