"""Every shard an upload wrote, gathered as its tasks finish: as arrays, what the manifest
needs (48 bytes a shard), not an entry object per shard, so the process that writes the
manifest of ten million shards holds its columns and little else."""

from __future__ import annotations

import numpy as np

from remote_loader.format import ShardTable
from remote_loader.format.columns import narrow
from remote_loader.upload.tasks import TaskResult, shard_name

NUMBERS = ("samples", "size", "index_offset", "index_size", "index_crc", "crc32")
_REASONS = 100


class Written:
    """The shards, fields, skipped samples and skip reasons of upload ``run``'s tasks."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._rows: dict[int, np.ndarray] = {}  # task id -> one row of NUMBERS per shard, in part order
        self._reasons: dict[int, list[str]] = {}
        self._skipped: dict[int, list[int]] = {}
        self._fields: dict[int, list[str]] = {}

    @property
    def skipped(self) -> list[int]:
        """The samples the tasks skipped."""
        return [index for task in sorted(self._skipped) for index in self._skipped[task]]

    @property
    def fields(self) -> set[str]:
        """The fields the tasks' shards hold."""
        return {name for names in self._fields.values() for name in names}

    def drop(self, task_id: int) -> None:
        """Forget task ``task_id`` (a kept task written again): its shards, fields and skipped samples."""
        for held in (self._rows, self._reasons, self._skipped, self._fields):
            held.pop(task_id, None)

    def add(self, result: TaskResult) -> None:
        """Take a task's result (its entry objects may then go)."""
        for part, entry in enumerate(result.entries):
            if entry.name != shard_name(self.run, result.task_id, part) or entry.index_name:
                raise RuntimeError(f"task {result.task_id} wrote {entry.name!r} as its shard {part}, not"
                                   f" {shard_name(self.run, result.task_id, part)!r}")
        self._rows[result.task_id] = np.array([[getattr(e, c) for c in NUMBERS] for e in result.entries],
                                              dtype=np.uint64).reshape(-1, len(NUMBERS))
        self._fields[result.task_id] = list(result.fields)
        if result.skipped:
            self._skipped[result.task_id] = list(result.skipped)
        if result.reasons:
            self._reasons[result.task_id] = result.reasons[:_REASONS]

    def missing(self, tasks: int) -> list[int]:
        """Those of tasks ``0..tasks - 1`` whose result is not in."""
        return [task for task in range(tasks) if task not in self._rows]

    @property
    def shards(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def reasons(self) -> tuple[str, ...]:
        """Why samples were skipped, in task order (the first 100)."""
        return tuple(reason for task in sorted(self._reasons) for reason in self._reasons[task])[:_REASONS]

    def table(self) -> ShardTable:
        """Once, when every task is in: the shards in task order, named ``shard-<run>-<task>-<part>.tar`` by a template
        (see docs/FORMAT.md: one number when every task wrote one part, none for one shard).
        Each task's rows are let go as they are copied into the columns, each in its
        narrowest type, so the rows and the columns are not held whole at once."""
        tasks = sorted(self._rows)
        lengths = [len(self._rows[t]) for t in tasks]
        tops = np.zeros(len(NUMBERS), dtype=np.uint64)
        for rows in self._rows.values():
            if len(rows):
                np.maximum(tops, rows.max(axis=0), out=tops)
        columns = {c: np.empty(sum(lengths), dtype=narrow(tops[j : j + 1]).dtype) for j, c in enumerate(NUMBERS)}
        at = 0
        for task in tasks:
            rows = self._rows.pop(task)
            for j, c in enumerate(NUMBERS):
                columns[c][at : at + len(rows)] = rows[:, j]
            at += len(rows)
        numbers = np.repeat(narrow(np.array(tasks, dtype=np.uint64)), lengths)
        parts = np.concatenate([np.arange(n, dtype=np.uint32) for n in lengths]) if tasks else numbers
        if sum(lengths) == 1:
            return ShardTable.from_template(columns, (shard_name(self.run, tasks[lengths.index(1)], 0),), (), ())
        if not len(parts) or int(parts.max()) == 0:
            return ShardTable.from_template(columns, (f"shard-{self.run}-", "-000.tar"), (6,), (numbers,))
        return ShardTable.from_template(columns, (f"shard-{self.run}-", "-", ".tar"), (6, 3), (numbers, parts))
