"""``kept.Kept``, the package's one cache: an LRU whose values are made once however
many threads ask at once, kept by a forked child, not by a pickled copy."""

from __future__ import annotations

import gc
import os
import pickle
import threading
import time
import weakref

import pytest

from remote_loader.kept import Kept


def test_threads_asking_while_a_value_is_made_get_that_value_made_once():
    kept: Kept[str, int] = Kept(2)
    started, release, calls = threading.Event(), threading.Event(), []

    def make() -> int:
        calls.append(1)
        started.set()
        release.wait()
        return 7

    got: list[int] = []
    first = threading.Thread(target=lambda: got.append(kept.get("a", make)))
    first.start()
    started.wait()  # "a" is being made: whoever asks now waits for it, or finds it kept
    assert kept.known("a") and kept.cached("a") is None
    others = [threading.Thread(target=lambda: got.append(kept.get("a", make))) for _ in range(3)]
    for thread in others:
        thread.start()
    release.set()
    for thread in [first, *others]:
        thread.join()
    assert got == [7, 7, 7, 7] and len(calls) == 1


def test_a_failed_make_is_raised_and_the_next_ask_makes_it_again():
    kept: Kept[str, int] = Kept(2)

    def fails() -> int:
        raise OSError("unreachable")

    with pytest.raises(OSError, match="unreachable"):
        kept.get("a", fails)
    assert not kept.known("a") and kept.get("a", lambda: 7) == 7


def test_the_least_recently_used_is_forgotten_first():
    kept: Kept[int, int] = Kept(2)
    for key in (1, 2):
        kept.get(key, lambda key=key: key * 10)
    kept.get(1, lambda: -1)  # used: 2 is now the oldest
    kept.get(3, lambda: 30)
    assert kept.cached(1) == 10 and kept.cached(2) is None and kept.cached(3) == 30


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_keeps_the_values_and_a_pickled_copy_starts_empty():
    kept: Kept[str, int] = Kept(4)
    kept.get("a", lambda: 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the value made before the fork, and a lock of its own
        os.write(write, bytes([kept.cached("a") or 0, kept.get("b", lambda: 2)]))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == bytes([1, 2])
    copy = pickle.loads(pickle.dumps(kept))
    assert copy.keep == 4 and copy.cached("a") is None and len(copy) == 0


class _Failed(Exception):
    """A failure whose end can be watched: each one made is noted by a weak reference."""

    made: list[weakref.ref[_Failed]] = []

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        _Failed.made.append(weakref.ref(self))


def _fail() -> int:
    raise _Failed("no")


def test_a_failed_make_leaves_nothing_to_the_garbage_collector():
    # The flight's Future held the error, whose traceback held the frame that held the
    # Future: every failed make (an index GET cancelled by an abandoned pass) kept its frames,
    # and what they held, until the garbage collector ran.
    kept: Kept[str, int] = Kept(2)
    gc.disable()
    try:
        try:
            kept.get("a", _fail)
        except _Failed:
            pass
        assert _Failed.made[-1]() is None  # freed with its last reference, the except block's
    finally:
        gc.enable()


def test_a_make_that_failed_while_another_thread_waited_leaves_nothing_to_the_garbage_collector():
    # The waiting thread raised the flight's error from the Future, which its frame held and
    # the error's traceback held that frame: a cycle kept until the garbage collector ran.
    kept: Kept[str, int] = Kept(2)
    failing, errors = threading.Event(), []

    def make() -> int:
        failing.wait(60)
        raise _Failed("no")

    def get() -> None:
        try:
            kept.get("a", make)
        except _Failed as error:
            errors.append(weakref.ref(error))

    gc.disable()
    try:
        maker = threading.Thread(target=get)
        maker.start()
        while not kept.known("a"):  # the flight is open: the maker is in make()
            time.sleep(0)
        waiter = threading.Thread(target=get)
        waiter.start()
        flight = kept._making["a"]
        while not flight._condition._waiters:  # the waiter waits on the flight (no timing: its state)
            time.sleep(0)
        del flight
        failing.set()
        maker.join()
        waiter.join()
        assert len(errors) == 2 and all(ref() is None for ref in errors)
    finally:
        gc.enable()
