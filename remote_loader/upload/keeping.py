"""What a run of an upload keeps of what is there already: a whole dataset uploaded with its
parameters, or the tasks an interrupted run of it finished. With ``verify`` every item they
hold is read again in the upload's workers and compared with the digest its shard's index
recorded (``verify.check_tasks``) before it is kept: a dataset that holds another item is
refused (it is replaced only with ``overwrite``), and an interrupted run's task that holds
one is written again (nothing of it is public yet)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from remote_loader.errors import UploadError
from remote_loader.format import Manifest
from remote_loader.upload.executors import Job, Where, check_jobs, run_jobs, write_jobs
from remote_loader.upload.summary import UploadSummary
from remote_loader.upload.tasks import TaskResult, TaskSpec
from remote_loader.upload.verify import Checked, CheckSpec
from remote_loader.upload.written import Written

log = logging.getLogger("remote_loader")


def kept_whole(ds: Any, manifest: Manifest, shards: Any, spec: CheckSpec, where: Where, *, sampled: int,
               verify: bool, started: float) -> UploadSummary:
    """The summary of a call that finds ``manifest``'s dataset there, uploaded with its
    parameters and, as far as sampled, over its items; with ``verify``, once every item of
    its ``shards`` was read again and found the same (else an UploadError naming the first
    found to differ, the dataset left as it is)."""
    location = spec.location
    if not verify:
        return UploadSummary.kept_whole(location, manifest, time.perf_counter() - started, compared=0,
                                        sampled=sampled, verified=False)
    compared = 0

    def take(job: Job, results: list[Checked]) -> list[Job]:
        nonlocal compared
        for checked in results:
            if checked.changed is not None:
                raise UploadError(
                    f"{location} holds a dataset uploaded with these parameters, but ds[{checked.changed}] is not the"
                    " item uploaded from it (every item is read again and compared with the digest recorded as it"
                    " was uploaded); pass overwrite=True (--overwrite) to replace the dataset", index=checked.changed)
            compared += checked.compared
        return []

    reading = time.perf_counter()
    with tqdm(total=manifest.num_samples, unit="img", disable=not where.progress, desc="verify", smoothing=0) as bar:
        run_jobs(check_jobs(spec, [(i, [shards.entry(i)]) for i in range(len(shards))], where.processes), ds, where,
                 bar, take)
        bar.update(manifest.num_samples - bar.n)
    return UploadSummary.kept_whole(location, manifest, time.perf_counter() - started, compared=compared,
                                    sampled=sampled, verified=True, reading=time.perf_counter() - reading)


class Writing:
    """An upload's tasks once its prefix is held: those to write, and those an interrupted run
    finished (``kept``), each kept once its items read the same (``verify``), else written again.

    Args:
        spec: What every task shares.
        kept: The finished tasks of the run resumed, by task id.
        order: The permuted sample indices; task ``t`` holds ``order[t * task_size:][:task_size]``.
        task_size: Samples per task.
        verify: Read and compare the kept tasks' items (else they are trusted as sampled).
    """

    def __init__(self, spec: TaskSpec, kept: dict[int, TaskResult], order: np.ndarray, task_size: int,
                 verify: bool) -> None:
        self.spec, self.kept, self.order, self.task_size, self.verify = spec, kept, order, task_size, verify
        self.written = Written(spec.run)
        for result in kept.values():
            self.written.add(result)
        self.compared = 0
        self.rewritten: list[int] = []  # the first changed item of each kept task written again
        self._processes = 0

    def _task(self, task_id: int) -> tuple[int, np.ndarray]:
        return task_id, self.order[task_id * self.task_size : (task_id + 1) * self.task_size]

    @property
    def initial(self) -> int:
        """Samples the progress bar starts at: the kept ones, unless they are read again."""
        return 0 if self.verify else sum(_samples(r) for r in self.kept.values())

    def jobs(self, processes: int) -> list[Job]:
        """The checks of the kept tasks (first: a changed one is written again), then the writes of the rest."""
        self._processes = processes
        tasks = -(-len(self.order) // self.task_size)
        checks = check_jobs(CheckSpec(self.spec.store, self.spec.location, self.spec.retry),
                            [(t, r.entries) for t, r in sorted(self.kept.items())], processes) if self.verify else []
        return checks + write_jobs(self.spec, [self._task(t) for t in range(tasks) if t not in self.kept], processes)

    def take(self, job: Job, results: list[Any]) -> list[Job]:
        """Take a job's results: tasks written, or kept tasks checked; the jobs they call for."""
        again = []
        for result in results:
            if isinstance(result, TaskResult):
                self.written.add(result)
            elif result.changed is None:
                self.compared += result.compared
            else:
                log.warning("upload to %s: ds[%d] is not the item an earlier run of this upload wrote; its task %d"
                            " is written again", self.spec.location, result.changed, result.task_id)
                self.rewritten.append(result.changed)
                self.written.drop(result.task_id)
                del self.kept[result.task_id]
                again.append(self._task(result.task_id))
        return write_jobs(self.spec, again, self._processes) if again else []

    def kept_numbers(self) -> tuple[int, int, int]:
        """Shards, samples and bytes kept from the earlier run."""
        entries = [e for r in self.kept.values() for e in r.entries]
        return len(entries), sum(e.samples for e in entries), sum(e.size for e in entries)


def _samples(result: TaskResult) -> int:
    return sum(e.samples for e in result.entries) + len(result.skipped)


def run_writing(ds: Any, writing: Writing, where: Where, total: int) -> float:
    """Run the writing's jobs under a progress bar; the seconds they took (the bar's span)."""
    started = time.perf_counter()
    # smoothing=0: the bar's rate is the average since it started, the summary's writing rate.
    with tqdm(total=total, initial=writing.initial, unit="img", disable=not where.progress, desc="upload",
              smoothing=0) as bar:
        run_jobs(writing.jobs(where.processes), ds, where, bar, writing.take)
        bar.update(total - bar.n)  # every task is done: the last counts may still be in the workers' queue
        # The bar's own clock where it shows, read as it closes (its final rate is then the
        # summary's); a closed bar says it is disabled, and its clock runs on.
        return float(bar.format_dict["elapsed"]) if not bar.disable else time.perf_counter() - started

