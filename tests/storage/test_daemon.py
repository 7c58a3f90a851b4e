"""The one pool of daemon threads (``storage/daemon.py``): stage threads and the store's
parallel requests both run on it."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from remote_loader.storage.daemon import DaemonPool, in_daemon_thread, map_on_daemon_threads, wait_result


def test_results_come_in_the_items_order_on_threads_of_the_given_name():
    names: set[str] = set()

    def call(item: int) -> int:
        names.add(threading.current_thread().name)
        return item * item

    assert map_on_daemon_threads(call, list(range(20)), 4, "remote-loader-test") == [i * i for i in range(20)]
    assert names == {"remote-loader-test"}


def test_after_a_failure_no_other_item_starts_and_a_hung_call_does_not_hold_the_error():
    started: list[int] = []
    release = threading.Event()

    def call(item: int) -> int:
        started.append(item)
        if item == 0:
            raise ValueError("item 0 is bad")
        if item == 1:
            release.wait(10)  # a request to a store that stopped answering
        return item

    try:
        with pytest.raises(ValueError, match="item 0 is bad"):
            map_on_daemon_threads(call, list(range(10)), 2)
        assert 0 in started and set(started) <= {0, 1}  # no thread took another item
    finally:
        release.set()


def test_a_pool_skips_a_future_cancelled_before_its_turn_and_its_threads_end():
    pool = DaemonPool(1, "remote-loader-test", numbered=True)
    gate = threading.Event()
    first = pool.submit(gate.wait, 10)
    second = pool.submit(lambda: "ran")
    assert second.cancel()
    gate.set()
    assert first.result(10) is True
    pool.shutdown(join=10)
    assert second.cancelled()
    assert not [t for t in threading.enumerate() if t.name == "remote-loader-test_0"]


@pytest.mark.parametrize("cancelled", [False, True], ids=["ran", "cancelled"])
def test_an_idle_thread_keeps_nothing_of_its_last_task(cancelled):
    """A thread waiting for its next task holds no reference to the last one's call or
    arguments, run or skipped as cancelled: they may be a range's buffer or a sample."""
    import gc
    import time
    import weakref

    class Big:
        def __call__(self, *args):
            return None

    pool = DaemonPool(1, "remote-loader-test")
    try:
        gate = threading.Event()
        blocker = pool.submit(gate.wait, 300)
        call, argument = Big(), Big()
        task = pool.submit(call, argument)
        gone = [weakref.ref(call), weakref.ref(argument)]
        if cancelled:
            assert task.cancel()
        del call, argument, task
        gate.set()
        assert blocker.result(300)
        deadline = time.monotonic() + 30  # a guard against a leak, not a time to meet
        while any(ref() is not None for ref in gone):
            assert time.monotonic() < deadline, "the idle thread still holds its last task"
            gc.collect()
            time.sleep(0.01)
    finally:
        pool.shutdown(join=10)


class _Failed(Exception):
    made: list[weakref.ref[_Failed]] = []

    def __init__(self) -> None:
        super().__init__("no")
        _Failed.made.append(weakref.ref(self))


def _fail() -> None:
    raise _Failed()


def test_a_call_that_failed_in_a_daemon_thread_leaves_nothing_to_the_garbage_collector():
    # The future held the error, whose traceback held the thread's frame, which held the
    # future: a failed request's frames (and what they held) lived until the collector ran.
    gc.disable()
    try:
        future = in_daemon_thread(_fail, "remote-loader-test-failing")
        with pytest.raises(_Failed):
            wait_result(future)
        for thread in threading.enumerate():
            if thread.name == "remote-loader-test-failing":
                thread.join(60)
        del future
        assert _Failed.made[-1]() is None
    finally:
        gc.enable()
