"""The map-style samplers on their own (no server): exact splits across ranks, the same order
for the same seed and epoch, resume from a position, and memory that follows the shards.
Their use with a ``RemoteMapDataset`` is in test_mapstyle.py."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import ConfigError, LocalitySampler, UniformSampler

SIZES = [7, 3, 10, 0, 5, 12, 1]  # 38 samples, an empty shard among them


def _make(kind: str, rank: int = 0, world: int = 1, seed: int = 2, **options):
    if kind == "locality":
        return LocalitySampler(SIZES, seed=seed, rank=rank, world_size=world, **options)
    return UniformSampler(sum(SIZES), seed=seed, rank=rank, world_size=world)


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 38, 40])
def test_ranks_get_equal_parts_that_cover_the_epoch(kind, world):
    parts = [list(_make(kind, r, world)) for r in range(world)]
    per_rank = -(-38 // world)
    assert all(len(p) == per_rank == len(_make(kind, r, world)) for r, p in enumerate(parts))
    counts = Counter(i for p in parts for i in p)
    assert set(counts) == set(range(38))
    assert sum(counts.values()) - 38 == per_rank * world - 38 < world  # the wrap repeats fewer than world_size


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 15, 16, 17, 255, 256, 257, 1000, 4097])
def test_the_uniform_order_is_a_permutation_of_every_size(n):
    assert sorted(UniformSampler(n, seed=n, rank=0, world_size=1)) == list(range(n))


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_the_order_follows_seed_and_epoch_only(kind):
    sampler = _make(kind)
    sampler.set_epoch(0)
    first = list(sampler)
    assert list(_make(kind)) == first and list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(_make(kind, seed=3)) != first


def test_uniform_positions_are_spread_evenly():
    firsts = Counter(next(iter(UniformSampler(10, seed=seed, rank=0, world_size=1))) for seed in range(3000))
    assert set(firsts) == set(range(10)) and max(firsts.values()) < 400 and min(firsts.values()) > 200


def test_locality_keeps_a_window_of_shards_together():
    sizes = [100] * 12
    order = list(LocalitySampler(sizes, window=3, seed=1, rank=0, world_size=1))
    for w in range(4):  # each run of 300 positions holds the samples of 3 whole shards
        shards = {i // 100 for i in order[w * 300 : (w + 1) * 300]}
        assert len(shards) == 3


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("stop", [0, 1, 17, 19])
def test_a_state_resumes_the_rest_of_the_rank_part_exactly(kind, stop):
    sampler = _make(kind, rank=1, world=2)
    sampler.set_epoch(4)
    whole = list(sampler)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(stop)]
    states = [iterator.state_dict()]
    if stop:
        states.append(sampler.state_dict())
    else:  # an iterator not yet read changes nothing: the sampler's state is still the finished pass's
        assert sampler.state_dict() == {**iterator.state_dict(), "delivered": len(whole)}
    sampler.set_epoch(5)
    following = list(sampler)
    for state in states:
        fresh = _make(kind, rank=1, world=2)
        fresh.load_state_dict(state)
        if stop < len(whole):
            assert taken + list(fresh) == whole  # the epoch comes with the state
        else:  # a finished epoch: the next iteration, which takes its epoch by itself, starts the next one
            assert list(fresh) == following
        resumed = iter(_make(kind, rank=1, world=2))
        resumed.load_state_dict(state)  # what StatefulDataLoader does with the iterator's state
        assert taken + list(resumed) == whole


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_a_state_taken_after_set_epoch_to_the_next_epoch_resumes_that_epoch_whole(kind):
    """A checkpoint taken after ``set_epoch(5)`` that follows a finished pass of epoch 4 said
    epoch 5 with all of epoch 4's indices delivered: resumed, epoch 5 was skipped whole."""
    sampler = _make(kind)
    sampler.set_epoch(4)
    list(sampler)
    sampler.set_epoch(5)
    state = sampler.state_dict()
    assert (state["epoch"], state["delivered"]) == (5, 0)
    fresh = _make(kind)
    fresh.load_state_dict(state)
    fresh.set_epoch(5)
    assert list(fresh) == list(sampler)


def test_a_loaded_state_applies_once_and_holds_its_epoch():
    sampler = _make("uniform")
    iterator = iter(sampler)
    [next(iterator) for _ in range(5)]
    state = sampler.state_dict()
    fresh = _make("uniform")
    fresh.load_state_dict(state)
    with pytest.raises(ConfigError, match="set_epoch"):
        fresh.set_epoch(1)
    assert len(list(fresh)) == 33 and len(list(fresh)) == 38


@pytest.mark.parametrize("state, message", [
    ([1, 2], "is a dict"),
    ({"sampler": "LocalitySampler"}, "sampler="),
    ({**UniformSampler(38, rank=0, world_size=1).state_dict(), "seed": 9}, "seed=9"),
    ({**UniformSampler(38, rank=0, world_size=1).state_dict(), "total": 39}, "total=39"),
    ({**UniformSampler(38, rank=0, world_size=1).state_dict(), "delivered": 39}, "delivered"),
    ({**UniformSampler(38, rank=0, world_size=1).state_dict(), "delivered": True}, "delivered"),
    ({**UniformSampler(38, rank=0, world_size=1).state_dict(), "epoch": -1}, "epoch"),
    ({**UniformSampler(38, rank=0, world_size=1).state_dict(), "epoch": 2**70}, "epoch"),  # set_epoch refuses it
])
def test_hostile_states_are_refused_naming_the_field(state, message):
    with pytest.raises(ConfigError, match=message):
        UniformSampler(38, rank=0, world_size=1).load_state_dict(state)


def test_bad_arguments_are_refused():
    # A float was taken for its floor, a string for its number, and counts past int64 summed to 0 (an empty epoch).
    for sizes in ([3, -1], [2.7, 3.2], ["3", "4"], [True, 2], [[1, 2]], [2**62] * 4, [2**64]):
        with pytest.raises(ConfigError, match="shard_sizes"):
            LocalitySampler(sizes, rank=0, world_size=1)
    assert len(LocalitySampler(np.array([3, 4], dtype=np.uint8), rank=0, world_size=1)) == 7
    assert len(LocalitySampler([], rank=0, world_size=1)) == 0
    with pytest.raises(ConfigError, match="dataset"):
        UniformSampler(-5, rank=0, world_size=1)


_SCALE = """
import resource, sys, time
import numpy as np
from remote_loader.mapstyle.samplers import LocalitySampler, UniformSampler
sizes = np.full(1_000_000, 1000, dtype=np.int64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sampler = LocalitySampler(sizes, window=4, rank=7, world_size=8) if sys.argv[1] == "locality" else \\
    UniformSampler(10**9, rank=7, world_size=8)
iterator = iter(sampler)
first = [next(iterator) for _ in range(10_000)]
assert len(set(first)) == 10_000 and all(0 <= i < 10**9 for i in first)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_a_billion_samples_need_memory_for_the_shards_only(kind):
    # Memory, not time: a list of a billion indices would take 8 GB; a rank's first
    # indices here take a few arrays of one number per shard.
    done = subprocess.run([sys.executable, "-c", _SCALE, kind], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 100, f"{done.stdout.strip()} MB added"


def test_locality_order_is_as_large_as_the_dataset_only_when_asked():
    sampler = LocalitySampler(SIZES, window=2, seed=5, rank=0, world_size=1)
    assert sampler.order().tolist() == list(sampler)
    assert isinstance(sampler.order(), np.ndarray)


class _Indices:
    """A map-style dataset whose sample i is i."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_resumes_the_samplers_exactly_once(kind, workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        if kind == "locality":
            return LocalitySampler([100] * 10, window=2, seed=1, rank=0, world_size=1)
        return UniformSampler(1000, seed=1, rank=0, world_size=1)

    sampler = make()
    sampler.set_epoch(2)
    loader = stateful.StatefulDataLoader(_Indices(), batch_size=8, sampler=sampler, num_workers=workers)
    batches = iter(loader)
    seen = [i for _ in range(7) for i in next(batches).tolist()]
    state = loader.state_dict()
    resumed = stateful.StatefulDataLoader(_Indices(), batch_size=8, sampler=make(), num_workers=workers)
    resumed.load_state_dict(state)  # the sampler's iterator state: its epoch and position, nothing replayed
    rest = [i for batch in resumed for i in batch.tolist()]
    assert seen + rest == list(sampler)  # the epoch-2 order, each index once


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_without_set_epoch_each_iteration_takes_the_next_epoch(kind):
    def make():
        return LocalitySampler(SIZES, window=2, seed=4, rank=0, world_size=1) if kind == "locality" else \
            UniformSampler(sum(SIZES), seed=4, rank=0, world_size=1)

    sampler = make()
    passes = [list(sampler) for _ in range(3)]
    explicit = make()
    expected = []
    for epoch in range(3):
        explicit.set_epoch(epoch)
        expected.append(list(explicit))
    assert passes == expected and len({tuple(p) for p in passes}) == 3
    explicit.set_epoch(7)
    assert list(explicit) == list(explicit)  # set: followed exactly
    stopped = make()
    list(stopped)
    it = iter(stopped)  # epoch 1, stopped after 10
    head = [next(it) for _ in range(10)]
    resumed = make()
    resumed.load_state_dict(stopped.state_dict())
    assert head + list(resumed) == expected[1] and list(resumed) == expected[2]


def _loader(sampler, loader: str):
    """A loader with workers that makes the sampler's iterator twice a pass and reads only the
    second: DataLoader's multiprocess iterator, torchdata's BatchSampler."""
    if loader == "dataloader":
        return DataLoader(_Indices(), sampler=sampler, batch_size=None, num_workers=2)
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful.StatefulDataLoader(_Indices(), sampler=sampler, batch_size=8, num_workers=2)


def _indices(loader) -> list[int]:
    return [i for item in loader for i in torch.as_tensor(item).reshape(-1).tolist()]


def _epochs(kind: str, epochs: range) -> list[list[int]]:
    orders = []
    for epoch in epochs:
        sampler = _make(kind)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("loader", ["dataloader", "stateful"])
@pytest.mark.parametrize("set_epoch", [False, True])
def test_a_loaded_state_resumes_exactly_once_under_loaders_with_workers(kind, loader, set_epoch):
    sampler = _make(kind)
    if set_epoch:
        sampler.set_epoch(2)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(17)]
    resumed = _make(kind)
    resumed.load_state_dict(sampler.state_dict())
    if set_epoch:
        resumed.set_epoch(2)
    batches = _loader(resumed, loader)
    whole, following = _epochs(kind, range(2, 4) if set_epoch else range(2))
    assert taken + _indices(batches) == whole  # the rest of the epoch, each index once
    if not set_epoch:
        assert _indices(batches) == following  # then the next epoch, whole


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("loader", ["dataloader", "stateful"])
def test_without_set_epoch_passes_under_loaders_with_workers_take_epochs_0_1_2(kind, loader):
    batches = _loader(_make(kind), loader)
    assert [_indices(batches) for _ in range(3)] == _epochs(kind, range(3))


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_an_iterator_made_and_dropped_unread_changes_nothing(kind):
    sampler = _make(kind)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(5)]
    state = sampler.state_dict()
    resumed = _make(kind)
    resumed.load_state_dict(state)
    unread = iter(resumed)
    assert unread.state_dict() == state and resumed.state_dict() == state  # what it would start from
    iter(resumed)
    assert taken + list(unread) == _epochs(kind, range(1))[0]
    assert resumed.state_dict()["delivered"] == 38 and list(resumed) == _epochs(kind, range(1, 2))[0]


def _finished(kind: str, epoch: int) -> dict:
    sampler = _make(kind)
    sampler.set_epoch(epoch)
    list(sampler)
    return sampler.state_dict()


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("steps, passes", [
    (["load", "set 3", "iter", "set 4", "iter"], [None, 4]),   # a resume loop starting at the state's epoch
    (["set 3", "load", "iter", "set 4", "iter"], [None, 4]),
    (["load", "set 4", "iter"], [4]),
    (["set 4", "load", "iter"], [4]),                           # StatefulDataLoader loads after set_epoch
    (["set 3", "load", "set 4", "iter"], [4]),
    (["load", "iter", "iter"], [4, 5]),
])
def test_a_state_of_a_finished_epoch_leaves_the_epoch_set_before_or_after_it_is_loaded(kind, steps, passes):
    """A state saved at the end of epoch 3 holds no position: the epoch set, before or after it
    is loaded, is followed (epoch 3 itself then gives nothing), and without set_epoch the next
    pass is epoch 4. It gave an empty epoch 4, replayed epoch 3 whole, or refused set_epoch(4)."""
    state, sampler, got = _finished(kind, 3), _make(kind), []
    for step in steps:
        if step == "load":
            sampler.load_state_dict(state)
        elif step == "iter":
            got.append(list(sampler))
        else:
            sampler.set_epoch(int(step.split()[1]))
    orders = dict(zip(range(3, 6), _epochs(kind, range(3, 6)), strict=True))
    assert got == [[] if epoch is None else orders[epoch] for epoch in passes]


def _resumed_after_a_finished_epoch(kind: str, workers: int, epoch: int | None):
    """A StatefulDataLoader over a fresh sampler, given the state another took at the end of
    its pass (of ``epoch`` set, or the auto epoch 0): the sampler and the loader."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    sampler = _make(kind)
    if epoch is not None:
        sampler.set_epoch(epoch)
    loader = stateful.StatefulDataLoader(_Indices(), batch_size=8, sampler=sampler, num_workers=workers)
    _indices(loader)
    state = loader.state_dict()
    resumed = _make(kind)
    again = stateful.StatefulDataLoader(_Indices(), batch_size=8, sampler=resumed, num_workers=workers)
    again.load_state_dict(state)
    return resumed, again


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_state_of_a_finished_epoch_goes_on_with_the_epoch_set_or_the_next(kind, workers):
    """torchdata saves the sampler's iterator state at the end of an epoch; resumed with
    set_epoch(4) the pass replayed epoch 3 (with workers), and without set_epoch an iterator's
    own finished state made the sampler skip an epoch."""
    for set_epoch in (True, False):
        resumed, again = _resumed_after_a_finished_epoch(kind, workers, 3 if set_epoch else None)
        if set_epoch:
            resumed.set_epoch(4)
            assert _indices(again) == _epochs(kind, range(4, 5))[0]
        else:
            given = [p for p in (_indices(again) for _ in range(3)) if p]  # an empty pass may end epoch 0
            assert len(given) >= 2 and given == _epochs(kind, range(1, 1 + len(given)))


def test_a_locality_state_of_another_window_or_shard_sizes_is_refused():
    """The order depends on the window and the shard sizes: a state of another one resumed at a
    position naming other samples (21 of 100 repeated, 21 never given)."""
    def sampler(sizes=(25, 25, 25, 25), window=4):
        return LocalitySampler(list(sizes), window=window, seed=3, rank=0, world_size=1)

    taken = iter(sampler())
    [next(taken) for _ in range(40)]
    state = sampler().state_dict() | {"delivered": 40}
    for other in (sampler(window=1), sampler(sizes=[10] * 10), sampler(sizes=[50, 50])):
        with pytest.raises(ConfigError, match=r"the sampler state was taken over another dataset, shard sizes or"
                                              r" window \(layout \d+, this sampler's \d+\)"):
            other.load_state_dict(state)
    same = sampler()
    same.load_state_dict(state)
    assert len(list(same)) == 60
    old = sampler()
    old.load_state_dict({k: v for k, v in state.items() if k != "layout"})  # a state saved before it held one
    assert len(list(old)) == 60


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_a_state_given_the_indices_consumed_resumes_what_a_dataloader_with_workers_fetched_ahead(kind):
    """A DataLoader with workers takes indices from the sampler ahead of the loop
    (prefetch_factor batches a worker): the sampler's own count lost them on resume (40 of 400)."""
    sampler = _make(kind)
    batches = iter(DataLoader(_Indices(), sampler=sampler, batch_size=4, num_workers=2))
    taken = [i for _ in range(3) for i in next(batches).tolist()]
    assert sampler.state_dict()["delivered"] > len(taken)  # fetched ahead
    state = sampler.state_dict(consumed=len(taken))
    del batches
    resumed = _make(kind)
    resumed.load_state_dict(state)
    assert taken + list(resumed) == _epochs(kind, range(1))[0]
    with pytest.raises(ConfigError, match="consumed"):
        sampler.state_dict(consumed=10**6)


@pytest.mark.parametrize("kind", ["locality", "uniform"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_state_of_a_finished_epoch_set_again_gives_nothing_of_it(kind, workers):
    """A resume loop that starts at the checkpoint's epoch sets the finished epoch again: with
    workers torchdata made a fresh iterator after the loaded, finished one, which began the
    epoch again (all 38 indices twice)."""
    resumed, again = _resumed_after_a_finished_epoch(kind, workers, 1)
    resumed.set_epoch(1)
    assert _indices(again) == []
    resumed.set_epoch(2)
    assert _indices(again) == _epochs(kind, range(2, 3))[0]


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_consumed_counts_the_whole_epoch_a_short_last_batch_included(kind):
    """batches x batch_size passes the rank's part at a short last batch (it raised there), and
    a count of the batches since a resume only is refused (it rewound: 20 indices twice)."""
    sampler = _make(kind)
    batches = iter(DataLoader(_Indices(), sampler=sampler, batch_size=8, num_workers=2))
    taken = [i for batch in batches for i in batch.tolist()]
    assert len(taken) == 38 and sampler.state_dict(consumed=5 * 8)["delivered"] == 38
    first = iter(_make(kind))
    head = [next(first) for _ in range(20)]
    resumed = _make(kind)
    resumed.load_state_dict(_make(kind).state_dict() | {"delivered": 20})
    after = iter(resumed)
    head += [next(after) for _ in range(4)]
    with pytest.raises(ConfigError, match=r"consumed=4, but this epoch's indices handed out are 20 \(where its pass"
                                          r" resumed\) to 24: count every index of the epoch"):
        resumed.state_dict(consumed=4)
    state = resumed.state_dict(consumed=24)
    rest = _make(kind)
    rest.load_state_dict(state)
    assert head + list(rest) == _epochs(kind, range(1))[0]
