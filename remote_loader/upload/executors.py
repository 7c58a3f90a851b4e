"""Where an upload's tasks run: in the caller's process, on a process pool of the upload's
own (whose workers receive the dataset once, at start), or on the caller's executor, such
as a Dask cluster's (which receives the dataset once per worker, in a worker plugin, or
built there from a source spec)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

from remote_loader.checks import one_line
from remote_loader.errors import RemoteLoaderError, UploadError
from remote_loader.format import ShardEntry
from remote_loader.storage.daemon import DaemonPool
from remote_loader.storage.retrying import Cancelled
from remote_loader.upload import tasks
from remote_loader.upload.sources import SourceSpec
from remote_loader.upload.tasks import TASKS_AT_ONCE, TaskResult, TaskSpec, write_tasks
from remote_loader.upload.verify import Checked, CheckSpec, check_tasks
from remote_loader.upload.watch import Slots, Stalled, Watch

log = logging.getLogger("remote_loader")
T = TypeVar("T")


class _BarProgress:
    """Stands in for the worker progress queue when tasks run in this process (on threads)."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.bytes = 0
        self._lock = threading.Lock()

    def put(self, item: tuple[int, int]) -> None:
        with self._lock:
            self.bytes += item[1]
            self.bar.update(item[0])
            if self.bytes:  # a check of kept items writes none
                self.bar.set_postfix_str(_rate(self.bytes, self.bar), refresh=False)

    def settle(self, nbytes: int) -> None:
        """Every task done: the bytes they wrote, whatever of the workers' last counts is still
        on its way through their queue."""
        with self._lock:
            self.bytes = nbytes
            if nbytes:
                self.bar.set_postfix_str(_rate(self.bytes, self.bar), refresh=False)


def _rate(nbytes: int, bar: tqdm) -> str:
    elapsed = max(bar.format_dict.get("elapsed", 0.0), 1e-9)
    return f"{nbytes / 1e6:.1f} MB, {nbytes / 1e6 / elapsed:.1f} MB/s"


def _ship(executor: Executor, dataset: Any, source: str | None) -> tuple[Any, str | None]:
    """What a caller's executor sends with each task so that the dataset reaches each of its
    workers once: on a Dask cluster, a token for the dataset (or its source spec, which each
    worker then builds) sent to every worker in a plugin whose name comes second, to remove
    it when the upload ends; any other executor gets the dataset itself, a source spec's as
    built in this process (its workers could keep nothing past the upload)."""
    client = getattr(executor, "_client", None)
    if _is_dask(executor) and client is not None:
        from remote_loader.upload.shipping import ship  # distributed: the dask extra

        return ship(client, SourceSpec(source) if source is not None else dataset)
    return dataset, None


def _unship(executor: Executor, plugin: str) -> None:
    """Remove the dataset's plugin from the cluster; a cluster gone by now needs nothing."""
    from remote_loader.upload.shipping import unship

    with contextlib.suppress(Exception):
        unship(getattr(executor, "_client", None), plugin)


def _is_dask(executor: Executor) -> bool:
    return type(executor).__module__.startswith("distributed")


def _result(future: Future[Any], what: str, broken: Callable[[], UploadError] | None) -> Any:
    """A job's result; its own error as it is, a failure of the executor as an UploadError
    that names the likely cause (``broken``: the upload's own pool's, which names the item a
    worker died reading)."""
    try:
        return future.result()
    except RemoteLoaderError:
        raise
    except BrokenProcessPool as exc:
        if broken is not None:
            raise broken() from exc
        raise UploadError(f"{what} did not complete: the executor's processes ended ({one_line(exc)})") from exc
    except Exception as exc:
        raise UploadError(f"{what} did not complete: the executor failed ({type(exc).__name__}: {one_line(exc)});"
                          " finished tasks are kept: run the same upload again to resume") from exc


def _broken_pool(ended: str | None = None) -> str:
    """Why the upload's own worker processes ended before finishing: under spawn or
    forkserver, most often a script that starts the upload at import, which each worker
    then runs again; otherwise a worker killed (out of memory). ``ended``: how one of them
    ended, where that is known."""
    method = multiprocessing.get_start_method()
    if method in ("spawn", "forkserver"):
        return (f"the upload's worker processes ended before finishing their tasks. With the {method!r} start method"
                " (the default on macOS and Windows) each worker imports your main script again: if the script starts"
                " the upload at import, every worker tries to start one too and fails. Put the code that starts the"
                ' upload under `if __name__ == "__main__":` (see the worker errors above), or pass workers=0')
    how = ended or "one was killed: out of memory, or a signal"
    return (f"the upload's worker processes ended before finishing their tasks ({how}); finished tasks are kept: run"
            " the same upload again to resume, with fewer workers if memory ran out")


def _how(code: int) -> str:
    """A process's exit code in words: ``SIGSEGV``, ``exit status 3``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def task_groups(pending: list[T], processes: int) -> list[list[T]]:
    """The tasks as submitted: in pairs, written at once by one process, where there are
    enough to keep every process busy; one at a time otherwise, so that no process is idle
    while another holds two (their encoding shares one GIL)."""
    size = max(1, min(TASKS_AT_ONCE, len(pending) // max(1, processes)))
    return [pending[start : start + size] for start in range(0, len(pending), size)]


@dataclass(frozen=True)
class Where:
    """Where an upload's jobs run, and how they are watched.

    Attributes:
        processes: Worker processes; 0 runs them in this process (with ``executor``, ignored).
        executor: The caller's executor, or None for a pool of the upload's own.
        stall_timeout: Seconds an item may take (``watch.Watch``); None waits for ever.
        progress: Show a progress bar.
        source: The source spec the dataset was built from, sent to a cluster's workers instead of it.
    """

    processes: int
    executor: Executor | None
    stall_timeout: float | None
    progress: bool
    source: str | None = None


@dataclass(frozen=True)
class Job:
    """One call in an executor: ``call(spec, group, dataset, progress, slots)`` (``write_tasks``,
    or a check of kept tasks), named ``what`` in errors; ``tally`` counts a result's
    (samples, bytes) where no progress queue does (a caller's executor)."""

    call: Callable[..., Any]
    spec: Any
    group: list[Any]
    what: str
    tally: Callable[[Any], tuple[int, int]]


def write_jobs(spec: TaskSpec, pending: list[tuple[int, np.ndarray]], processes: int) -> list[Job]:
    """The jobs that write the ``pending`` tasks on ``processes`` processes (``task_groups``);
    with none, one job of them all, in this process (a task starts as soon as one ends)."""
    groups = task_groups(pending, processes) if processes > 0 else [pending] if pending else []
    return [Job(write_tasks, spec, group, _tasks_named([task_id for task_id, _ in group]), _tally_written)
            for group in groups]


def check_jobs(spec: CheckSpec, kept: list[tuple[int, list[ShardEntry]]], processes: int) -> list[Job]:
    """The jobs that check the ``kept`` tasks' items (``verify.check_tasks``), grouped as writes are."""
    groups = task_groups(kept, processes) if processes > 0 else [kept] if kept else []
    return [Job(check_tasks, spec, group, "the check of " + _tasks_named([task_id for task_id, _ in group]),
                _tally_checked) for group in groups]


def _tally_checked(results: list[Checked]) -> tuple[int, int]:
    return sum(r.compared if r.changed is not None else r.samples for r in results), 0


def _tasks_named(ids: list[int]) -> str:
    return f"task {ids[0]}" if len(ids) == 1 else f"tasks {', '.join(map(str, ids))}"


def _tally_written(results: list[TaskResult]) -> tuple[int, int]:
    return (sum(r.samples for r in results),
            sum(e.size for r in results for e in r.entries))


class _Runner:
    """Where jobs run: ``submit`` one, ``end`` when done (ending stalled processes)."""

    slots: Slots | None = None
    progress: Any = None  # the workers' progress queue, drained into the bar
    here = False

    def submit(self, job: Job) -> Future[Any]:
        raise NotImplementedError

    def end(self, stalled: list[Stalled]) -> None:
        """Release what the jobs ran on; a process that stalled is killed first."""


class _Here(_Runner):
    """This process: one job at a time on a daemon thread (its tasks on threads of their own)."""

    here = True

    def __init__(self, dataset: Any, progress: _BarProgress) -> None:
        self.dataset, self.bar_progress, self.slots = dataset, progress, Slots(TASKS_AT_ONCE)
        self.pool = DaemonPool(1, "remote-loader-upload")
        self.stops: list[threading.Event] = []  # each job's: its tasks stop at their next sample once it is set

    def submit(self, job: Job) -> Future[Any]:
        self.stops.append(threading.Event())
        return self.pool.submit(job.call, job.spec, job.group, self.dataset, self.bar_progress, self.slots,
                                self.stops[-1])

    def end(self, stalled: list[Stalled]) -> None:
        for stop in self.stops:  # Ctrl-C here, or the run ended without them
            stop.set()
        self.pool.shutdown()  # a thread stuck in ds[i] is left to end by itself


class _Pool(_Runner):
    """A process pool of the upload's own, whose workers receive the dataset once, at start."""

    def __init__(self, dataset: Any, workers: int) -> None:
        context = multiprocessing.get_context()
        self.progress = context.Queue()
        self.slots = Slots(workers * TASKS_AT_ONCE, context)
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=tasks.init_worker,
                                            initargs=(dataset, self.progress, self.slots))
        self._broken: UploadError | None = None

    def submit(self, job: Job) -> Future[Any]:
        return self.executor.submit(job.call, job.spec, job.group)

    def broken(self) -> UploadError:
        """The error for a pool a worker of which ended: the item it was reading, from the
        watch's table, and how it ended (a crash in a native library, ``os._exit``, the OOM
        killer). The pool ends its other workers itself (SIGTERM), so the one that ended
        otherwise is the one that broke it. The same error each time it is asked for."""
        if self._broken is not None:
            return self._broken
        table = self.slots.copy() if self.slots is not None else None
        processes = dict(getattr(self.executor, "_processes", None) or {})  # pid -> Process (CPython's pool)
        self.executor.shutdown(wait=True, cancel_futures=True)  # broken: its workers are ended and joined
        codes = {pid: p.exitcode for pid, p in processes.items() if p.exitcode not in (None, -signal.SIGTERM)}
        # An item waiting for its turn at ds[i] (``watch.Reading.turn``) crashed nothing.
        rows = [] if table is None else [(int(pid), int(task), int(index)) for pid, task, index, _, waiting in table
                                         if int(pid) in codes and index >= 0 and not waiting]
        if rows:
            pid = rows[0][0]
            reading = [(task, index) for row_pid, task, index in rows if row_pid == pid]
            items = " and ".join(f"ds[{index}] (task {task})" for task, index in sorted(reading, key=lambda r: r[1]))
            which = "the item" if len(reading) == 1 else "one of them"
            self._broken = UploadError(
                f"worker process {pid} ended ({_how(codes[pid])}) while reading {items}: {which} crashed it (a fault"
                " in a native library, os._exit, or the system's out-of-memory killer); finished tasks are kept: run"
                " the same upload again to resume", index=reading[0][1] if len(reading) == 1 else None)
        else:
            ended = next((f"worker process {pid} ended ({_how(code)})" for pid, code in codes.items()), None)
            self._broken = UploadError(_broken_pool(ended))
        return self._broken

    def end(self, stalled: list[Stalled]) -> None:
        pids = {s.pid for s in stalled}
        for process in multiprocessing.active_children():  # only this pool's own workers can have stalled
            if process.pid in pids:
                process.kill()  # the pool then counts itself broken and ends its other workers
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.progress.close()
        self.progress.join_thread()


class _Theirs(_Runner):
    """The caller's executor (a Dask cluster's): the dataset travels once per worker where it can."""

    def __init__(self, executor: Executor, dataset: Any, source: str | None) -> None:
        self.executor = executor
        self.shipped, self.plugin = _ship(executor, dataset, source)
        # Dask names a task by its arguments unless told otherwise, and would hand a re-run of
        # a failed upload the same failures: each submission gets a key of its own.
        self.unique = {"pure": False} if _is_dask(executor) else {}

    def submit(self, job: Job) -> Future[Any]:
        return self.executor.submit(job.call, job.spec, job.group, self.shipped, **self.unique)

    def end(self, stalled: list[Stalled]) -> None:
        if self.plugin is not None:
            _unship(self.executor, self.plugin)


def run_jobs(jobs: list[Job], dataset: Any, where: Where, bar: tqdm,
             on_result: Callable[[Job, Any], list[Job]]) -> None:
    """Run ``jobs`` ``where`` it says: in this process, on a pool of processes of the upload's
    own, or on the caller's executor, counting progress on ``bar``; hand each result to
    ``on_result`` as it comes (none is kept here), which returns the jobs it calls for next.

    In this process and on the upload's own pool, an item read for long is named in a warning,
    and one past ``stall_timeout`` ends the run with an ``UploadError`` naming it. After an
    error or a stall no other task starts; the writes running finish (checks stop at their
    next item), then it raises.
    """
    if not jobs:
        return
    bar_progress = _BarProgress(bar)
    runner: _Runner
    if where.executor is None and where.processes <= 0:
        runner = _Here(dataset, bar_progress)
    elif where.executor is None:
        runner = _Pool(dataset, min(where.processes, len(jobs)))
    else:
        runner = _Theirs(where.executor, dataset, where.source)
    watch = None if runner.slots is None else Watch(runner.slots, where.stall_timeout, here=runner.here)
    try:
        _drive(runner, jobs, on_result, bar_progress, watch)
    except BaseException as error:
        if runner.slots is not None and not isinstance(error, Exception):  # Ctrl-C: stop at the next sample
            runner.slots.interrupt()
        raise
    finally:
        if runner.slots is not None:  # the tasks a worker already took from the pool's queue start none
            runner.slots.stop()
        runner.end([] if watch is None else watch.stalled)


def _drive(runner: _Runner, jobs: list[Job], on_result: Callable[[Job, Any], list[Job]], bar_progress: _BarProgress,
           watch: Watch | None) -> None:
    """Submit the jobs and take their results (and the jobs those call for) until none is
    left; after the first error or stall, wait only for the tasks still making progress."""
    futures = {runner.submit(job): job for job in jobs}
    own = not isinstance(runner, _Theirs)
    failure: BaseException | None = None
    written = 0
    while futures:
        done, _ = wait(futures, timeout=0.2, return_when=FIRST_COMPLETED)
        for future in done:
            job = futures.pop(future)
            if failure is not None and future.cancelled():
                continue  # cancelled here after the first error: it never ran, and failed at nothing
            try:
                result = _result(future, job.what, runner.broken if isinstance(runner, _Pool) else None)
                samples, nbytes = job.tally(result)
                written += nbytes
                if not own:  # a caller's executor has no progress queue: count whole results
                    bar_progress.put((samples, nbytes))
                follow = on_result(job, result)
            except Exception as error:
                if failure is None:
                    failure = error
                elif error is not failure and not isinstance(error.__cause__ or error, Cancelled):
                    log.warning("upload: after the first error, %s", error)
                continue
            if failure is None:
                futures.update({runner.submit(j): j for j in follow})
        _drain(runner.progress, bar_progress)
        stalled = watch.check() if watch is not None else None
        if stalled is not None and watch is not None and failure is None:
            failure = UploadError(watch.error_for(stalled), index=stalled.index)
        if failure is not None:
            if runner.slots is not None:
                runner.slots.stop()
            for future in futures:
                future.cancel()  # not started yet
            if watch is None or not watch.busy():
                break
    if failure is not None:
        raise failure
    bar_progress.settle(written)


def _drain(progress: Any, bar_progress: _BarProgress) -> None:
    while progress is not None:
        try:
            bar_progress.put(progress.get_nowait())
        except queue.Empty:
            break
