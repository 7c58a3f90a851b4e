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
from remote_loader.upload.encode import EncodeOptions, encode_item
from remote_loader.upload.executors import Job, Where, check_jobs, run_jobs, write_jobs
from remote_loader.upload.summary import UploadSummary
from remote_loader.upload.tasks import TaskResult, TaskSpec, read_item
from remote_loader.upload.verify import Checked, CheckSpec
from remote_loader.upload.written import Written

log = logging.getLogger("remote_loader")


def kept_whole(ds: Any, manifest: Manifest, shards: Any, spec: CheckSpec, where: Where, options: EncodeOptions, *,
               sampled: int, verify: bool, started: float) -> UploadSummary:
    """The summary of a call that finds ``manifest``'s dataset there, uploaded with its
    parameters and, as far as sampled, over its items; with ``verify``, once every item of
    its ``shards`` was read again and found the same, and every item it skipped still fails
    (else an UploadError naming the first found to differ, the dataset left as it is)."""
    location = spec.location
    if not verify:
        return UploadSummary.kept_whole(location, manifest, time.perf_counter() - started, compared=0,
                                        sampled=sampled, verified=False)
    fixed = first_readable(ds, manifest.skipped_indices, options)
    if fixed is not None:
        raise UploadError(f"{location} holds a dataset uploaded with these parameters, but ds[{fixed}], skipped then"
                          " (it could not be read or encoded), reads now; pass overwrite=True (--overwrite) to upload"
                          " the dataset with it", index=fixed)
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

    @property
    def tasks(self) -> int:
        """How many tasks the upload has, kept or to write."""
        return -(-len(self.order) // self.task_size)

    def _task(self, task_id: int) -> tuple[int, np.ndarray]:
        return task_id, self.order[task_id * self.task_size : (task_id + 1) * self.task_size]

    @property
    def initial(self) -> int:
        """Samples the progress bar starts at: the kept ones, unless they are read again."""
        return 0 if self.verify else sum(r.samples for r in self.kept.values())

    def jobs(self, processes: int, ds: Any) -> list[Job]:
        """The checks of the kept tasks (first: a changed one is written again), then the writes
        of the rest. A kept task with an item it skipped that reads now is written again at once."""
        self._processes = processes
        for task_id, result in sorted(self.kept.items()) if self.verify else []:
            fixed = first_readable(ds, result.skipped, self.spec.options)
            if fixed is not None:
                log.warning("upload to %s: ds[%d], skipped by an earlier run of this upload, reads now; its task %d"
                            " is written again", self.spec.location, fixed, task_id)
                self._again(task_id, fixed)
        checks = check_jobs(CheckSpec(self.spec.store, self.spec.location, self.spec.retry),
                            [(t, r.entries) for t, r in sorted(self.kept.items())], processes) if self.verify else []
        writes = [self._task(t) for t in range(self.tasks) if t not in self.kept]
        return checks + write_jobs(self.spec, writes, processes)

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
                again.append(self._again(result.task_id, result.changed))
        return write_jobs(self.spec, again, self._processes) if again else []

    def _again(self, task_id: int, changed: int) -> tuple[int, np.ndarray]:
        """Kept task ``task_id`` is to be written again (its item ``changed`` is not what it holds)."""
        self.rewritten.append(changed)
        self.written.drop(task_id)
        del self.kept[task_id]
        return self._task(task_id)

    def kept_numbers(self) -> tuple[int, int, int]:
        """Shards, samples and bytes kept from the earlier run."""
        entries = [e for r in self.kept.values() for e in r.entries]
        return len(entries), sum(e.samples for e in entries), sum(e.size for e in entries)


def first_readable(ds: Any, indices: Any, options: EncodeOptions) -> int | None:
    """The first of ``indices``, items an upload skipped (they could not be read or encoded),
    that reads and encodes now, or None. Read here, in this process: skipped items are few."""
    for index in indices:
        try:
            encode_item(read_item(ds, int(index)), options, int(index))
        except UploadError:
            continue
        return int(index)
    return None


def run_writing(ds: Any, writing: Writing, where: Where, total: int) -> float:
    """Run the writing's jobs under a progress bar; the seconds they took (the bar's span)."""
    started = time.perf_counter()
    # smoothing=0: the bar's rate is the average since it started, the summary's writing rate.
    with tqdm(total=total, initial=writing.initial, unit="img", disable=not where.progress, desc="upload",
              smoothing=0) as bar:
        run_jobs(writing.jobs(where.processes, ds), ds, where, bar, writing.take)
        missing = writing.written.missing(writing.tasks)
        if missing:  # an executor that lost work: the manifest never lists a part of the dataset
            raise UploadError(f"upload to {writing.spec.location}: the executor returned no result for"
                              f" {len(missing)} tasks (task {missing[0]} first) though none failed; finished tasks"
                              " are kept: run the same upload again to resume")
        bar.update(total - bar.n)  # every task is done: the last counts may still be in the workers' queue
        # The bar's own clock where it shows, read as it closes (its final rate is then the
        # summary's); a closed bar says it is disabled, and its clock runs on.
        return float(bar.format_dict["elapsed"]) if not bar.disable else time.perf_counter() - started

