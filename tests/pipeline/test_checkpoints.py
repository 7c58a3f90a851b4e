"""Checkpoints by position: an epoch stopped on R ranks x W workers resumes on R' x W'
with every sample not yet delivered delivered exactly once.

DataLoader workers are played in this process the way a DataLoader sets them up
(``torch.utils.data.get_worker_info`` reads the module's worker info), each with its own
copy of the rank's dataset, so that a matrix of topologies and stop points runs in
seconds. ``test_stateful_dataloader.py`` runs the real StatefulDataLoader.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import pickle
from collections import Counter
from collections.abc import Iterator
from operator import itemgetter

import pytest
from torch.utils.data._utils import worker as torch_worker

from remote_loader import ConfigError, FetchConfig, RemoteDataset
from remote_loader.read.shards import OpenRange
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload
from tests.pipeline.conftest import CHECKPOINT_SAMPLES as N

ALL = Counter(f"{i:06d}" for i in range(N))
BUFSIZE = 40


def make(client, rank=0, world_size=1, equalize=False, batch=None, keep=None, epoch=0):
    # Small ranges, so a shard is read in several and a stop leaves ranges cut but not opened.
    fetch = FetchConfig(range_bytes=4096, part_size=4096, prefetch_bytes=16384)
    ds = (RemoteDataset(client, "checkpoint-tests", "d", seed=5, open_shards=3, rank=rank, world_size=world_size,
                        equalize=equalize, fetch=fetch)
          .shuffle(BUFSIZE, initial=BUFSIZE).map(itemgetter("__key__")))
    ds = ds.select(keep) if keep else ds
    ds = ds.batched(batch, collation_fn=list) if batch else ds
    if epoch is not None:  # set: a loaded state of a finished epoch then gives its (empty) rest
        ds.set_epoch(epoch)
    return ds


@contextlib.contextmanager
def as_worker(dataset, worker: int, num_workers: int) -> Iterator[None]:
    """Run in this process as DataLoader worker ``worker`` of ``num_workers`` would (a pass's
    workers get seeds base + id, the base the loader's own)."""
    saved = torch_worker._worker_info
    torch_worker._worker_info = torch_worker.WorkerInfo(id=worker, num_workers=num_workers, seed=1000 + worker,
                                                        dataset=dataset)
    try:
        yield
    finally:
        torch_worker._worker_info = saved


def flat(items):
    return [k for item in items for k in (item if isinstance(item, list) else [item])]


def run(client, ranks, workers, stops=None, states=None, **options):
    """Each (rank, worker) takes ``stops(rank, worker, total)`` items, or all; returns the
    keys each rank delivered and every worker's state afterwards."""
    delivered, saved = {}, []
    for rank in range(ranks):
        dataset = make(client, rank, ranks, **options)
        if states is not None:
            dataset.load_state_dict(states)
        keys = []
        for worker in range(max(1, workers)):
            copy_ = copy.copy(dataset)  # a worker's own copy; the shared counters stay shared, as after fork
            with as_worker(copy_, worker, workers) if workers else contextlib.nullcontext():
                stream = iter(copy_)
                if stops is None:
                    items = list(stream)
                else:
                    # Stop points are fractions of the worker's share (0: before its first item).
                    untaken = copy_.state_dict()  # before its first item: its whole share is undelivered
                    remaining, extras = untaken["remaining"], untaken["extras"]
                    share = sum(remaining[1::2]) - sum(remaining[::2]) + len(extras) // 2
                    total = share // (options.get("batch") or 1)
                    items = list(itertools.islice(stream, stops(rank, worker, total)))
                keys += flat(items)
                saved.append(pickle.loads(pickle.dumps(copy_.state_dict())))
                stream.close()
        delivered[rank] = keys
    return delivered, saved


STOPS = {
    "before-first-item": lambda rank, worker, total: 0,
    "mid-shuffle-buffer": lambda rank, worker, total: 3 + worker,  # the buffer holds 40, most not yet out
    "mid-epoch": lambda rank, worker, total: total // 2 + rank - worker,
    "uneven": lambda rank, worker, total: [total, 1, total // 3][(rank + worker) % 3],
    "epoch-boundary": lambda rank, worker, total: total,
}
TOPOLOGIES = [((2, 2), (3, 1)), ((1, 0), (2, 2)), ((3, 2), (2, 3))]


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("before, after", TOPOLOGIES, ids=[f"{a[0]}x{a[1]}-to-{b[0]}x{b[1]}" for a, b in TOPOLOGIES])
def test_an_epoch_resumes_exactly_once_on_other_ranks_and_workers(location, before, after, stop):
    first, states = run(location, *before, stops=STOPS[stop])
    rest, _ = run(location, *after, states=states)
    done = Counter(k for keys in first.values() for k in keys)
    again = Counter(k for keys in rest.values() for k in keys)
    assert done + again == ALL, (done + again - ALL, ALL - done - again)
    print(f"\n{before[0]}x{before[1]} -> {after[0]}x{after[1]} at {stop}: {sum(done.values())} delivered before,"
          f" {sum(again.values())} after, all {N} exactly once")


def test_the_rest_is_split_equally_under_equalize(location):
    first, states = run(location, 2, 2, stops=STOPS["uneven"], equalize=True)
    rest, _ = run(location, 3, 1, states=states, equalize=True)
    sizes = {rank: len(keys) for rank, keys in rest.items()}
    assert len(set(sizes.values())) == 1, sizes
    done = Counter(k for keys in first.values() for k in keys)
    again = Counter(k for keys in rest.values() for k in keys)
    assert set(done + again) == set(ALL)
    # Repeats are the equalised splits' own: fewer than world_size per split.
    assert sum((done + again - ALL).values()) <= (2 - 1) + (3 - 1)
    assert max((done + again).values()) <= 2


def test_a_resume_of_a_resume_is_exact_too(location):
    first, states = run(location, 2, 2, stops=STOPS["mid-epoch"])
    second, states = run(location, 1, 3, stops=STOPS["uneven"], states=states)
    third, _ = run(location, 3, 2, states=states)
    total = sum((Counter(k for keys in r.values() for k in keys) for r in (first, second, third)), Counter())
    assert total == ALL


@pytest.mark.parametrize("ranks, workers", [(2, 2), (1, 3)])
def test_each_worker_resumes_from_its_own_state_where_it_stopped(location, ranks, workers):
    """What StatefulDataLoader does on the same topology: each worker gets its own state back."""
    first, states = run(location, ranks, workers, stops=STOPS["mid-epoch"], equalize=True)
    rest = {}
    for rank in range(ranks):
        keys = []
        for worker in range(workers):
            dataset = make(location, rank, ranks, equalize=True)
            with as_worker(dataset, worker, workers):
                dataset.load_state_dict(states[rank * workers + worker])
                keys += list(dataset)
        rest[rank] = keys
    totals = {rank: len(first[rank]) + len(rest[rank]) for rank in range(ranks)}
    assert len(set(totals.values())) == 1, totals  # ranks stay equal: DDP does not hang
    done = Counter(k for keys in first.values() for k in keys) + Counter(k for keys in rest.values() for k in keys)
    uninterrupted = Counter(k for keys in run(location, ranks, workers, equalize=True)[0].values() for k in keys)
    assert done == uninterrupted


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_process_without_workers_resumes_in_the_uninterrupted_order(location, world_size):
    """Each rank iterating in its main process (``num_workers=0``), its own state loaded back:
    the rest comes in the order the uninterrupted epoch has, on one rank as on several."""
    for rank in range(world_size):
        uninterrupted = list(make(location, rank, world_size))
        first = make(location, rank, world_size)
        stream = iter(first)
        taken = list(itertools.islice(stream, 13))
        state = pickle.loads(pickle.dumps(first.state_dict()))
        stream.close()
        resumed = make(location, rank, world_size)
        resumed.load_state_dict(state)
        assert taken + list(resumed) == uninterrupted


def test_a_main_process_state_of_one_rank_resumes_on_workers_exactly_once(location):
    """The same state given to DataLoader workers: no worker's own, so its rest is divided."""
    first = make(location)
    stream = iter(first)
    taken = list(itertools.islice(stream, 13))
    state = first.state_dict()
    stream.close()
    rest, _ = run(location, 1, 2, states=[state])
    assert Counter(taken) + Counter(rest[0]) == ALL


def test_resuming_is_deterministic(location):
    _, states = run(location, 2, 2, stops=STOPS["uneven"])
    once, _ = run(location, 3, 1, states=states)
    twice, _ = run(location, 3, 1, states=list(reversed(states)))  # the order states are gathered in does not matter
    assert once == twice


def _not_every_third(key):
    return int(key) % 3 != 0


@pytest.mark.parametrize("keep", [None, _not_every_third], ids=["batched", "select and batched"])
def test_batches_and_select_are_followed(location, keep):
    first, states = run(location, 2, 2, stops=STOPS["mid-epoch"], batch=7, keep=keep)
    rest, _ = run(location, 1, 2, states=states, batch=5, keep=keep)
    done = Counter(k for keys in first.values() for k in keys) + Counter(k for keys in rest.values() for k in keys)
    assert done == Counter(k for k in ALL if keep is None or keep(k))  # what select drops counts as passed


def test_a_state_is_bounded_by_open_shards_and_the_buffer(location):
    _, states = run(location, 1, 1, stops=STOPS["mid-shuffle-buffer"])
    (state,) = states
    # Pending samples are at most the buffer plus what stages hold; intervals at most as many.
    assert len(state["remaining"]) // 2 <= BUFSIZE + 3 * 2 + 2 + 4
    # Under equalize, 241 samples on 2 ranks repeat one: exactly one state lists it as an extra.
    _, equalized = run(location, 2, 1, stops=STOPS["mid-shuffle-buffer"], equalize=True)
    assert sorted(len(s["extras"]) // 2 for s in equalized) == [0, 1]


def _states(location):
    return run(location, 2, 1, stops=STOPS["mid-epoch"])[1]


def _unplanned(state):
    """A state as versions before ``planned`` saved it."""
    return {k: v for k, v in state.items() if k != "planned"}


@pytest.mark.parametrize("change, message", [
    (lambda s: s[:1], "states lack rank 1 worker 0"),
    (lambda s: s + s[:1], "state of rank 0 worker 0 is given twice"),
    (lambda s: [s[0], {**s[1], "epoch": 3}], "different runs: rank 1 worker 0 has epoch=3"),
    (lambda s: [s[0], {**s[1], "seed": 9}], "has seed=9, this dataset has 5"),
    (lambda s: [s[0], {**s[1], "samples": 999}], "has samples=999"),
    (lambda s: [s[0], {**s[1], "remaining": [5, 2]}], "sorted, disjoint, non-empty intervals"),
    (lambda s: [s[0], {**s[1], "remaining": [0, 10**9]}], "not a position in 0..241"),
    (lambda s: [s[0], {**s[1], "remaining": [1, 2, 3]}], "flat list of pairs"),
    (lambda s: [s[0], {**s[1], "remaining": [True, 2]}], "holds True"),
    (lambda s: [s[0], {**_unplanned(s[1]), "remaining": s[0]["remaining"]}], "states overlap"),
    (lambda s: [s[0], {**s[1], "remaining": s[1]["remaining"][2:]}], "rank 1 worker 0 does not add up"),
    (lambda s: [s[0], {**s[1], "planned": s[1]["planned"] + 1}], "rank 1 worker 0 does not add up"),
    (lambda s: [s[0], {**s[1], "planned": -1}], "'planned' must be an integer"),
    (lambda s: [s[0], {**s[1], "run": 5}], "lacks its 'plan'"),
    (lambda s: [s[0], {**s[1], "run": 5, "plan": [9, 3]}], "'plan' must hold non-empty intervals"),
    (lambda s: [s[0], {**s[1], "delivered": 10**6}], "'delivered' must be an integer in 0..241"),
    (lambda s: [s[0], {**s[1], "delivered": -1}], "'delivered' must be an integer"),
    (lambda s: [s[0], {**s[1], "mixing": "3,40,40"}], "'mixing' must be \\[open_shards, bufsize, initial\\]"),
    (lambda s: [s[0], {**s[1], "mixing": [0, 40, 40]}], r"'mixing\[0\]' must be an integer in 1"),
    (lambda s: [s[0], {**s[1], "mixing": [3, 2**40, 40]}], r"'mixing\[1\]' must be an integer in 0"),
    (lambda s: [s[0], {**s[1], "mixing": [3, 40, 41]}], r"'mixing\[2\]' must be an integer in 0..40"),
    (lambda s: [s[0], {k: v for k, v in s[1].items() if k != "delivered"}], "lacks delivered"),
    (lambda s: [s[0], {**s[1], "extras": [3, 7]}], "'extras' must pair positions"),
    (lambda s: [s[0], {**s[1], "world_size": 0}], "'world_size' must be an integer in 1"),
    (lambda s: [s[0], {**s[1], "rank": 2}], "'rank' must be an integer in 0..1"),
    (lambda s: [s[0], {**s[1], "shuffle": "yes"}], "'shuffle' must be true or false"),
    (lambda s: [s[0], {k: v for k, v in s[1].items() if k != "run"}], "lacks run"),
    (lambda s: [s[0], {**s[1], "remote_loader_state": 7}], "state version 7 is not 3"),
    (lambda s: [[[[[[[[[[s]]]]]]]]]], "no RemoteDataset worker state found in this list"),
])
def test_hostile_states_are_refused(location, change, message):
    states = _states(location)
    dataset = make(location, 0, 3)
    with pytest.raises(ConfigError, match=message):
        dataset.load_state_dict(change(states))


def test_a_workers_own_state_on_another_worker_is_refused(location):
    states = run(location, 1, 2, stops=STOPS["mid-epoch"])[1]
    dataset = make(location)
    with as_worker(dataset, 1, 2), pytest.raises(ConfigError, match="loads its own state only"):
        dataset.load_state_dict(states[0])


def test_a_state_from_mid_epoch_needs_its_epoch(location):
    first, states = run(location, 2, 1, stops=STOPS["mid-epoch"])
    dataset = make(location, 0, 2)
    dataset.load_state_dict(states[0])  # rank 0's own, without workers
    with pytest.raises(ConfigError, match=r"stopped mid-way through epoch 0.*set_epoch\(0\)"):
        dataset.set_epoch(1)
    dataset.set_epoch(0)
    assert Counter(first[0]) + Counter(dataset) == Counter(make(location, 0, 2))


@pytest.mark.parametrize("kind", ["gathered positions", "counts"])
def test_set_epoch_refuses_to_drop_a_loaded_mid_epoch_state(location, kind):
    first, states = run(location, 1, 2, stops=STOPS["mid-epoch"])
    dataset = make(location)
    dataset.load_state_dict(states if kind == "gathered positions" else dataset.state_dict(consumed=30))
    with pytest.raises(ConfigError, match=r"stopped mid-way through epoch 0.*set_epoch\(0\)"):
        dataset.set_epoch(1)
    dataset.set_epoch(0)  # its own epoch: fine, and the rest comes
    if kind == "gathered positions":
        assert Counter(first[0]) + Counter(dataset) == ALL
    else:
        assert len(list(dataset)) == N - 30
    dataset.set_epoch(1)  # once the rest was iterated, the next epoch starts whole
    assert Counter(dataset) == ALL


def test_state_in_the_main_process_while_workers_iterate_is_refused(location):
    from torch.utils.data import DataLoader

    dataset = make(location)
    loader = iter(DataLoader(dataset, batch_size=None, num_workers=1))
    next(loader)
    with pytest.raises(ConfigError, match="runs in DataLoader workers"):
        dataset.state_dict()
    del loader


def test_a_state_saved_on_a_replaced_dataset_is_refused(s3):
    client, bucket = s3
    upload(client, bucket, "d", SyntheticImages(60, size=(32, 24)), maxcount=10)
    dataset = RemoteDataset(client, bucket, "d", seed=1).map(itemgetter("__key__"))
    stream = iter(dataset)
    [next(stream) for _ in range(20)]
    position, counts = dataset.state_dict(), dataset.state_dict(consumed=20)
    # Other images, the same count in the same shard sizes: every number in the states still fits.
    upload(client, bucket, "d", SyntheticImages(60, size=(32, 24), seed=9), maxcount=10, seed=4, overwrite=True)
    for state in (position, counts):
        fresh = RemoteDataset(client, bucket, "d", seed=1).map(itemgetter("__key__"))
        with pytest.raises(ConfigError, match="another upload"):
            fresh.load_state_dict(state)


@pytest.mark.parametrize("at", [1, 30, 100])
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh pass", "resumed pass"])
def test_ctrl_c_in_a_read_leaves_a_state_that_resumes_exactly_once(location, monkeypatch, at, resumed):
    """KeyboardInterrupt where Ctrl-C lands in a sample's read (a wait for its bytes): the
    sample being read is not delivered, and the state says so. In a resumed pass, read 1 is
    among what its shuffle buffer held, read before anything is delivered."""
    real, reads, armed = OpenRange.next_sample, itertools.count(1), [False]

    def next_sample(self):  # noqa: ANN001, ANN202
        if armed[0] and next(reads) == at:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(OpenRange, "next_sample", next_sample)
    before = []
    state = None
    if resumed:
        first = make(location)
        stream = iter(first)
        before = list(itertools.islice(stream, 13))
        state = first.state_dict()
        stream.close()
    interrupted = make(location)
    if state is not None:
        interrupted.load_state_dict(state)
    taken = []
    armed[0] = True
    with pytest.raises(KeyboardInterrupt):
        for key in interrupted:
            taken.append(key)
    armed[0] = False
    rest = make(location)
    rest.load_state_dict(pickle.loads(pickle.dumps(interrupted.state_dict())))
    assert Counter(before) + Counter(taken) + Counter(rest) == ALL
