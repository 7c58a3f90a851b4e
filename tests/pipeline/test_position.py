"""The position logic of checkpoints on its own, without a server: a worker's delivery order
on integers, the point it stands at after any number of outputs, the state taken there, and
the rest of an epoch gathered from every worker's state and divided again."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_loader.errors import ConfigError
from remote_loader.format.epoch_order import EpochOrder
from remote_loader.format.shard_counts import ArrayCounts
from remote_loader.pipeline.order.delivery import (
    Mixing,
    Shuffler,
    fast_forward,
    groups,
    ranges_in_need,
    read_positions,
    undelivered_at,
)
from remote_loader.pipeline.order.intervals import merge
from remote_loader.pipeline.order.split import PlanSpans, divide, worker_bounds
from remote_loader.pipeline.state.resume.states import Remainder, encode, gather, parse

SEEDS = ((1, 0, 0, 0, 1), (1, 0, 0, 0, 2))


def _header(epoch: int, samples: int, rank: int, world: int, worker: int, workers: int, run: int = 0):
    return {"epoch": epoch, "seed": 0, "shuffle": True, "samples": samples, "shards": 1, "run": run, "rank": rank,
            "world_size": world, "worker": worker, "num_workers": workers, "dataset": 0}


def _plans(total: int, world: int, workers: int, equalize: bool, sequence: Remainder | None = None):
    starts, stops = (np.array([0]), np.array([total])) if sequence is None else (sequence.starts, sequence.stops)
    length = int((stops - starts).sum())
    for rank in range(world):
        for worker in range(workers):
            low, high = worker_bounds(length, rank=rank, world_size=world, worker=worker, num_workers=workers,
                                      equalize=equalize)
            yield rank, worker, divide(starts, stops, low, high, 0 if sequence is None else sequence.run)


def _manifest_order(counts: np.ndarray) -> EpochOrder:
    return EpochOrder(ArrayCounts(counts), None, 0, 0, shuffle=False)


def _spans(total: int, shard: int, rows):
    """A dataset of ``total`` samples in shards of ``shard``, in manifest order."""
    counts = np.array([shard] * (total // shard) + ([total % shard] if total % shard else []), dtype=np.int64)
    return PlanSpans(_manifest_order(counts), rows)


def _order(spans, mixing: Mixing) -> list[int]:
    reads = read_positions(groups(spans, mixing.open_shards, SEEDS[0]))
    if not mixing.bufsize:
        return list(reads)
    return list(Shuffler(mixing.bufsize, mixing.initial, SEEDS[1]).run(reads))


def _positions(plan) -> list[int]:
    return [p for a, b in plan.rows for p in range(a, b)]


MIXINGS = [Mixing(1), Mixing(3), Mixing(2, 7, 7), Mixing(4, 10, 0), Mixing(3, 1, 1)]


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


def test_merge():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert merge([(0, 10), (2, 3)]) == [(0, 10)]  # one inside another
    assert merge([]) == [] and merge([(3, 4)]) == [(3, 4)]


@pytest.mark.parametrize("mixing", MIXINGS, ids=str)
def test_a_delivery_order_gives_every_position_of_the_plan_once_and_reads_each_shard_in_sequence(mixing):
    rows = [(0, 37), (50, 90)]
    spans = _spans(100, 9, rows)
    order = _order(spans, mixing)
    assert sorted(order) == [p for a, b in rows for p in range(a, b)]
    reads = list(read_positions(groups(spans, mixing.open_shards, SEEDS[0])))
    for span in spans:  # each span's positions are read in increasing order
        mine = [p for p in reads if span.position <= p < span.position + len(span)]
        assert mine == sorted(mine)
    assert _order(spans, mixing) == order  # the same seeds, the same order


def test_groups_mix_their_spans_and_a_new_seed_mixes_them_otherwise():
    spans = list(_spans(120, 30, [(0, 120)]))
    first = next(groups(spans, 4, (1,)))
    assert sorted(set(first.labels.tolist())) == [0, 1, 2, 3] and len(first) == 120
    assert first.labels[:30].tolist() != [0] * 30  # interleaved, not one span after the other
    assert next(groups(spans, 4, (2,))).labels.tolist() != first.labels.tolist()


@settings(max_examples=40, deadline=None)
@given(total=st.integers(1, 160), shard=st.integers(1, 40), mixing=st.sampled_from(MIXINGS),
       fraction=st.floats(0, 1))
def test_the_point_after_n_outputs_is_where_the_uninterrupted_order_stands(total, shard, mixing, fraction):
    rows = [(0, total)]
    spans = _spans(total, shard, rows)
    order = _order(spans, mixing)
    n = int(len(order) * fraction)
    point = fast_forward(spans, mixing, SEEDS, n)
    assert point.outputs == n
    assert undelivered_at(point, spans, rows, mixing.open_shards, SEEDS[0]) == merge((p, p + 1) for p in order[n:])
    # Restored at the point, the shuffle buffer and the reads go on as the uninterrupted order.
    reads = read_positions(groups(spans, mixing.open_shards, SEEDS[0], first=point.group))
    rest = itertools.islice(reads, point.reads - point.group_start, None)
    if mixing.bufsize:
        rest = Shuffler(mixing.bufsize, mixing.initial, SEEDS[1], point.held, point.outputs).run(rest)
    assert list(rest) == order[n:]


def test_a_shuffler_draws_the_same_whatever_the_batches_of_its_draws():
    items = list(range(3000))
    whole = list(Shuffler(100, 100, (5,)).run(iter(items)))
    assert sorted(whole) == items and whole != items
    assert list(itertools.islice(Shuffler(100, 100, (5,)).run(iter(items)), 1500)) == whole[:1500]


def _run_worker(plan, header, mixing: Mixing, stop_after: int, total: int, shard: int):
    """A worker's iteration played on integers: its order, stopped after ``stop_after``
    outputs; returns what it delivered and its state there."""
    spans = _spans(total, shard, plan.rows)
    order = _order(spans, mixing)
    point = fast_forward(spans, mixing, SEEDS, stop_after)
    undelivered = undelivered_at(point, spans, plan.rows, mixing.open_shards, SEEDS[0])
    return order[:stop_after], encode(header, mixing, point.outputs, undelivered, plan.extras, plan.rows)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 300), world=st.integers(1, 3), workers=st.integers(1, 3), equalize=st.booleans(),
       new_world=st.integers(1, 3), new_workers=st.integers(1, 4), mixing=st.sampled_from(MIXINGS),
       fraction=st.floats(0, 1))
def test_states_taken_mid_epoch_resume_the_rest_exactly_once_on_any_split(total, world, workers, equalize, new_world,
                                                                          new_workers, mixing, fraction):
    delivered: list[int] = []
    states = []
    for rank, worker, plan in _plans(total, world, workers, equalize):
        share = sum(b - a for a, b in plan.rows)
        got, state = _run_worker(plan, _header(0, total, rank, world, worker, workers), mixing,
                                 int(share * fraction), total, 7)
        delivered += got
        states.append(parse(state))
    rest = gather(states)
    assert len(rest) == total - len(set(delivered))
    resumed = [p for _, _, plan in _plans(total, new_world, new_workers, False, rest) for p in _positions(plan)]
    assert len(resumed) == len(set(resumed))  # nothing twice after the resume
    assert set(resumed) | set(delivered) == set(range(total))  # nothing lost
    assert not set(resumed) & set(delivered)


def test_a_state_is_small_whatever_the_epoch():
    for total in (1_000, 1_000_000):
        (_, _, plan), = _plans(total, 1, 1, False)
        _, state = _run_worker(plan, _header(0, total, 0, 1, 0, 1), Mixing(2, 7, 7), 200, total, 100)
        assert len(state["remaining"]) <= 2 * (7 + 2 + 1)  # the buffer, the spans being read, the rest of the plan
        assert parse(state).delivered == 200


def test_gather_refuses_missing_repeated_and_overlapping_states():
    total = 40
    states = []
    for rank, worker, plan in _plans(total, 2, 1, False):
        states.append(parse(_run_worker(plan, _header(0, total, rank, 2, worker, 1), Mixing(2, 7, 7), 5, total,
                                        10)[1]))
    with pytest.raises(ConfigError, match="states lack rank 1 worker 0"):
        gather(states[:1])
    with pytest.raises(ConfigError, match="given twice"):
        gather([states[0], states[0], states[1]])
    overlapping = parse({**encode(states[1].header, Mixing(2, 7, 7), 0, states[0].remaining, (), states[0].remaining)})
    with pytest.raises(ConfigError, match="overlap"):
        gather([states[0], overlapping])


def test_a_resumed_rest_states_its_plan_and_refuses_a_plan_naming_a_position_twice():
    (_, _, plan), = _plans(50, 1, 1, False, Remainder({}, np.array([3, 20]), np.array([10, 30]), 77))
    _, state = _run_worker(plan, _header(0, 50, 0, 1, 0, 1, run=77), Mixing(2), 4, 50, 10)
    assert state["plan"] == [3, 10, 20, 30] and parse(state).rows == ((3, 10), (20, 30))
    with pytest.raises(ConfigError, match="names a position twice"):
        parse({**state, "plan": [3, 10, 5, 12]})


def test_orders_differ_by_seed_and_mixing():
    spans = _spans(200, 20, [(0, 200)])
    assert _order(spans, Mixing(4, 50, 50)) != _order(spans, Mixing(4, 60, 60))
    assert _order(spans, Mixing(4)) != _order(spans, Mixing(2))
    random.Random(0)  # determinism above owes nothing to a global generator


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5), per=st.integers(1, 7), offset=st.floats(0, 1),
       seed=st.integers(0, 100))
def test_ranges_come_in_the_order_a_reader_opens_them(lengths, per, offset, seed):
    counts = np.array(lengths, dtype=np.int64)
    spans = list(PlanSpans(_manifest_order(counts), [(0, int(counts.sum()))]))
    group = next(groups(spans, len(spans), (seed,)))
    start = int(len(group) * offset)
    cursors = group.cursors(start).tolist()
    rng = random.Random(seed)
    bounds = []  # ranges of any lengths, as a shard's sample sizes cut them
    for slot, span in enumerate(spans):
        cuts = [span.start + cursors[slot]]
        while cuts[-1] < span.end:
            cuts.append(min(span.end, cuts[-1] + rng.randint(1, per + slot % 2)))
        bounds.append(cuts)
    needed = ranges_in_need(group, start, bounds)
    left = [0] * len(spans)  # samples left in each slot's open range
    opened = []
    for read, slot in enumerate(group.labels[start:].tolist()):
        if not left[slot]:
            at, s, first, stop = needed[len(opened)]
            assert (at, s, first) == (read, slot, spans[slot].start + cursors[slot])
            opened.append((first, stop))
            left[slot] = stop - first
        left[slot] -= 1
        cursors[slot] += 1
    assert len(opened) == len(needed)  # every range is opened, and each once
    assert sum(b - a for a, b in opened) == len(group) - start
