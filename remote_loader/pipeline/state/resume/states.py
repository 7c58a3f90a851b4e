"""Worker states: what one holds (``encode``), each field checked (``parse``), the worker
states inside a loader's state, and the rest of an epoch gathered from every worker's state.

A worker's state is its header (epoch, seed, dataset identity, its place among ranks and
workers, the run), the ``mixing`` its delivery order depends on (``delivery.py``), how many
outputs of that order it had delivered, the positions of its plan not yet delivered (merged
intervals, extras apart with whether each was delivered), and for a worker of a resumed
rest, its plan. Its size follows the open shards and the shuffle buffer, never the dataset.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from remote_loader.checks import require_int, shown
from remote_loader.config import MOST_EPOCH
from remote_loader.errors import ResumeError
from remote_loader.pipeline.order.delivery import Mixing
from remote_loader.pipeline.order.intervals import contains, merge, without
from remote_loader.pipeline.order.split import Plan, divide

STATE_VERSION = 3
MARK = "remote_loader_state"
"""The key that marks a worker's state (its value is the state's version)."""
_HEADER = ("epoch", "seed", "shuffle", "samples", "shards", "run", "rank", "world_size", "worker", "num_workers")
_MAX_DEPTH = 8  # how deep load_state_dict looks for worker states inside a loader's state
_MAX_BUFFER = 1 << 24  # the largest shuffle buffer a state may name (a bound on what loading one allocates)


def encode(header: dict[str, Any], mixing: Mixing, delivered: int, undelivered: list[tuple[int, int]],
           extras: Iterable[int], rows: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """A worker's state (see the module's docstring); ``rows``, its plan, is listed for a run
    that is not an epoch's own split, and counted for every state (``planned``)."""
    extras = sorted(extras)
    flags = [0 if contains(undelivered, e) else 1 for e in extras]
    kept = without(undelivered, extras)
    state = {MARK: STATE_VERSION, **header, "mixing": mixing.as_list(), "delivered": delivered,
             "remaining": [x for interval in kept for x in interval],
             "extras": [x for pair in zip(extras, flags, strict=True) for x in pair],
             "planned": sum(b - a for a, b in rows)}
    if header["run"]:
        state["plan"] = [x for row in rows for x in row]
    return state


@dataclass(frozen=True)
class WorkerState:
    """One worker's state, checked."""

    header: dict[str, Any]
    mixing: Mixing
    delivered: int
    remaining: list[tuple[int, int]] | None  # None: a count state's, which lists no positions
    extras: list[tuple[int, bool]]  # (position, delivered)
    rows: tuple[tuple[int, int], ...] | None = None  # the plan of a resumed rest's worker

    def undelivered(self) -> list[tuple[int, int]]:
        """The positions not delivered, extras included, as sorted merged intervals."""
        return merge([*(self.remaining or ()), *((p, p + 1) for p, delivered in self.extras if not delivered)])

    @property
    def unfinished(self) -> bool:
        """Whether the worker stopped with samples not yet delivered (mid-epoch)."""
        return self.remaining is None or bool(self.remaining) or any(not delivered for _, delivered in self.extras)

    @property
    def where(self) -> str:
        h = self.header
        return f"rank {h['rank']} worker {h['worker']}"


def _int(state: Mapping[str, Any], name: str, low: int, high: int) -> int:
    return require_int(f"RemoteDataset state field {name!r}", state.get(name), low, high, error=ResumeError, exact=True)


def _intervals(state: Mapping[str, Any], name: str, samples: int, *, ordered: bool) -> list[tuple[int, int]]:
    """A flat list of pairs ``[a, b)`` of positions; sorted and disjoint unless only ``ordered``
    as a plan is (non-empty, any order)."""
    values = state.get(name)
    if not isinstance(values, (list, tuple)) or len(values) % 2:
        raise ResumeError(f"RemoteDataset state field {name!r} must be a flat list of pairs of integers")
    if not all(type(v) is int and 0 <= v <= samples for v in values):
        bad = next(v for v in values if type(v) is not int or not 0 <= v <= samples)
        raise ResumeError(f"RemoteDataset state field {name!r} holds {bad!r}, not a position in 0..{samples}")
    pairs = list(zip(values[::2], values[1::2], strict=True))
    if any(a >= b for a, b in pairs) or (not ordered and any(b1 >= a2 for (_, b1), (a2, _) in pairwise(pairs))):
        raise ResumeError(f"RemoteDataset state field {name!r} must hold {'' if ordered else 'sorted, disjoint, '}"
                          "non-empty intervals")
    return pairs


def parse_mixing(state: Mapping[str, Any]) -> Mixing:
    """A state's field ``mixing`` (``[open_shards, bufsize, initial]``), checked."""
    values = state.get("mixing")
    if not isinstance(values, (list, tuple)) or len(values) != 3:
        raise ResumeError("RemoteDataset state field 'mixing' must be [open_shards, bufsize, initial]")
    open_shards = _int({"mixing[0]": values[0]}, "mixing[0]", 1, 1 << 16)
    bufsize = _int({"mixing[1]": values[1]}, "mixing[1]", 0, _MAX_BUFFER)
    initial = _int({"mixing[2]": values[2]}, "mixing[2]", 0, bufsize)
    return Mixing(open_shards, bufsize, initial)


def parse(state: Any) -> WorkerState:
    """Check a worker state's every field; raise ResumeError naming the first bad one."""
    if not isinstance(state, Mapping) or MARK not in state:
        raise ResumeError("not a RemoteDataset worker state")
    if type(state[MARK]) is not int or state[MARK] != STATE_VERSION:  # an array compares per item
        raise ResumeError(f"RemoteDataset worker state version {shown(state[MARK])} is not {STATE_VERSION}: it was"
                          " saved by another version of remote_loader, whose states this one does not read")
    missing = [k for k in (*_HEADER, "dataset", "mixing", "delivered", "remaining", "extras") if k not in state]
    if missing:
        raise ResumeError(f"RemoteDataset worker state lacks {', '.join(missing)}")
    if type(state["shuffle"]) is not bool:
        raise ResumeError(f"RemoteDataset state field 'shuffle' must be true or false, got {shown(state['shuffle'])}")
    samples = _int(state, "samples", 0, 2**62)
    header = {"epoch": _int(state, "epoch", 0, MOST_EPOCH), "seed": _int(state, "seed", -(2**63), 2**64 - 1),
              "shuffle": state["shuffle"], "samples": samples, "shards": _int(state, "shards", 0, 2**62),
              "run": _int(state, "run", 0, 2**32), "world_size": _int(state, "world_size", 1, 2**20),
              "num_workers": _int(state, "num_workers", 1, 2**20)}
    header["dataset"] = _int(state, "dataset", 0, 2**32 - 1)  # the manifest's identity: a state names it always
    header["rank"] = _int(state, "rank", 0, header["world_size"] - 1)
    header["worker"] = _int(state, "worker", 0, header["num_workers"] - 1)
    remaining = _intervals(state, "remaining", samples, ordered=False)
    flat = state["extras"]
    if not isinstance(flat, (list, tuple)) or len(flat) % 2 or not all(type(v) is int for v in flat) \
            or any(not 0 <= p < samples for p in flat[::2]) or any(d not in (0, 1) for d in flat[1::2]):
        raise ResumeError("RemoteDataset state field 'extras' must pair positions below 'samples' with 0 or 1")
    if len(flat) // 2 >= header["world_size"] + 1:
        raise ResumeError(
            f"RemoteDataset state lists {len(flat) // 2} extras; a run of {header['world_size']} ranks has fewer"
        )
    extras = [(p, bool(d)) for p, d in zip(flat[::2], flat[1::2], strict=True)]
    rows = None
    if header["run"]:
        if "plan" not in state:
            raise ResumeError("RemoteDataset worker state of a resumed rest (run != 0) lacks its 'plan'")
        rows = tuple(_intervals(state, "plan", samples, ordered=True))
        if sum(b - a for a, b in merge(rows)) != sum(b - a for a, b in rows):
            raise ResumeError("RemoteDataset state field 'plan' names a position twice")
    bound = sum(b - a for a, b in rows) if rows is not None else samples
    delivered = _int(state, "delivered", 0, bound)
    parsed = WorkerState(header, parse_mixing(state), delivered, remaining, extras, rows)
    if "planned" in state:  # states saved before it was added lack it
        _adds_up(parsed, _int(state, "planned", 0, bound))
    return parsed


def _adds_up(state: WorkerState, planned: int) -> None:
    """Every position of the worker's plan is either delivered or listed as not: a state whose
    lists were cut by hand would lose their samples in an elastic resume."""
    listed = sum(b - a for a, b in state.undelivered())
    if state.rows is not None and sum(b - a for a, b in state.rows) != planned:
        raise ResumeError(f"the state of {state.where} says its plan holds {planned} positions; its 'plan' lists"
                          f" {sum(b - a for a, b in state.rows)}: it was altered")
    if state.delivered + listed != planned:
        raise ResumeError(f"the state of {state.where} does not add up: {state.delivered} positions delivered and"
                          f" {listed} listed as not, of the {planned} it reads: it was altered")


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
        raise ResumeError("no RemoteDataset worker state found: pass every rank's state (the loader's state_dict)")
    first = states[0].header
    for s in states:
        for key in ("epoch", "seed", "shuffle", "samples", "shards", "run", "world_size", "num_workers"):
            if s.header[key] != first[key]:
                raise ResumeError(
                    f"states are from different runs: {s.where} has {key}={s.header[key]!r},"
                    f" rank {first['rank']} worker {first['worker']} has {first[key]!r}"
                )
    seen: dict[tuple[int, int], WorkerState] = {}
    for s in states:
        slot = (s.header["rank"], s.header["worker"])
        if slot in seen:
            raise ResumeError(f"the state of {s.where} is given twice")
        seen[slot] = s
    missing = [
        f"rank {r} worker {w}"
        for r in range(first["world_size"])
        for w in range(first["num_workers"])
        if (r, w) not in seen
    ]
    if missing:
        raise ResumeError(
            f"states lack {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: gather the"
            f" state of every rank ({first['world_size']} ranks x {first['num_workers']} workers)"
        )
    intervals = sorted(interval for s in states for interval in s.remaining or ())
    for (_, b1), (a2, _) in pairwise(intervals):
        if a2 < b1:
            raise ResumeError(f"states overlap at position {a2}: they are not from one checkpoint of one run")
    delivered = [p for s in states for p, done in s.extras if done]
    rest = without(merge(intervals), delivered)
    array = np.array(rest, dtype=np.int64).reshape(-1, 2)
    run = zlib.crc32(np.array([first["epoch"], *array.ravel()], dtype=np.int64).tobytes()) or 1
    return Remainder(dict(first), array[:, 0].copy(), array[:, 1].copy(), run)
