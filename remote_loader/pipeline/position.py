"""Checkpoints by position: what of one worker's epoch is not yet delivered, and how the
rest of an epoch stopped on R ranks x W workers is divided among R' x W'.

Every sample of an epoch has a position, its place in the epoch's virtual sequence (the
shards in the epoch's order; see ``split.py``). A worker reads a *plan*: intervals of
positions, in order. Under ``equalize`` the sequence wraps, so a few reads repeat samples
another worker reads first; those positions are the plan's *extras*.

While a worker iterates, its ``Progress`` knows where every undelivered sample is: in the
rest of the plan not yet cut into ranges, in ranges cut but not yet opened, in the open
ranges after their read position, or emitted by the source and not yet out of the
pipeline (in the shuffle buffer, a stage's threads or a partial batch). Its state lists
those as merged intervals, so its size grows with ``open_shards`` and the shuffle buffer,
never with the dataset.

The states of every worker of every rank together give the rest of the epoch: the union
of what each has not delivered, less the samples whose extra read was delivered. That set,
in position order, is divided among the new ranks and workers as an epoch's sequence is.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from remote_loader.errors import ConfigError
from remote_loader.pipeline.split import laps

STATE_VERSION = 2
MARK = "remote_loader_state"
"""The key that marks a worker's position state (its value is the state's version)."""
_HEADER = ("epoch", "seed", "shuffle", "samples", "shards", "run", "rank", "world_size", "worker", "num_workers")
_MAX_DEPTH = 8  # how deep load_state_dict looks for worker states inside a loader's state


@dataclass(frozen=True)
class Plan:
    """What one worker reads: intervals ``rows`` of positions in order; ``extras`` are the
    positions it reads as repeats; ``run`` names the sequence divided (0: a whole epoch,
    else a checksum of the remainder resumed)."""

    rows: tuple[tuple[int, int], ...]
    extras: frozenset[int]
    run: int = 0


def divide(starts: np.ndarray, stops: np.ndarray, low: int, high: int, run: int = 0) -> Plan:
    """The plan reading positions ``[low, high)`` of the sequence made of the intervals
    ``[starts[i], stops[i])`` in order, wrapping around past its end."""
    ends = np.cumsum(stops - starts)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0 or low >= high:
        return Plan((), frozenset(), run)
    rows: list[tuple[int, int]] = []
    extras: set[int] = set()
    occurrence = low
    for first, last in laps(total, low, high):
        pieces = _pieces(starts, stops, ends, first, last)
        rows.extend(pieces)
        if occurrence >= total:  # a repeat: fewer than world_size samples in all
            extras.update(p for a, b in pieces for p in range(a, b))
        occurrence += last - first
    return Plan(tuple(rows), frozenset(extras), run)


def _pieces(starts: np.ndarray, stops: np.ndarray, ends: np.ndarray, first: int, last: int) -> list[tuple[int, int]]:
    """Positions of items ``[first, last)`` of the sequence of intervals (``ends``: their cumulative sizes)."""
    i, j = (int(k) for k in np.searchsorted(ends, [first, last - 1], side="right"))
    out = []
    for k in range(i, j + 1):
        begin = int(ends[k]) - int(stops[k] - starts[k])  # sequence index of the interval's first position
        a, b = max(first, begin), min(last, int(ends[k]))
        out.append((int(starts[k]) + a - begin, int(starts[k]) + b - begin))
    return out


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged union of intervals."""
    out: list[list[int]] = []
    for a, b in sorted((a, b) for a, b in intervals if a < b):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted positions as intervals of consecutive ones."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and p == out[-1][1]:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]


def _without(intervals: list[tuple[int, int]], points: Iterable[int]) -> list[tuple[int, int]]:
    """``intervals`` (sorted, disjoint) less ``points``."""
    out = list(intervals)
    for p in sorted(set(points)):
        starts = [a for a, _ in out]
        k = int(np.searchsorted(starts, p, side="right")) - 1
        if k >= 0 and out[k][0] <= p < out[k][1]:
            a, b = out[k]
            out[k : k + 1] = [x for x in ((a, p), (p + 1, b)) if x[0] < x[1]]
    return out


def _contains(intervals: list[tuple[int, int]], p: int) -> bool:
    k = int(np.searchsorted([a for a, _ in intervals], p, side="right")) - 1
    return k >= 0 and intervals[k][0] <= p < intervals[k][1]


class Progress:
    """Where one worker's iteration stands. The cutter (on the prefetcher's thread) reports
    what it took from the plan and cut into ranges; the source, on the consumer's thread,
    reports the ranges it opens and the samples it emits; the pipeline's end, the samples
    delivered or dropped."""

    def __init__(self, plan: Plan, header: dict[str, Any]) -> None:
        self.plan, self.header = plan, header
        self._lock = threading.Lock()
        self._taken = 0  # samples of the plan the cutter took
        self._cut: deque[tuple[int, int]] = deque()  # (position, samples) of ranges cut, not yet opened
        self._open: dict[Any, int] = {}  # open range -> position of its sample 0
        self._pending: set[int] = set()  # emitted by the source, not yet delivered

    def took(self, samples: int, ranges: Sequence[tuple[int, int]]) -> None:
        """The cutter took ``samples`` of the plan and cut them into ``ranges`` ``(position, samples)``."""
        with self._lock:
            self._cut.extend(ranges)
            self._taken += samples

    def opening(self) -> int:
        """The position of the first sample of the next range cut, which the source opens now."""
        with self._lock:
            return self._cut.popleft()[0]

    def opened(self, reading: Any, base: int) -> None:
        """The source opened a range (any object with ``next`` and ``stop`` sample numbers)
        whose sample 0 is at position ``base``."""
        self._open[reading] = base

    def position(self, reading: Any) -> int:
        """The position of the sample an open range gave last."""
        return self._open[reading] + reading.next - 1

    def closed(self, reading: Any) -> None:
        """The source read a range to its end."""
        self._open.pop(reading, None)

    def emitted(self, position: int) -> None:
        """The source gave the pipeline the sample at ``position``."""
        self._pending.add(position)

    def done(self, ids: int | list[Any]) -> None:
        """Samples delivered (or dropped by a stage): an item's id, or a batch's ids."""
        if isinstance(ids, int):
            self._pending.discard(ids)
        else:
            for i in ids:
                self.done(i)

    def remaining(self) -> list[tuple[int, int]]:
        """Positions of the plan not yet delivered, as sorted merged intervals."""
        with self._lock:
            cut = list(self._cut)
            taken = self._taken
        parts = list(_rest(self.plan.rows, taken))
        parts += [(p, p + n) for p, n in cut]
        parts += [(base + r.next, base + r.stop) for r, base in self._open.items()]
        parts += runs(self._pending)
        return merge(parts)

    def state(self) -> dict[str, Any]:
        return encode(self.header, self.remaining(), self.plan.extras)


def _rest(rows: Sequence[tuple[int, int]], taken: int) -> Iterable[tuple[int, int]]:
    for a, b in rows:
        if taken >= b - a:
            taken -= b - a
            continue
        yield a + taken, b
        taken = 0


def encode(header: dict[str, Any], remaining: list[tuple[int, int]], extras: Iterable[int]) -> dict[str, Any]:
    """A worker's state: its header, and the positions it has not delivered, its extras
    apart (each with whether it was delivered)."""
    extras = sorted(extras)
    flags = [0 if _contains(remaining, e) else 1 for e in extras]
    kept = _without(remaining, extras)
    return {MARK: STATE_VERSION, **header,
            "remaining": [x for interval in kept for x in interval],
            "extras": [x for pair in zip(extras, flags) for x in pair]}


# --------------------------------------------------------------------------- reading states


@dataclass(frozen=True)
class WorkerState:
    """One worker's state, checked."""

    header: dict[str, Any]
    remaining: list[tuple[int, int]]
    extras: list[tuple[int, bool]]  # (position, delivered)

    def plan(self) -> Plan:
        """The plan resuming this worker alone: its undelivered positions, in order."""
        undelivered = [p for p, delivered in self.extras if not delivered]
        return Plan(tuple(merge([*self.remaining, *((p, p + 1) for p in undelivered)])), frozenset(undelivered),
                    self.header["run"])

    @property
    def unfinished(self) -> bool:
        """Whether the worker stopped with samples not yet delivered (mid-epoch)."""
        return bool(self.remaining) or any(not delivered for _, delivered in self.extras)

    @property
    def where(self) -> str:
        h = self.header
        return f"rank {h['rank']} worker {h['worker']}"


def _int(state: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = state.get(name)
    if type(value) is not int or not low <= value <= high:  # bool, float and str are refused too
        raise ConfigError(f"RemoteDataset state field {name!r} must be an integer in {low}..{high}, got {value!r}")
    return value


def _ints(state: Mapping[str, Any], name: str, samples: int) -> list[int]:
    values = state.get(name)
    if not isinstance(values, (list, tuple)) or len(values) % 2:
        raise ConfigError(f"RemoteDataset state field {name!r} must be a flat list of pairs of integers")
    if not all(type(v) is int and 0 <= v <= samples for v in values):
        bad = next(v for v in values if type(v) is not int or not 0 <= v <= samples)
        raise ConfigError(f"RemoteDataset state field {name!r} holds {bad!r}, not a position in 0..{samples}")
    return list(values)


def parse(state: Any) -> WorkerState:
    """Check a worker state's every field; raise ConfigError naming the first bad one."""
    if not isinstance(state, Mapping) or MARK not in state:
        raise ConfigError("not a RemoteDataset worker state")
    if state[MARK] != STATE_VERSION:
        raise ConfigError(f"RemoteDataset worker state version {state[MARK]!r} is not {STATE_VERSION}")
    missing = [k for k in (*_HEADER, "remaining", "extras") if k not in state]
    if missing:
        raise ConfigError(f"RemoteDataset worker state lacks {', '.join(missing)}")
    if type(state["shuffle"]) is not bool:
        raise ConfigError(f"RemoteDataset state field 'shuffle' must be true or false, got {state['shuffle']!r}")
    samples = _int(state, "samples", 0, 2**62)
    header = {"epoch": _int(state, "epoch", 0, 2**62), "seed": _int(state, "seed", -(2**63), 2**64 - 1),
              "shuffle": state["shuffle"], "samples": samples, "shards": _int(state, "shards", 0, 2**62),
              "run": _int(state, "run", 0, 2**32), "world_size": _int(state, "world_size", 1, 2**20),
              "num_workers": _int(state, "num_workers", 1, 2**20)}
    if "dataset" in state:  # the manifest's identity (states saved before it existed lack it)
        header["dataset"] = _int(state, "dataset", 0, 2**32 - 1)
    header["rank"] = _int(state, "rank", 0, header["world_size"] - 1)
    header["worker"] = _int(state, "worker", 0, header["num_workers"] - 1)
    flat = _ints(state, "remaining", samples)
    remaining = list(zip(flat[::2], flat[1::2]))
    if any(a >= b for a, b in remaining) or any(b1 >= a2 for (_, b1), (a2, _) in pairwise(remaining)):
        raise ConfigError("RemoteDataset state field 'remaining' must hold sorted, disjoint, non-empty intervals")
    flat = _ints(state, "extras", samples)
    if any(p >= samples for p in flat[::2]) or any(d not in (0, 1) for d in flat[1::2]):
        raise ConfigError("RemoteDataset state field 'extras' must pair positions below 'samples' with 0 or 1")
    if len(flat) // 2 >= header["world_size"] + 1:
        raise ConfigError(f"RemoteDataset state lists {len(flat) // 2} extras; a run of {header['world_size']} ranks has fewer")
    return WorkerState(header, remaining, [(p, bool(d)) for p, d in zip(flat[::2], flat[1::2])])


def find_states(obj: Any, depth: int = 0) -> list[Any]:
    """The worker states inside ``obj``: one, a list of them, or the state dicts of
    StatefulDataLoaders (any nesting of dicts and lists, up to a few levels)."""
    if isinstance(obj, Mapping):
        if MARK in obj:
            return [obj]
        children: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        return []
    if depth >= _MAX_DEPTH:
        return []
    return [s for child in children for s in find_states(child, depth + 1)]


_SINCE_SNAPSHOT = "_steps_since_snapshot"
"""StatefulDataLoader's count of batches it yielded after its workers' last snapshot."""


def steps_since_snapshot(obj: Any, depth: int = 0) -> int:
    """The most batches any StatefulDataLoader state inside ``obj`` yielded after its last
    worker snapshot: the steps torchdata would replay on resume."""
    if isinstance(obj, Mapping):
        own = obj.get(_SINCE_SNAPSHOT)
        children: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple)):
        own, children = None, obj
    else:
        return 0
    here = own if isinstance(own, int) else 0
    if depth >= _MAX_DEPTH:
        return here
    return max([here, *(steps_since_snapshot(child, depth + 1) for child in children)])


@dataclass(frozen=True)
class Remainder:
    """The rest of an epoch gathered from every worker's state: intervals of positions,
    sorted; the new run's ranks and workers divide it as they would an epoch."""

    header: dict[str, Any]
    starts: np.ndarray
    stops: np.ndarray
    run: int

    @property
    def epoch(self) -> int:
        return int(self.header["epoch"])

    def __len__(self) -> int:
        return int((self.stops - self.starts).sum())

    def plan(self, low: int, high: int) -> Plan:
        return divide(self.starts, self.stops, low, high, self.run)


def gather(states: Sequence[WorkerState]) -> Remainder:
    """The rest of the epoch the states of all workers of all ranks leave (checks that they
    are all there, from one run, and do not overlap)."""
    if not states:
        raise ConfigError("no RemoteDataset worker state found: pass every rank's state (the loader's state_dict)")
    first = states[0].header
    for s in states:
        for key in ("epoch", "seed", "shuffle", "samples", "shards", "run", "world_size", "num_workers"):
            if s.header[key] != first[key]:
                raise ConfigError(f"states are from different runs: {s.where} has {key}={s.header[key]!r},"
                                  f" rank {first['rank']} worker {first['worker']} has {first[key]!r}")
    seen: dict[tuple[int, int], WorkerState] = {}
    for s in states:
        slot = (s.header["rank"], s.header["worker"])
        if slot in seen:
            raise ConfigError(f"the state of {s.where} is given twice")
        seen[slot] = s
    missing = [f"rank {r} worker {w}" for r in range(first["world_size"]) for w in range(first["num_workers"])
               if (r, w) not in seen]
    if missing:
        raise ConfigError(f"states lack {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: gather the"
                          f" state of every rank ({first['world_size']} ranks x {first['num_workers']} workers)")
    intervals = sorted(interval for s in states for interval in s.remaining)
    for (_, b1), (a2, _) in pairwise(intervals):
        if a2 < b1:
            raise ConfigError(f"states overlap at position {a2}: they are not from one checkpoint of one run")
    delivered = [p for s in states for p, done in s.extras if done]
    rest = _without(merge(intervals), delivered)
    array = np.array(rest, dtype=np.int64).reshape(-1, 2)
    run = zlib.crc32(np.array([first["epoch"], *array.ravel()], dtype=np.int64).tobytes()) or 1
    return Remainder(dict(first), array[:, 0].copy(), array[:, 1].copy(), run)
