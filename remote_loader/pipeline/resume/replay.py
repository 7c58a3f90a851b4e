"""Resuming a worker exactly where its state was taken, by replaying its run.

torchdata's ``StatefulDataLoader(snapshot_every_n_steps=n)`` restores each worker from its
last snapshot, up to ``n - 1`` batches old, and then replays the batches since, throwing
them away: that is only right if the restored worker gives those same batches again. A
worker resumed from the samples it had not delivered gives them through a fresh shuffle,
in another order. So a worker's state also holds a ``Record`` of its run: the run's plan,
how many items had passed the *replay point* (the end of the last ``shuffle`` or
``batched``) and finished, and where samples were skipped under ``on_error="skip"``.

A worker that loads its own state runs that plan again from its start, with the same
seeds. Samples it had delivered are ``REPLAYED`` placeholders: never fetched, decoded or
given to a user function, but mixed, shuffled and batched like the samples they stand for,
so the shuffle buffer and the batches go through the same states as before. At the replay
point the placeholders are dropped, exactly as many as the record counts, and what follows
is what the worker would have delivered next. When a stage before that point decides by a
sample's content (a ``select`` before a shuffle), placeholders cannot stand in: the run
is replayed with real samples and the first items counted are dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from remote_loader.errors import ResumeError
from remote_loader.pipeline.resume.intervals import merge
from remote_loader.pipeline.stages import Context, InFlight, Stage


@dataclass(frozen=True)
class Record:
    """What a worker's state says of its run: the run's plan (intervals of positions, in
    order), the items that finished past the replay point, and the skips, each
    ``(position, samples, at_open)``: at a range's opening the whole range was skipped."""

    rows: tuple[tuple[int, int], ...]
    items: int
    skips: tuple[tuple[int, int, bool], ...] = ()

    def encode(self) -> dict[str, Any]:
        return {"plan": [x for row in self.rows for x in row], "items": self.items,
                "skipped": [x for position, count, at_open in self.skips for x in (position, count, int(at_open))]}


def _flat(state: Mapping[str, Any], name: str, width: int, high: int) -> list[int]:
    values = state.get(name)
    if not isinstance(values, (list, tuple)) or len(values) % width or \
            not all(type(v) is int and 0 <= v <= high for v in values):
        raise ResumeError(f"RemoteDataset state field {name!r} must be a flat list of {width}-tuples of integers"
                          f" in 0..{high}")
    return list(values)


def parse_record(state: Mapping[str, Any], samples: int, undelivered: list[tuple[int, int]]) -> Record | None:
    """The record of a state (None for a state without one), checked: every undelivered
    position must lie in the run's plan."""
    if "plan" not in state:
        return None
    missing = [k for k in ("items", "skipped") if k not in state]
    if missing:
        raise ResumeError(f"RemoteDataset worker state has a plan but lacks {', '.join(missing)}")
    flat = _flat(state, "plan", 2, samples)
    rows = tuple(zip(flat[::2], flat[1::2], strict=True))
    if any(a >= b for a, b in rows):
        raise ResumeError("RemoteDataset state field 'plan' must hold non-empty intervals")
    items = state["items"]
    if type(items) is not int or not 0 <= items <= sum(b - a for a, b in rows):
        raise ResumeError(f"RemoteDataset state field 'items' must be an integer in 0..{sum(b - a for a, b in rows)}"
                          f" (the plan's samples), got {items!r}")
    flat = _flat(state, "skipped", 3, samples)
    skips = tuple((p, n, bool(o)) for p, n, o in zip(flat[::3], flat[1::3], flat[2::3], strict=True))
    if any(o not in (0, 1) for o in flat[2::3]):
        raise ResumeError("RemoteDataset state field 'skipped' must end each triple with 0 or 1")
    covered = merge(rows)
    starts = np.array([a for a, _ in covered], dtype=np.int64)
    for a, b in undelivered:
        k = int(np.searchsorted(starts, a, side="right")) - 1
        if k < 0 or b > covered[k][1]:
            raise ResumeError(f"RemoteDataset state field 'remaining' holds positions {a}..{b - 1}, outside its"
                              " run's 'plan'")
    return Record(rows, items, skips)


class Replay:
    """A run replayed up to where its state was taken: which positions are live (not yet
    delivered), where samples were skipped, and how many items to drop at the replay point.

    Args:
        undelivered: The state's undelivered positions, sorted disjoint intervals.
        record: The state's record of its run.
        placeholders: Whether delivered samples may pass as ``REPLAYED`` (no stage before
            the replay point looks at a sample's content).
    """

    def __init__(self, undelivered: list[tuple[int, int]], record: Record, placeholders: bool) -> None:
        self.undelivered, self.record, self.placeholders = undelivered, record, placeholders
        self._starts = np.array([a for a, _ in undelivered], dtype=np.int64)
        self._stops = np.array([b for _, b in undelivered], dtype=np.int64)
        self._skips = {p: n for p, n, at_open in record.skips if not at_open}
        self._empty = {p for p, _, at_open in record.skips if at_open}

    def live(self, position: int) -> bool:
        """Whether the sample at ``position`` was not delivered before the state."""
        k = int(np.searchsorted(self._starts, position, side="right")) - 1
        return k >= 0 and position < int(self._stops[k])

    def any_live(self, start: int, stop: int) -> bool:
        """Whether any position in ``[start, stop)`` is live."""
        k = int(np.searchsorted(self._stops, start, side="right"))
        return k < len(self._starts) and int(self._starts[k]) < stop

    def skip_at(self, position: int) -> int:
        """How many samples the run skipped at once from ``position`` (0: none)."""
        return self._skips.get(position, 0)

    def skipped_at_open(self, position: int) -> bool:
        """Whether the range starting at ``position`` was skipped whole when opened."""
        return position in self._empty


class ReplayPoint:
    """The replay point of one iteration: the end of the last ``shuffle`` or ``batched``.

    It counts the items that pass it and then finish (delivered, or dropped by a later
    stage), which is what a ``Record`` holds; in a replayed run it first drops, here, as
    many items as the record counts (placeholders, or real ones when placeholders cannot
    stand in) and checks that the run reproduced them.

    Args:
        replay: The run being replayed, or None.
        where: The worker, for messages.
    """

    def __init__(self, replay: Replay | None, where: str) -> None:
        self.replay, self.where = replay, where
        self.replaying = replay is not None  # until the replayed run reaches its state's point
        self.items = 0
        self._passing: deque[Any] = deque()  # ids of items past the point, not yet finished

    def run(self, pairs: Iterable[tuple[Any, Any]], done: Callable[[Any], None]) -> Iterator[tuple[Any, Any]]:
        """The items passing the point; ``done(ids)`` for the items a replay drops here."""
        replay = self.replay
        dropped = 0
        for ids, item in pairs:
            if replay is not None and self.replaying:
                expected = replay.record.items
                if (item is REPLAYED) if replay.placeholders else (dropped < expected):
                    if dropped == expected:
                        raise _diverged(self.where, f"more than the {expected} items it had delivered")
                    dropped += 1
                    self.items += 1
                    done(ids)
                    continue
                if dropped != expected:
                    raise _diverged(self.where, f"{dropped} items where it had delivered {expected}")
                self.replaying = False
            elif item is REPLAYED:
                raise _diverged(self.where, "a delivered sample after an undelivered one")
            self._passing.append(ids)
            yield ids, item
        if replay is not None and self.replaying:
            if dropped != replay.record.items:
                raise _diverged(self.where, f"{dropped} items where it had delivered {replay.record.items}")
            self.replaying = False

    def finished(self, ids: Any) -> None:
        """An item left the pipeline (or a stage dropped it); those past the point finish in order."""
        if self._passing and self._passing[0] == ids:
            self._passing.popleft()
            self.items += 1


# --------------------------------------------------------------------------- placeholders


class Placeholder:
    """The type of ``REPLAYED``, the placeholder sample."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "REPLAYED"

    def __reduce__(self) -> str:
        return "REPLAYED"  # the one instance, also through pickle


REPLAYED = Placeholder()
"""A sample delivered before a state was taken, which a resumed worker replays through its
pipeline up to the replay point without fetching it, decoding it or giving it to a user
function. Only this module and the sample source, which emits it, know of it."""


@dataclass
class ReplayedRange:
    """Samples ``[next, stop)`` of a range that a resumed worker had delivered, opened as the
    source opens a fetched range: nothing was fetched, and each sample reads as ``REPLAYED``."""

    next: int
    stop: int
    release: Callable[[], None]

    @property
    def done(self) -> bool:
        return self.next >= self.stop

    def next_sample(self) -> Placeholder:
        self.next += 1
        return REPLAYED

    def close(self) -> None:
        self.release()


def route(stage: Stage) -> Stage:
    """``stage`` as it runs before the replay point of a replay with placeholders: a stage
    mapping one sample to one never sees a placeholder (each goes around it, in its place in
    the order), ``batched`` turns a batch of placeholders into one, and a shuffle moves them
    like any item. Stages themselves know nothing of placeholders."""
    if stage.one_to_one:
        return _Around(stage)
    return stage.collating(_collate_placeholders)  # batched: a batch of placeholders is one; others: themselves


def _collate_placeholders(collate: Callable[[list[Any]], Any] | None) -> Callable[[list[Any]], Any]:
    def run(items: list[Any]) -> Any:
        if any(item is REPLAYED for item in items):  # a replay's batches hold placeholders only, or none
            if not all(item is REPLAYED for item in items):
                raise ResumeError("a resumed run batched delivered samples with undelivered ones: it did not replay"
                                  " the run its state was taken in (the pipeline differs from the one that saved it)")
            return REPLAYED
        return collate(items) if collate is not None else items

    return run


class _Around(Stage):
    """A stage mapping one sample to one, with placeholders going around it in order."""

    one_to_one = True

    def __init__(self, inner: Stage) -> None:
        self.inner = inner

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        raise TypeError("a routed stage runs over (id, item) pairs only")

    def paired(self, pairs: Iterable[tuple[Any, Any]], context: Context, dropped: Callable[[Any], None],
               names: InFlight | None) -> Iterator[tuple[Any, Any]]:
        marks: deque[tuple[Any, bool]] = deque()  # (id, is a placeholder), in input order

        def into() -> Iterator[tuple[Any, Any]]:
            for ids, item in pairs:
                marks.append((ids, item is REPLAYED))
                if item is not REPLAYED:
                    yield ids, item

        out = self.inner.paired(into(), context, dropped, names)
        while True:
            while marks and marks[0][1]:
                yield marks.popleft()[0], REPLAYED
            try:
                ids, item = next(out)
            except StopIteration:
                while marks:
                    yield marks.popleft()[0], REPLAYED
                return
            while marks[0][1]:  # placeholders the stage pulled in ahead of this item come first
                yield marks.popleft()[0], REPLAYED
            marks.popleft()
            yield ids, item


def _diverged(where: str, what: str) -> ResumeError:
    return ResumeError(f"the resumed run of {where} did not replay the one its state was taken in ({what}): the"
                       " pipeline differs from the one that saved the state (stages, shuffle buffer, open_shards,"
                       " fetch ranges), or a sample skipped under on_error='skip' read differently this time")


def check_rows(record: Record, expected: tuple[tuple[int, int], ...], where: str) -> None:
    """A first run's plan is this worker's share of the epoch: refuse a state whose plan is not."""
    if record.rows != expected:
        raise ResumeError(f"the state of {where} names a plan that is not its share of the epoch: it was saved"
                          " for another split, or altered")

