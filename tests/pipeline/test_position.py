"""The position logic of checkpoints on its own, without a server: plans cut from an epoch,
a worker's progress and the state it gives, and the rest of an epoch gathered from every
worker's state and divided again. Positions are plain integers here."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_loader.errors import ConfigError
from remote_loader.pipeline.resume.intervals import merge, runs
from remote_loader.pipeline.resume.progress import Progress
from remote_loader.pipeline.resume.states import Remainder, gather, parse
from remote_loader.pipeline.split import divide, worker_bounds


def _header(epoch: int, samples: int, rank: int, world: int, worker: int, workers: int) -> dict[str, object]:
    return {"epoch": epoch, "seed": 0, "shuffle": True, "samples": samples, "shards": 1, "run": 0, "rank": rank,
            "world_size": world, "worker": worker, "num_workers": workers}


def _plans(total: int, world: int, workers: int, equalize: bool, sequence: Remainder | None = None):
    starts, stops = (np.array([0]), np.array([total])) if sequence is None else (sequence.starts, sequence.stops)
    length = int((stops - starts).sum())
    for rank in range(world):
        for worker in range(workers):
            low, high = worker_bounds(length, rank=rank, world_size=world, worker=worker, num_workers=workers,
                                      equalize=equalize)
            yield rank, worker, divide(starts, stops, low, high, 0 if sequence is None else sequence.run)


def _positions(plan) -> list[int]:
    return [p for a, b in plan.rows for p in range(a, b)]


@dataclass(eq=False)
class _Range:
    """What the source keeps of an open range: the next sample number and the end."""

    next: int
    stop: int


def _run_worker(plan, header, rng: random.Random, stop_after: int):
    """A worker's iteration, played on integers: the cutter takes the plan 10 samples at a
    time and cuts them into ranges of up to 5, the source keeps up to 2 ranges open and
    emits from either, a buffer of up to 7 samples delivers a random one, which alone
    reaches the progress. Returns the positions delivered and the state."""
    progress = Progress(plan, header)
    rows = [(a, b) for a, b in plan.rows]
    delivered, buffer, reading, cut = [], [], [], []
    while len(delivered) < stop_after and (rows or cut or reading or buffer):
        if rows and not cut:
            a, b = rows[0]
            taken = min(10, b - a)
            rows[0] = (a + taken, b)
            if a + taken == b:
                rows.pop(0)
            cut = [(p, min(5, a + taken - p)) for p in range(a, a + taken, 5)]
        while cut and len(reading) < 2:
            start, n = cut.pop(0)
            reading.append((_Range(0, n), start))
        if reading:
            r, base = rng.choice(reading)
            position = base + r.next
            r.next += 1
            if r.next == r.stop:
                reading.remove((r, base))
            buffer.append(position)
        if buffer and (len(buffer) >= 7 or not (rows or cut or reading)):
            position = buffer.pop(rng.randrange(len(buffer)))
            progress.done(position)
            delivered.append(position)
    return delivered, progress.state()


@pytest.mark.parametrize("world,workers", [(1, 1), (2, 3), (4, 2), (3, 1)])
@pytest.mark.parametrize("equalize", [False, True])
def test_the_plans_of_an_epoch_cover_it_once_and_mark_repeats_as_extras(world, workers, equalize):
    total = 101
    seen: list[int] = []
    extras = 0
    for _, _, plan in _plans(total, world, workers, equalize):
        seen += _positions(plan)
        extras += len(plan.extras)
    assert sorted(set(seen)) == list(range(total))
    assert len(seen) == total + extras
    assert extras == ((-total) % world if equalize else 0)


def test_merge_and_runs():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert merge([(0, 10), (2, 3)]) == [(0, 10)]  # one inside another
    assert runs([4, 1, 2, 3, 9]) == [(1, 5), (9, 10)]


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 300), world=st.integers(1, 3), workers=st.integers(1, 3), equalize=st.booleans(),
       new_world=st.integers(1, 3), new_workers=st.integers(1, 4), seed=st.integers(0, 2**16),
       fraction=st.floats(0, 1))
def test_states_taken_mid_epoch_resume_the_rest_exactly_once_on_any_split(total, world, workers, equalize, new_world,
                                                                          new_workers, seed, fraction):
    rng = random.Random(seed)
    delivered: list[int] = []
    states = []
    for rank, worker, plan in _plans(total, world, workers, equalize):
        share = sum(b - a for a, b in plan.rows)
        got, state = _run_worker(plan, _header(0, total, rank, world, worker, workers), rng, int(share * fraction))
        delivered += got
        states.append(parse(state))
    rest = gather(states)
    assert len(rest) == total - len(set(delivered))
    resumed = [p for _, _, plan in _plans(total, new_world, new_workers, False, rest) for p in _positions(plan)]
    assert len(resumed) == len(set(resumed))  # nothing twice after the resume
    assert set(resumed) | set(delivered) == set(range(total))  # nothing lost
    assert not set(resumed) & set(delivered)


def test_a_worker_state_resumes_that_worker_alone_with_what_it_had_not_delivered():
    total = 60
    (_, _, plan), = _plans(total, 1, 1, False)
    delivered, state = _run_worker(plan, _header(3, total, 0, 1, 0, 1), random.Random(1), 25)
    worker = parse(state)
    assert worker.unfinished and worker.header["epoch"] == 3
    assert sorted(_positions(worker.plan())) == sorted(set(range(total)) - set(delivered))
    _, finished = _run_worker(plan, _header(3, total, 0, 1, 0, 1), random.Random(1), total)
    assert not parse(finished).unfinished


def test_a_state_is_small_whatever_the_epoch():
    for total in (1_000, 1_000_000):
        (_, _, plan), = _plans(total, 1, 1, False)
        _, state = _run_worker(plan, _header(0, total, 0, 1, 0, 1), random.Random(2), 200)
        assert len(state["remaining"]) <= 2 * (7 + 2 + 2 + 1)  # buffer, open ranges, cut, the rest of the plan


def test_gather_refuses_missing_repeated_and_overlapping_states():
    total = 40
    states = []
    for rank, worker, plan in _plans(total, 2, 1, False):
        states.append(parse(_run_worker(plan, _header(0, total, rank, 2, worker, 1), random.Random(3), 5)[1]))
    with pytest.raises(ConfigError, match="states lack rank 1 worker 0"):
        gather(states[:1])
    with pytest.raises(ConfigError, match="given twice"):
        gather([states[0], states[0], states[1]])
    overlapping = parse({**states[1].header, "remote_loader_state": 2, "extras": [],
                         "remaining": [a for interval in states[0].remaining for a in interval]})
    with pytest.raises(ConfigError, match="overlap"):
        gather([states[0], overlapping])
