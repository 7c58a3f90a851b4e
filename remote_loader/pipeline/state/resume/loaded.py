"""What ``load_state_dict`` was given, checked and turned into one kind of thing (``Loaded``),
and where each worker's next iteration starts from it (``start``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remote_loader.errors import ResumeError
from remote_loader.pipeline.order.split import Plan, worker_bounds
from remote_loader.pipeline.state.resume.item_counts import ResumeState
from remote_loader.pipeline.state.resume.layout import Layout
from remote_loader.pipeline.state.resume.states import (
    Remainder,
    WorkerState,
    find_states,
    gather,
    parse,
    steps_since_snapshot,
)


@dataclass(frozen=True)
class Entry:
    """Where one worker enters its plan (an iteration begins): the plan, the outputs of its delivery order
    delivered before (a resume's), and the positions its own state listed as not delivered
    (checked against its regenerated order; None where none were listed)."""

    plan: Plan
    delivered: int = 0
    listed: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class Loaded:
    """A loaded state, for the next iteration of its epoch: each worker's own (``own``, by
    worker: it goes on exactly in order), or the rest of the epoch gathered from every
    worker's (``rest``: divided as an epoch is, exactly in set); both for one process's state
    of a world of one (its own where the iteration has the same place, else its rest divided).

    Attributes:
        finished: Nothing of the epoch was left: the next iteration starts the next epoch.
        pending: Stopped mid-epoch: its rest is owed to an iteration of its epoch.
    """

    epoch: int
    own: Mapping[int, WorkerState] = field(default_factory=dict)
    rest: Remainder | None = None
    finished: bool = False
    pending: bool = False


def load(layout: Layout, state: Any, worker: tuple[int, int] | None) -> Loaded:
    """``state`` checked against ``layout``, as a ``Loaded``; ``worker`` is ``(id,
    num_workers)`` of the DataLoader worker loading it (StatefulDataLoader restores each
    worker with its own), None in the main process."""
    replayed = steps_since_snapshot(state)
    if replayed:
        raise ResumeError(f"this StatefulDataLoader state was taken {replayed} batches after its workers' last"
                          " snapshot, so it does not say which samples those batches held: on the same ranks"
                          " and workers give it to the loader's load_state_dict, which replays them; to resume"
                          " on others, take states with snapshot_every_n_steps=1 (its default)")
    found = find_states(state)
    if not found:
        if not isinstance(state, Mapping):
            raise ResumeError(f"no RemoteDataset worker state found in this {type(state).__name__} (looked"
                              " 8 levels deep): pass state_dict()s or StatefulDataLoader.state_dict()s")
        return _counted(layout, ResumeState.from_dict(state))
    parsed = [layout.check(parse(s)) for s in found]
    rank, world_size = layout.rank, layout.world_size
    if worker is not None:
        if len(parsed) != 1 or _split(parsed[0]) != (rank, world_size, *worker):
            raise ResumeError(f"a DataLoader worker loads its own state only (rank {rank} worker {worker[0]} of"
                              f" {world_size} x {worker[1]}); gather every rank's state in the main process")
        return _own({worker[0]: parsed[0]})
    only = parsed[0].header
    own = len(parsed) == 1 and only["num_workers"] == 1 and (only["rank"], only["world_size"]) == (rank, world_size)
    if own and world_size > 1:
        return _own({0: parsed[0]})  # this rank's own, without DataLoader workers
    rest = gather(parsed)
    # One process's state of a world of one is also the whole epoch's: its own where it iterates
    # without workers again (in the uninterrupted order), its rest divided where it has workers.
    return Loaded(rest.epoch, own={0: parsed[0]} if own else {}, rest=rest, finished=not len(rest),
                  pending=bool(len(rest)))


def _own(states: dict[int, WorkerState]) -> Loaded:
    state = next(iter(states.values()))
    unfinished = any(s.unfinished for s in states.values())
    return Loaded(int(state.header["epoch"]), own=states, finished=not unfinished, pending=unfinished)


def _split(state: WorkerState) -> tuple[int, int, int, int]:
    h = state.header
    return h["rank"], h["world_size"], h["worker"], h["num_workers"]


def _counted(layout: Layout, counts: ResumeState) -> Loaded:
    """A count state (``state_dict(consumed=...)``) converted into each worker's own state:
    its count of samples delivered, listing no positions."""
    if counts.seed != layout.seed:
        raise ResumeError(f"state was saved with seed {counts.seed}, this dataset has seed {layout.seed}")
    layout.check_identity(counts.dataset)
    per_item = layout.per_item()
    if counts.split is not None and counts.split != (per_item, layout.world_size):
        (items, world), now = counts.split, (per_item, layout.world_size)
        raise ResumeError(
            f"this state counts items of {items} samples on {world} rank(s); this pipeline's items hold"
            f" {now[0]} on {now[1]}: the workers' shares are cut by them, so a count state resumes the"
            " pipeline it counted only (torchdata's StatefulDataLoader states resume any batch size and world)")
    if counts.mixing is not None and counts.mixing != layout.mixing:
        raise ResumeError(
            f"this state counts samples of a pipeline that mixes them otherwise (open_shards, shuffle buffer, initial:"
            f" {counts.mixing.as_list()}, here {layout.mixing.as_list()}): each worker's order depends on them, so a"
            " count state resumes the pipeline it counted only (torchdata's StatefulDataLoader states resume any)")
    shares = [layout.worker_samples(w, counts.num_workers) for w in range(counts.num_workers)]
    for w, (skip, samples) in enumerate(zip(counts.skip, shares, strict=True)):
        if skip > -(-samples // per_item) * per_item:
            raise ResumeError(f"state skips {skip} samples of worker {w}, which has {samples} in epoch"
                              f" {counts.epoch}: it was saved for another dataset or split")
        if skip % per_item and skip < samples:
            raise ResumeError(f"state skips {skip} samples of worker {w}: not a whole number of items of {per_item}")
    own = {w: WorkerState(layout.header(counts.epoch, w, counts.num_workers), layout.mixing, skip, None, [])
           for w, skip in enumerate(counts.skip)}
    # Done where every worker delivered all its items (without a short last batch, the samples after them are none)
    ends = [min(layout.worker_items(w, counts.num_workers) * per_item, n) for w, n in enumerate(shares)]
    finished = all(skip >= end for skip, end in zip(counts.skip, ends, strict=True))
    return Loaded(counts.epoch, own=own, finished=finished, pending=not finished and any(counts.skip))


def entry(layout: Layout, loaded: Loaded | None, epoch: int, worker: int, num_workers: int) -> Entry:
    """Where ``worker``'s iteration of ``epoch`` starts: from its own state in ``loaded``,
    from its share of the rest ``loaded`` gathered, or at the start of its share of the epoch."""
    if loaded is None or loaded.epoch != epoch:
        return Entry(share(layout, None, worker, num_workers))
    state = loaded.own.get(worker)
    if loaded.rest is not None and (state is None or state.mixing != layout.mixing
                                    or _split(state) != (layout.rank, layout.world_size, worker, num_workers)):
        return Entry(share(layout, loaded.rest, worker, num_workers))
    state = state or next(iter(loaded.own.values()))
    if _split(state) != (layout.rank, layout.world_size, worker, num_workers):
        saved = "rank {rank}/{world_size} worker {worker}/{num_workers}".format(**state.header)
        how = ("a count state resumes the ranks and workers it counted only" if state.remaining is None else
               "to resume on other ranks or workers, give load_state_dict every rank's state")
        raise ResumeError(f"the loaded state is {saved}'s own, not this worker's ({layout.rank}/{layout.world_size},"
                          f" {worker}/{num_workers}): {how}")
    if state.mixing != layout.mixing:
        raise ResumeError(
            f"the state of {state.where} was taken in a pipeline that mixes samples otherwise (open_shards,"
            f" shuffle buffer, initial: {state.mixing.as_list()}, here {layout.mixing.as_list()}): its order"
            " cannot be followed; give load_state_dict every rank's state to resume its rest in this pipeline's order")
    if state.rows is not None:
        plan = Plan(state.rows, frozenset(p for p, _ in state.extras), state.header["run"])
    else:
        plan = share(layout, None, worker, num_workers)
    return Entry(plan, state.delivered, None if state.remaining is None else state.undelivered())


def share(layout: Layout, rest: Remainder | None, worker: int, num_workers: int) -> Plan:
    """This worker's share of the sequence divided: the rest of an epoch, or the whole epoch."""
    total = len(layout.reader)
    sequence = rest if rest is not None else Remainder({}, np.array([0]), np.array([total]), 0)
    low, high = worker_bounds(len(sequence), rank=layout.rank, world_size=layout.world_size, worker=worker,
                              num_workers=num_workers, equalize=layout.equalize, align=layout.align())
    return sequence.plan(low, high)
