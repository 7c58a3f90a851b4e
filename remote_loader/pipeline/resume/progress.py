"""Where one worker's iteration stands, and its state: the positions of its plan not yet
delivered.

Every sample of an epoch has a position, its place in the epoch's virtual sequence (the
shards in the epoch's order; see ``split.py``). A worker reads a *plan*: intervals of
positions, in order. Under ``equalize`` the sequence wraps, so a few reads repeat samples
another worker reads first; those positions are the plan's *extras*.

``Progress`` learns what was delivered as items leave the pipeline (a batch's ids are its
samples' positions) and what the source skipped: the rest of the plan is the state, as
merged intervals, so its size grows with ``open_shards`` and the shuffle buffer (the holes
a shuffle leaves), never with the dataset. Everything reaches it on the consumer's thread:
the pipeline's end and the source, both generators the consumer drives.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from remote_loader.pipeline.resume.intervals import PositionSet, contains, merge, without
from remote_loader.pipeline.resume.replay import Record, Replay, ReplayPoint
from remote_loader.pipeline.split import Plan

STATE_VERSION = 2
MARK = "remote_loader_state"
"""The key that marks a worker's position state (its value is the state's version)."""


class Progress:
    """Where one worker's iteration stands (see the module's docstring).

    Args:
        plan: What the worker reads.
        header: What every state of the worker starts with.
        replay: The run replayed, when the worker resumes its own state (``replay.py``).
        recorded: Whether states record the run for a replay (not after a count-based skip).
        where: The worker, for messages.
    """

    def __init__(self, plan: Plan, header: dict[str, Any], replay: Replay | None = None, recorded: bool = True,
                 where: str = "this worker") -> None:
        self.plan, self.header, self.replay, self.recorded = plan, header, replay, recorded
        self.point = ReplayPoint(replay, where)
        self._rows = merge(plan.rows)
        self._delivered = PositionSet()  # positions delivered, dropped by a stage or skipped
        self._skips: list[tuple[int, int, bool]] = []  # (position, samples, at_open) skipped under on_error="skip"

    def done(self, ids: int | list[Any]) -> None:
        """An item left the pipeline, or a stage dropped it: its id, or a batch's ids."""
        self.point.finished(ids)
        self._deliver(ids)

    def _deliver(self, ids: int | list[Any]) -> None:
        if isinstance(ids, int):
            self._delivered.add(ids, ids + 1)
        else:
            for i in ids:
                self._deliver(i)

    def skipped(self, position: int, samples: int, at_open: bool = False) -> None:
        """The source skipped ``samples`` from ``position`` (a whole range, when ``at_open``)."""
        self._skips.append((position, samples, at_open))
        self._delivered.add(position, position + samples)

    def remaining(self) -> list[tuple[int, int]]:
        """Positions of the plan not yet delivered, as sorted merged intervals."""
        return self._delivered.complement(self._rows)

    def state(self) -> dict[str, Any]:
        """The worker's state; while a replayed run has not reached its state's point, the
        state it loaded (nothing new was delivered yet)."""
        if self.replay is not None and self.point.replaying:
            return encode(self.header, self.replay.undelivered, self.plan.extras, self.replay.record)
        record = Record(self.plan.rows, self.point.items, tuple(self._skips)) if self.recorded else None
        return encode(self.header, self.remaining(), self.plan.extras, record)


def encode(header: dict[str, Any], remaining: list[tuple[int, int]], extras: Iterable[int],
           record: Record | None = None) -> dict[str, Any]:
    """A worker's state: its header, the positions it has not delivered, its extras apart
    (each with whether it was delivered), and the record of its run (``replay.py``)."""
    extras = sorted(extras)
    flags = [0 if contains(remaining, e) else 1 for e in extras]
    kept = without(remaining, extras)
    return {MARK: STATE_VERSION, **header,
            "remaining": [x for interval in kept for x in interval],
            "extras": [x for pair in zip(extras, flags, strict=True) for x in pair],
            **(record.encode() if record is not None else {})}
