"""Where an upload's tasks run: in the caller's process, on a process pool of the upload's
own (whose workers receive the dataset once, at start), or on the caller's executor, such
as a Dask cluster's (which receives the dataset once per worker, in a worker plugin, or
built there from a source spec)."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
from tqdm import tqdm

from remote_loader.errors import RemoteLoaderError, UploadError
from remote_loader.upload import tasks
from remote_loader.upload.sources import SourceSpec
from remote_loader.upload.tasks import TASKS_AT_ONCE, TaskResult, TaskSpec, write_tasks


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
            self.bar.set_postfix_str(_rate(self.bytes, self.bar), refresh=False)

    def settle(self, nbytes: int) -> None:
        """Every task done: the bytes they wrote, whatever of the workers' last counts is still
        on its way through their queue."""
        with self._lock:
            self.bytes = nbytes
            self.bar.set_postfix_str(_rate(self.bytes, self.bar), refresh=False)


def _rate(nbytes: int, bar: tqdm) -> str:
    elapsed = max(bar.format_dict.get("elapsed", 0.0), 1e-9)
    return f"{nbytes / 1e6:.1f} MB, {nbytes / 1e6 / elapsed:.1f} MB/s"


def _ship(executor: Executor, dataset: Any, source: str | None) -> tuple[Any, str | None]:
    """What a caller's executor sends with each task so that the dataset reaches each of its
    workers once: the source spec (each worker builds the dataset), or, on a Dask cluster,
    a token for the dataset sent to every worker in a plugin (whose name comes second, to
    remove it when the upload ends); any other executor gets the dataset itself."""
    if source is not None:
        return SourceSpec(source), None
    client = getattr(executor, "_client", None)
    if _is_dask(executor) and client is not None:
        from remote_loader.upload.shipping import ship  # distributed: the dask extra

        return ship(client, dataset)
    return dataset, None


def _unship(executor: Executor, plugin: str) -> None:
    """Remove the dataset's plugin from the cluster; a cluster gone by now needs nothing."""
    from remote_loader.upload.shipping import unship

    with contextlib.suppress(Exception):
        unship(getattr(executor, "_client", None), plugin)


def _is_dask(executor: Executor) -> bool:
    return type(executor).__module__.startswith("distributed")


def _result(future: Future[list[TaskResult]], ids: list[int], own: bool) -> list[TaskResult]:
    """A group's results; its own error as it is, a failure of the executor as an UploadError
    that names the likely cause."""
    what = f"task {ids[0]}" if len(ids) == 1 else f"tasks {', '.join(map(str, ids))}"
    try:
        return future.result()
    except RemoteLoaderError:
        raise
    except BrokenProcessPool as exc:
        if own:
            raise UploadError(_broken_pool()) from exc
        raise UploadError(f"{what} did not complete: the executor's processes ended ({exc})") from exc
    except Exception as exc:
        raise UploadError(f"{what} did not complete: the executor failed ({type(exc).__name__}: {exc});"
                          " finished tasks are kept: run the same upload again to resume") from exc


def _broken_pool() -> str:
    """Why the upload's own worker processes ended before finishing: under spawn or
    forkserver, most often a script that starts the upload at import, which each worker
    then runs again; otherwise a worker killed (out of memory)."""
    method = multiprocessing.get_start_method()
    if method in ("spawn", "forkserver"):
        return (f"the upload's worker processes ended before finishing their tasks. With the {method!r} start method"
                " (the default on macOS and Windows) each worker imports your main script again: if the script starts"
                " the upload at import, every worker tries to start one too and fails. Put the code that starts the"
                ' upload under `if __name__ == "__main__":` (see the worker errors above), or pass workers=0')
    return (
        "the upload's worker processes ended before finishing their tasks (one was killed: out of memory, or a"
        " signal); finished tasks are kept: run the same upload again to resume, with fewer workers if memory ran out"
    )


def task_groups(pending: list[tuple[int, np.ndarray]], processes: int) -> list[list[tuple[int, np.ndarray]]]:
    """The tasks as submitted: in pairs, written at once by one process, where there are
    enough to keep every process busy; one at a time otherwise, so that no process is idle
    while another holds two (their encoding shares one GIL)."""
    size = max(1, min(TASKS_AT_ONCE, len(pending) // max(1, processes)))
    return [pending[start : start + size] for start in range(0, len(pending), size)]


def run_tasks(
    pending: Iterable[tuple[int, np.ndarray]],
    spec: TaskSpec,
    dataset: Any,
    workers: int,
    executor: Executor | None,
    bar: tqdm,
    collect: Callable[[TaskResult], None],
    source: str | None = None,
) -> None:
    """Write the ``pending`` tasks ``(task id, sample indices)``: in this process
    (``workers=0``), on a pool of ``workers`` processes of its own, or on ``executor``,
    counting progress on ``bar``; hand each result to ``collect`` as it comes (none is
    kept here). Wherever they run, a process writes ``TASKS_AT_ONCE`` tasks at a time
    (``write_tasks``)."""
    pending = list(pending)
    if not pending:
        return
    if executor is None and workers <= 0:
        for result in write_tasks(spec, pending, dataset, _BarProgress(bar)):
            collect(result)
        return
    groups = task_groups(pending, workers)
    progress: Any = None
    own = executor is None
    if own:
        context = multiprocessing.get_context()
        progress = context.Queue()
        executor = ProcessPoolExecutor(
            max_workers=min(workers, len(groups)),
            mp_context=context,
            initializer=tasks.init_worker,
            initargs=(dataset, progress),
        )
    assert executor is not None
    bar_progress = _BarProgress(bar)
    shipped, plugin = (None, None) if own else _ship(executor, dataset, source)
    # Dask names a task by its arguments unless told otherwise, and would hand a re-run of
    # a failed upload the same failures: each submission gets a key of its own.
    unique = {"pure": False} if _is_dask(executor) else {}
    try:
        ids_of: dict[Future[list[TaskResult]], list[int]] = {
            executor.submit(write_tasks, spec, group, shipped, **unique): [task_id for task_id, _ in group]
            for group in groups
        }
        futures = set(ids_of)
        written = 0
        while futures:
            done, futures = wait(futures, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                for result in _result(future, ids_of[future], own):
                    collect(result)
                    written += sum(e.size for e in result.entries)
                    if not own:  # a caller's executor has no progress queue: count whole tasks
                        samples = sum(e.samples for e in result.entries) + len(result.skipped)
                        bar_progress.put((samples, sum(e.size for e in result.entries)))
            while progress is not None:
                try:
                    bar_progress.put(progress.get_nowait())
                except queue.Empty:
                    break
        bar_progress.settle(written)
    finally:
        if plugin is not None:
            _unship(executor, plugin)
        if own:
            executor.shutdown(wait=True, cancel_futures=True)
            progress.close()
            progress.join_thread()
