"""The upload's worker processes: a dataset that runs torch in the upload's process before
they fork works in them, and a worker that stops making progress is reported, named, and
ended, never waited on for ever."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from remote_loader import DatasetReader, UploadError, restore
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import WaitingPath, alive, the_other_task, upload

ROOT = Path(__file__).resolve().parents[2]

TO_TENSOR = textwrap.dedent("""
    import multiprocessing
    import numpy as np
    import torch
    from remote_loader import make_client, upload_cv_dataset


    class ToTensorImages:
        '''What a torchvision dataset with ToTensor() hands over: float CHW tensors in [0, 1].'''

        def __len__(self):
            return 16

        def __getitem__(self, index):
            pixels = np.random.default_rng(index).integers(0, 256, (224, 224, 3), dtype=np.uint8)
            return torch.from_numpy(pixels).permute(2, 0, 1).float().div(255), index % 3


    if __name__ == "__main__":
        multiprocessing.set_start_method("fork")
        torch.set_num_threads(2)  # torch's thread pool, as on any machine of several cores
        upload_cv_dataset(ToTensorImages(), client=make_client(), bucket={bucket!r}, base_folder="tensors",
                          workers=2, maxcount=4, progress=False)
""")


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_a_dataset_that_ran_torch_before_the_workers_forked_uploads_with_workers(seaweed, s3, tmp_path):
    """The upload's process reads ``ds[i]`` first (its fingerprint), which starts torch's
    thread pool; the workers it forks then ran ``ds[i]`` too, whose first parallel torch op
    waited for ever. In a process of its own, so that a hang fails the test at a bound."""
    client, bucket = s3
    script = tmp_path / "upload.py"
    script.write_text(TO_TENSOR.format(bucket=bucket))
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=ROOT, start_new_session=True, capture_output=True,
                              env={**os.environ, **seaweed.env(), "PYTHONPATH": str(ROOT)}, timeout=240)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the upload hung: {(expired.stderr or b'').decode()[-2000:]}")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = {int(s["__key__"]): restore(s) for s in DatasetReader(client, bucket, "tensors")}
    assert sorted(got) == list(range(16))
    for index, (tensor, label) in got.items():
        pixels = np.random.default_rng(index).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        expected = torch.from_numpy(pixels).permute(2, 0, 1).float().div(255)
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and label == index % 3
        assert torch.equal(tensor, expected)  # the floats themselves, not 8-bit pixels made of them


TORCH_FREE = textwrap.dedent("""
    import multiprocessing, os, sys
    from pathlib import Path
    from remote_loader import make_client, upload_cv_dataset
    from remote_loader.testing.synthetic import SyntheticImages


    class TorchFree(SyntheticImages):
        '''Notes, in each worker, whether torch was imported there.'''

        def __getitem__(self, index):
            if multiprocessing.parent_process() is not None:
                Path({out!r}, str(os.getpid())).write_text(str("torch" in sys.modules))
            return super().__getitem__(index)


    if __name__ == "__main__":
        multiprocessing.set_start_method("spawn")
        upload_cv_dataset(TorchFree(16, size=(16, 12)), client=make_client(), bucket={bucket!r}, base_folder="free",
                          workers=2, maxcount=4, progress=False)
""")


def test_a_dataset_without_torch_brings_no_torch_into_the_workers(seaweed, s3, tmp_path):
    """Torch's threads are set in a worker only where the dataset brought torch in: spawned
    workers of a dataset that never imports it do not import it for nothing."""
    _, bucket = s3
    out = tmp_path / "workers"
    out.mkdir()
    script = tmp_path / "upload.py"
    script.write_text(TORCH_FREE.format(out=str(out), bucket=bucket))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, start_new_session=True, capture_output=True,
                          env={**os.environ, **seaweed.env(), "PYTHONPATH": str(ROOT)}, timeout=240)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    notes = [path.read_text() for path in out.iterdir()]
    assert notes and set(notes) == {"False"}


class StallingImages(SyntheticImages):
    """Synthetic images whose item ``stall_at`` does not return when a task reads it (in a
    worker process, or on a task's thread here): it writes its process id to ``pid_file``,
    then waits on ``release``, which nothing sets in a worker (the test sets it here as it
    ends, and the item then fails). With ``after=(i, j)``, item ``i``'s image is a path that
    is ready only once item ``j`` was read (``ds[i]`` returns at once; the path waits as the
    item is encoded): a task's items read before another task's item stalls and holds up the
    process's turns at ``ds[i]``."""

    def __init__(self, n: int, stall_at: int, pid_file: Path, after: tuple[int, int] | None = None,
                 **kwargs) -> None:
        super().__init__(n, **kwargs)
        self.stall_at, self.pid_file, self.release = stall_at, pid_file, threading.Event()
        self.after, self.read = after, threading.Event()

    def __getitem__(self, index):
        if threading.current_thread().name.startswith("remote-loader-task"):
            if index == self.stall_at:
                self.pid_file.write_text(str(os.getpid()))
                self.release.wait()
                raise RuntimeError("released")
            if self.after is not None and index == self.after[0]:
                image = self.pid_file.with_name(f"{index}.png")
                self.image(index).save(image)
                return WaitingPath(lambda: self.read.wait(60), image), self.label(index)
            if self.after is not None and index == self.after[1]:
                self.read.set()
        return super().__getitem__(index)


def test_a_worker_that_stops_making_progress_is_named_then_ended_and_the_rest_kept(s3, tmp_path, caplog):
    """Four tasks of four items on one worker process, two at a time: item 13 (task 3) never
    returns. The warning and the error name it and the worker; the task beside it, which read
    its last item before ds[13] began, finishes, the worker is ended, and a re-run keeps the
    three finished tasks."""
    client, bucket = s3
    pid_file = tmp_path / "pid"
    stalling = StallingImages(16, 13, pid_file, after=(12, 11), size=(16, 12))
    with caplog.at_level(logging.WARNING, logger="remote_loader"), \
            pytest.raises(UploadError, match=r"ds\[13\] took more than stall_timeout=10 s in worker process"
                                             r" (\d+) \(task 3\)") as error:
        upload(client, bucket, "stalled", stalling, workers=1, maxcount=4, shuffle=False, stall_timeout=10)
    pid = int(pid_file.read_text())
    assert error.value.index == 13 and f"worker process {pid} " in str(error.value)
    assert "finished tasks are kept" in str(error.value) and "\n" not in str(error.value)
    assert any("ds[13] has taken " in r.getMessage() and f"worker process {pid}" in r.getMessage()
               for r in caplog.records)
    assert not alive(pid)
    summary = upload(client, bucket, "stalled", SyntheticImages(16, size=(16, 12)), workers=1, maxcount=4,
                     shuffle=False)
    assert (summary.kept_samples, summary.uploaded_samples) == (12, 4)


def test_an_item_that_stalls_in_this_process_is_named_and_left_behind(s3, tmp_path):
    client, bucket = s3
    stalling = StallingImages(8, 5, tmp_path / "pid", size=(16, 12))
    try:
        with pytest.raises(UploadError, match=r"ds\[5\] took more than stall_timeout=10 s in this process"
                                              r" \(task 1\): .* its thread is left to end by itself"):
            upload(client, bucket, "here", stalling, workers=0, maxcount=4, shuffle=False, stall_timeout=10)
        assert int((tmp_path / "pid").read_text()) == os.getpid()
    finally:
        stalling.release.set()  # the thread left behind ends (its task fails)


@pytest.mark.parametrize("value", [0, -1, "10", True])
def test_a_stall_timeout_that_is_no_number_of_seconds_is_refused(s3, value):
    client, bucket = s3
    from remote_loader import ConfigError

    with pytest.raises(ConfigError, match="stall_timeout must be a number of seconds > 0, or None"):
        upload(client, bucket, "refused", SyntheticImages(4, size=(8, 8)), stall_timeout=value)


@pytest.mark.parametrize("processes", [False, True])
def test_a_row_of_the_watch_caught_half_written_is_no_stall(processes, monkeypatch):
    """A task thread takes a row of the watch's table with one store a field, its process id
    first. Caught between those stores, the row once read as item 0 read since the clock's
    zero (the machine's uptime: hours), and ended a healthy upload as stalled. A row is now
    free as "between items", and the watch reads the table only while no row is being taken
    or freed."""
    import multiprocessing

    from remote_loader.upload import watch as watching
    from remote_loader.upload.watch import Slots, Watch

    monkeypatch.setattr(watching, "_READ_LOCK_SECONDS", 0.05, raising=False)

    slots = Slots(2, multiprocessing.get_context("spawn") if processes else None)
    watch = Watch(slots, stall_timeout=600)
    slots.table[1, 0] = 4242.0  # the first store of a row being taken, on a table fresh or freed
    assert watch.check() is None and not watch.stalled
    with slots.task(7):
        pass  # a task that took row 0 and freed it
    slots.table[0, 0] = 4343.0
    assert watch.check() is None and not watch.stalled
    slots.table[:] = 0.0  # as the table was before: each row's index read as item 0
    with slots._lock:  # a row being written: the watch skips this look, and waits for no task
        slots.table[1, 0] = 4242.0
        assert watch.check() is None and not watch.stalled and not watch.busy()


def _until(condition: Any) -> None:
    for _ in range(6000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("never came")


def _waiting_for_turn(slots: Any, turn: threading.Lock, stop: threading.Event) -> tuple[threading.Thread, list[Any]]:
    """A task thread whose item ds[10] waits for its turn (held by the caller): what came of it
    goes in the list ("ds[10] called", or the Cancelled that stopped it)."""
    from remote_loader.storage.retrying import Cancelled

    outcome: list[Any] = []

    def waiting_task() -> None:
        with slots.task(0, turn, stop) as reading, reading.item(10):
            try:
                with reading.turn():
                    outcome.append("ds[10] called")
            except Cancelled as error:
                outcome.append(error)

    thread = threading.Thread(target=waiting_task, daemon=True)
    thread.start()
    return thread, outcome


def test_an_item_waiting_for_its_turn_behind_a_stuck_one_is_neither_named_nor_waited_for():
    """A process's two task threads call ds[i] in turns. Where ds[13] never returns, the other
    task's item ds[10], begun first, waits for its turn: the watch named ds[10] as the stalled
    item, and, told that a waiting item reads nothing, waited for that task for ever. The item
    in ds[i] is named; the one waiting for it is not waited for, and stops when told to."""
    from remote_loader.storage.retrying import Cancelled
    from remote_loader.upload.watch import Slots, Watch

    slots, turn, stop = Slots(2), threading.Lock(), threading.Event()
    turn.acquire()  # ds[13] has the turn
    thread, outcome = _waiting_for_turn(slots, turn, stop)
    try:
        _until(lambda: (slots.table[:, 4] == 1).any())  # ds[10] began, and waits for its turn
        with slots.task(1, turn, stop) as reading, reading.item(13):
            watch = Watch(slots, stall_timeout=1e-9)
            stalled = watch.check()
            assert stalled is not None and (stalled.index, stalled.task) == (13, 1)
            assert watch.check() is None  # ds[10]: never named while it waits
            assert not watch.busy()  # ds[10] waits for a stalled item: nothing will come of it
            stop.set()
            thread.join(60)
        assert [type(error) for error in outcome] == [Cancelled]
    finally:
        stop.set()


def test_an_item_s_time_starts_with_its_turn_at_ds_getitem():
    """An item that waited for its turn is timed from when the turn came, not from when it
    began to wait: a long wait behind a slow ds[i] is no stall of its own."""
    from remote_loader.upload.watch import Slots, Watch

    slots, turn, stop = Slots(2), threading.Lock(), threading.Event()
    turn.acquire()
    turned, done = threading.Event(), threading.Event()

    def waiting_task() -> None:
        with slots.task(0, turn, stop) as reading, reading.item(10), reading.turn():
            turned.set()
            done.wait(60)

    thread = threading.Thread(target=waiting_task, daemon=True)
    thread.start()
    try:
        _until(lambda: (slots.table[:, 4] == 1).any())
        slots.table[0, 3] -= 3600.0  # as if ds[10] had waited an hour
        assert Watch(slots, stall_timeout=600).check() is None
        turn.release()
        assert turned.wait(60)
        assert Watch(slots, stall_timeout=600).check() is None
        assert slots.table[0, 4] == 0 and slots.table[0, 2] == 10
    finally:
        stop.set()
        done.set()
        thread.join(60)


def test_an_item_whose_turn_comes_once_its_task_was_told_to_stop_is_not_read():
    """The item waiting behind a stalled ds[i] waits until its task is told to stop (the upload
    has ended). Where the stalled ds[i] returned at last as it waited, the item took the turn
    and called ds[i] after the upload had ended, beside the caller's next use of the dataset.
    It stops instead."""
    from remote_loader.storage.retrying import Cancelled
    from remote_loader.upload.watch import Slots

    slots, turn, stop = Slots(2), threading.Lock(), threading.Event()
    turn.acquire()  # ds[13] has the turn
    thread, outcome = _waiting_for_turn(slots, turn, stop)
    try:
        _until(lambda: (slots.table[:, 4] == 1).any())  # ds[10] waits for its turn
        stop.set()  # the upload ended, naming ds[13]
        turn.release()  # then ds[13] returned
        thread.join(60)
        assert [type(o) for o in outcome] == [Cancelled]
        assert turn.acquire(blocking=False)  # the turn was given back
    finally:
        stop.set()


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_an_item_stopped_as_it_waits_for_its_turn_is_neither_skipped_nor_an_error_of_the_item(tmp_path, on_error):
    """A task told to stop while its item waits for its turn at ds[i] (the other task's ds[i]
    stalled, or Ctrl-C) stops there. The stop was taken for an error of ds[i] itself: with
    on_error="skip", the task's last item was skipped and its record written, and a re-run
    kept the task without that item ("ds[3] raised Cancelled"); with "raise", the item was
    named as one that failed."""
    from remote_loader.errors import OnError
    from remote_loader.storage import Location
    from remote_loader.storage.local import LocalStore
    from remote_loader.storage.retrying import Cancelled
    from remote_loader.upload.encode import EncodeOptions
    from remote_loader.upload.tasks import TaskSpec, task_record_key, write_task
    from remote_loader.upload.watch import Slots

    store = LocalStore(tmp_path)
    store.create_bucket("b")
    location = Location("b", "d", store.path_of("b", "d"))
    spec = TaskSpec(store=store, location=location, options=EncodeOptions(), maxsize=1 << 30, maxcount=10,
                    on_error=OnError.of(on_error), part_size=16 << 20, key_width=2, run="r")
    slots, turn, stop = Slots(2), threading.Lock(), threading.Event()
    outcome: list[Any] = []

    def task() -> None:
        try:
            outcome.append(write_task(spec, 0, [3], SyntheticImages(4, size=(16, 12)), stop=stop, slots=slots,
                                      turn=turn))
        except BaseException as error:  # noqa: BLE001  # the test's own thread: whatever it raised, seen below
            outcome.append(error)

    turn.acquire()  # the other task's ds[i] has the turn, and keeps it
    thread = threading.Thread(target=task, daemon=True)
    thread.start()
    try:
        _until(lambda: (slots.table[:, 4] == 1).any())  # ds[3] waits for its turn
        stop.set()
        thread.join(60)
        assert [type(o) for o in outcome] == [Cancelled]
        assert not store.exists("b", task_record_key(location, "r", 0))
    finally:
        stop.set()


class CrashingImages(SyntheticImages):
    """Synthetic images whose item ``crash_at`` ends the worker process that reads it, by
    ``signal`` (a crash in a native library) or by ``os._exit`` (None); read here, it returns.
    With ``hold``, that item, read in a worker, waits for good as it is encoded, and
    ``crash_at`` crashes as it is encoded once the other is waiting: the process then dies
    reading both (``ds[i]`` itself is called by one thread at a time). With
    ``beside_waiting=(j, folder)``, ``crash_at`` crashes inside ``ds[i]`` once the other task
    waits for its turn: that task's item ``j``, read in a worker, is encoded only once
    ``ds[crash_at]`` has begun (its image a file in ``folder``), so that task cannot have read
    all its items first and still reads one beside it."""

    def __init__(self, n: int, crash_at: int, signal: int | None, hold: int | None = None,
                 beside_waiting: tuple[int, Path] | None = None, **kwargs) -> None:
        super().__init__(n, **kwargs)
        self.crash_at, self.signal, self.hold, self.held = crash_at, signal, hold, threading.Event()
        self.beside_waiting, self.crashing = beside_waiting, threading.Event()

    def __getitem__(self, index):
        if __import__("multiprocessing").parent_process() is not None:
            if index == self.hold:
                return WaitingPath(self._hold), 0
            if self.beside_waiting is not None and index == self.beside_waiting[0]:
                image = self.beside_waiting[1] / f"{index}.png"
                self.image(index).save(image)
                return WaitingPath(lambda: self.crashing.wait(60), image), self.label(index)
            if index == self.crash_at:
                if self.hold is not None:
                    return WaitingPath(self._crash), 0
                if self.beside_waiting is not None:
                    self.crashing.set()
                    assert the_other_task(threading.current_thread()) == "waiting"
                self._crash()
        return super().__getitem__(index)

    def _hold(self) -> None:
        self.held.set()
        threading.Event().wait()

    def _crash(self) -> None:
        if self.hold is not None:
            assert self.held.wait(120)
        if self.signal is None:
            os._exit(3)
        os.kill(os.getpid(), self.signal)


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
@pytest.mark.parametrize(("how", "said"), [(None, "exit status 3"), (__import__("signal").SIGSEGV, "SIGSEGV"),
                                          (__import__("signal").SIGKILL, "SIGKILL")])
def test_a_worker_that_dies_reading_an_item_is_named_with_the_item(s3, how, said):
    """A worker process that ends inside ``ds[7]`` (a crash in a decoder, ``os._exit``, the
    kernel's OOM killer) ends the upload with an UploadError naming the item, the process and
    how it ended, on one line; a re-run completes it. Two tasks, one a process."""
    client, bucket = s3
    with pytest.raises(UploadError) as error:
        upload(client, bucket, "crashed", CrashingImages(8, 7, how, size=(16, 12)), workers=2, maxcount=4,
               shuffle=False)
    message = str(error.value)
    assert re.search(rf"^worker process \d+ ended \({said}\) while reading ds\[7\] \(task 1\): the item crashed"
                     r" it \(", message), message
    assert error.value.index == 7 and "\n" not in message
    assert "run the same upload again to resume" in message
    summary = upload(client, bucket, "crashed", SyntheticImages(8, size=(16, 12)), workers=2, maxcount=4,
                     shuffle=False)
    assert summary.kept_samples + summary.uploaded_samples == 8  # task 0 kept where it ended before the pool did


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_a_worker_that_dies_beside_another_task_names_both_items_it_was_reading(s3):
    """A process writes two tasks at once, on two threads: which of its items crashed it is
    not known, so both are named, and no index is given as the culprit."""
    client, bucket = s3
    with pytest.raises(UploadError) as error:
        upload(client, bucket, "crashed-two", CrashingImages(16, 7, None, hold=2, size=(16, 12)), workers=2,
               maxcount=4, shuffle=False)
    message = str(error.value)
    assert re.search(r"^worker process \d+ ended \(exit status 3\) while reading ds\[2\] \(task 0\) and"
                     r" ds\[7\] \(task 1\): one of them crashed it", message), message
    assert error.value.index is None


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_a_worker_that_dies_in_ds_getitem_names_it_not_the_item_waiting_for_its_turn(s3, tmp_path):
    """The process's other task, its item waiting for its turn at ds[i], crashed nothing: the
    item in ds[i] is named alone, and is the culprit. Task 1 (items 4 to 7) runs beside task 0
    in one worker; its first item is encoded only once ds[1] has begun."""
    client, bucket = s3
    crashing = CrashingImages(16, 1, None, beside_waiting=(4, tmp_path), size=(16, 12))
    with pytest.raises(UploadError) as error:
        upload(client, bucket, "crashed-alone", crashing, workers=2, maxcount=4, shuffle=False)
    message = str(error.value)
    assert re.search(r"^worker process \d+ ended \(exit status 3\) while reading ds\[1\] \(task 0\): the item"
                     r" crashed it", message), message
    assert error.value.index == 1



class FailsWhileAnotherStalls(SyntheticImages):
    """In the upload's workers: ds[20] (task 2's first, in the second worker's pair) never
    returns; ds[0] (task 0's first) is bad, once ds[20] is under way."""

    def __init__(self, count: int) -> None:
        super().__init__(count, size=(16, 16))
        self.stalling = multiprocessing.Event()

    def __getitem__(self, index):
        if multiprocessing.parent_process() is not None:
            if index == 20:
                self.stalling.set()
                threading.Event().wait()
            if index == 0:
                self.stalling.wait(60)
                return b"not an image", 0
        return super().__getitem__(index)


def test_tasks_cancelled_after_the_first_error_are_not_reported_as_failures(s3, caplog):
    """After the first error no other task starts: the jobs still waiting for a worker are
    cancelled, which is no failure of theirs. While another task ran on (here until its
    stall_timeout), each cancelled pair was logged as 'did not complete: the executor failed
    (CancelledError: )', 16 lines here."""
    client, bucket = s3
    with caplog.at_level(logging.WARNING, logger="remote_loader"), pytest.raises(UploadError, match="sample 0"):
        upload(client, bucket, "cancelled", FailsWhileAnotherStalls(400), maxcount=10, workers=2, shuffle=False,
               stall_timeout=2)
    assert [r.getMessage() for r in caplog.records if "after the first error" in r.getMessage()] == []


class InterruptsItsUpload(SyntheticImages):
    """In the upload's worker: ds[3] sends SIGINT to the upload's process (Ctrl-C, or ``kill
    -INT`` of it), then waits for ``release``."""

    def __init__(self, count: int) -> None:
        super().__init__(count, size=(16, 16))
        self.release = multiprocessing.Event()

    def __getitem__(self, index):
        if index == 3 and multiprocessing.parent_process() is not None:
            os.kill(os.getppid(), signal.SIGINT)
            self.release.wait(60)
        return super().__getitem__(index)


def _release_once_shutting_down(release: Any) -> None:
    """Set ``release`` once the main thread waits in a process pool's ``shutdown``."""

    def shutting_down() -> bool:
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None:
            if frame.f_code.co_name == "shutdown" and frame.f_code.co_filename.endswith("process.py"):
                return True
            frame = frame.f_back
        return False

    def watch() -> None:
        while not shutting_down():
            threading.Event().wait(0.01)
        release.set()

    threading.Thread(target=watch, daemon=True).start()


def test_after_ctrl_c_the_tasks_in_the_workers_stop_at_their_next_sample(s3):
    """Ctrl-C (here SIGINT to the upload's process alone, as ``kill -INT`` sends it): the task
    a worker is writing stops at its next sample, and the pair of tasks it has already taken
    from the pool's queue does not start. Both went on to the end, and wrote their shards
    and records, after Ctrl-C (in a run of 1,500 images, 8 tasks finished up to 2.4 s after
    it)."""
    client, bucket = s3
    ds = InterruptsItsUpload(40)  # tasks of 10, in pairs: tasks 0 and 1, then 2 and 3, for the one worker
    _release_once_shutting_down(ds.release)
    with pytest.raises(KeyboardInterrupt):
        upload(client, bucket, "interrupted", ds, maxcount=10, workers=1, shuffle=False)
    # Task 1, beside task 0, may have finished before Ctrl-C: it is not asked about.
    written = [info.key for info in client.list(bucket, "interrupted/")
               if any(f"-{task:06d}" in info.key for task in (0, 2, 3))]
    assert written == []


def test_a_task_times_its_outage_afresh_after_a_fault_earlier_on_but_not_for_ever():
    """A task is retried whole, and an attempt that got no further than the furthest did not
    restart its outage clock: a task longer than the deadline whose second fault came earlier
    on than its first gave up after two attempts, the store answering between them. It now
    restarts for an attempt the store answered for, up to three in a row that get no further
    (a fault at the same point every time), and never for one it answered nothing for."""
    from types import SimpleNamespace

    from remote_loader.upload.tasks import _Attempts

    attempts = _Attempts(None, 0)

    def failed(acknowledged: int) -> bool:
        attempts.latest = SimpleNamespace(acknowledged=acknowledged)
        return attempts.afresh()

    assert failed(3_000_000)  # further than any before
    assert failed(1_000_000)  # a fault earlier on, the store answering before it: no outage
    assert not failed(0)  # nothing answered: an outage, timed on
    assert failed(3_000_000) and failed(3_000_000)  # the same point again: afresh, up to three in a row
    assert not failed(3_000_000)  # then timed on: a fault at the same point gives up at the deadline
    assert failed(4_000_000)  # further: afresh, and the count of repeats starts again
