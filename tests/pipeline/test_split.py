"""Exact-once coverage, determinism and equal ranks for the epoch split (pure)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_loader.format.epoch_order import EpochOrder, shard_order
from remote_loader.format.shard_counts import ArrayCounts, RunCounts
from remote_loader.pipeline.order.split import PlanSpans, laps, rank_size, worker_bounds


def order_of(counts, rows, seed, epoch, shuffle=True):
    """The epoch's order of a manifest of version 2 (``rows`` None: one block, counts as an
    array) or of version 3 (blocks of ``rows`` shards, counts as runs)."""
    counts = np.asarray(counts, dtype=np.int64)
    return EpochOrder(ArrayCounts(counts) if rows is None else RunCounts.of(counts), rows, seed, epoch, shuffle)


def assign(counts, *, seed, epoch, rank=0, world_size=1, worker=0, num_workers=1, shuffle=True, equalize=False,
           rows=None):
    """The spans of shards worker ``worker`` of rank ``rank`` reads in ``epoch``, in order: its
    positions of the epoch's virtual sequence over that epoch's shard order, as a dataset's
    iteration cuts them."""
    counts = np.asarray(counts, dtype=np.int64)
    low, high = worker_bounds(int(counts.sum()), rank=rank, world_size=world_size, worker=worker,
                              num_workers=num_workers, equalize=equalize)
    if low == high:
        return []
    return list(PlanSpans(order_of(counts, rows, seed, epoch, shuffle), laps(int(counts.sum()), low, high)))


def read(counts, **kwargs):
    return [(s.shard, i) for s in assign(counts, **kwargs) for i in range(s.start, s.end)]


def everything(counts, world_size, num_workers, **kwargs):
    per_rank = {}
    for rank in range(world_size):
        per_rank[rank] = [
            sample
            for worker in range(num_workers)
            for sample in read(
                counts, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, **kwargs
            )
        ]
    return per_rank


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    world_size=st.integers(1, 4),
    num_workers=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 100),
    rows=st.sampled_from([None, 1, 2, 5]),
)
def test_every_sample_exactly_once(counts, world_size, num_workers, seed, epoch, rows):
    per_rank = everything(counts, world_size, num_workers, seed=seed, epoch=epoch, rows=rows)
    seen = Counter(s for samples in per_rank.values() for s in samples)
    assert seen == Counter((shard, i) for shard, n in enumerate(counts) for i in range(n))
    sizes = [len(v) for v in per_rank.values()]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == [rank_size(sum(counts), r, world_size, False) for r in range(world_size)]


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    world_size=st.integers(1, 5),
    num_workers=st.integers(1, 3),
    seed=st.integers(0, 1000),
    rows=st.sampled_from([None, 1, 3]),
)
def test_equalize_gives_equal_ranks_and_repeats_only_the_wrap(counts, world_size, num_workers, seed, rows):
    total = sum(counts)
    per_rank = everything(counts, world_size, num_workers, seed=seed, epoch=0, equalize=True, rows=rows)
    assert {len(v) for v in per_rank.values()} == {-(-total // world_size)}
    seen = Counter(s for samples in per_rank.values() for s in samples)
    assert set(seen) == {(shard, i) for shard, n in enumerate(counts) for i in range(n)}
    assert sum(seen.values()) - total == (-total) % world_size  # exactly the wrapped samples repeat


def test_fewer_shards_than_ranks_times_workers():
    per_rank = everything([5, 3], world_size=3, num_workers=2, seed=0, epoch=0)
    assert sorted(s for v in per_rank.values() for s in v) == [(0, i) for i in range(5)] + [(1, i) for i in range(3)]


def test_same_seed_and_epoch_same_order_next_epoch_differs():
    counts = [10] * 20
    a = read(counts, seed=7, epoch=3)
    assert a == read(counts, seed=7, epoch=3)
    assert a != read(counts, seed=7, epoch=4)
    assert a != read(counts, seed=8, epoch=3)
    assert list(shard_order(20, 7, 3, shuffle=False)) == list(range(20))


def test_shards_stay_whole_except_at_range_boundaries():
    spans = assign([100] * 10, seed=0, epoch=0, rank=1, world_size=3)
    assert sum(1 for s in spans if len(s) < 100) <= 2
    assert all(np.diff([s.start for s in spans[1:-1]]) == 0)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 30), min_size=1, max_size=40),
    rows=st.sampled_from([None, 1, 4, 7, 64]),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
)
def test_locate_finds_the_shard_and_sample_the_spans_read_at_each_position(counts, rows, seed, shuffle):
    order = order_of(counts, rows, seed, 2, shuffle)
    spans = list(PlanSpans(order, [(0, sum(counts))]))
    shards, samples = order.locate(np.arange(sum(counts)))
    assert list(zip(shards.tolist(), samples.tolist(), strict=True)) == [
        (s.shard, i) for s in spans for i in range(s.start, s.end)]


def test_blocks_keep_a_ranks_share_within_its_blocks_and_change_every_epoch():
    """A manifest read by pages: rank 3 of 8 reads whole blocks (pages) of shards but at its
    two ends, so it needs about 1/8 of the pages; each epoch orders blocks and shards anew."""
    counts, rows = [10] * 4096, 64
    shards = {s.shard for s in assign(counts, seed=1, epoch=0, rank=3, world_size=8, rows=rows)}
    pages = {shard // rows for shard in shards}
    assert len(shards) == 4096 // 8 and len(pages) <= 4096 // rows // 8 + 1
    assert read(counts, seed=1, epoch=0, rows=rows) != read(counts, seed=1, epoch=1, rows=rows)
    assert [s.shard for s in assign(counts, seed=1, epoch=0, shuffle=False, rows=rows)] == list(range(4096))


def test_one_block_of_every_shard_is_the_order_states_were_saved_with():
    counts = [3, 1, 4, 1, 5, 9, 2, 6]
    spans = assign(counts, seed=5, epoch=1)
    assert [s.shard for s in spans] == shard_order(len(counts), 5, 1).tolist()
