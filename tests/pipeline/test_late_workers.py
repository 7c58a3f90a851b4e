"""A DataLoader's pass stays one epoch while its late worker is still starting, however many
other DataLoaders over the same dataset come and go meanwhile (a new eval loader per
evaluation), without ``set_epoch``; or it fails loudly, never mixing epochs."""

from __future__ import annotations

import functools
import multiprocessing
from collections import Counter
from typing import Any

import pytest
from torch.utils.data import DataLoader

from remote_loader import ConfigError, LocalStore, RemoteDataset
from remote_loader.pipeline.state.passes import PASSES
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

N = 40
FORK = multiprocessing.get_context("fork")
ALL = Counter(f"{i:06d}" for i in range(N))


def key(sample: dict[str, Any]) -> str:
    return sample["__key__"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    store = LocalStore(tmp_path_factory.mktemp("late-workers"))
    upload_to_new_bucket(store, "late", "d", SyntheticImages(N, size=(16, 12)), maxcount=5)
    return store


def dataset(store: LocalStore) -> RemoteDataset:
    return RemoteDataset(store, "late", "d", seed=3).map(key)


def hold_worker_1(go: Any, worker_id: int) -> None:
    """A slow ``worker_init_fn``: worker 1 starts only once the test lets it go (``go``, a
    semaphore, released once; each waiter passes it on). Not an Event: its ``set()`` waits for
    every waiter to wake, for ever where a DataLoader terminated one still waiting."""
    if worker_id == 1:
        go.acquire()
        go.release()


def epoch_order(store: LocalStore, epoch: int) -> list[str]:
    """What a two-worker DataLoader delivers of ``epoch``, in order."""
    reference = dataset(store)
    reference.set_epoch(epoch)
    return list(DataLoader(reference, batch_size=None, num_workers=2, multiprocessing_context=FORK))


@pytest.mark.parametrize("others", [PASSES, PASSES + 4])
def test_a_late_workers_pass_stays_one_epoch_while_other_loaders_make_whole_passes(store, others):
    ds = dataset(store)
    go = FORK.Semaphore(0)
    late = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=FORK,
                      worker_init_fn=functools.partial(hold_worker_1, go))
    try:
        batches = iter(late)
        first = [next(batches)]  # from worker 0: A's pass is recorded, worker 1 has not begun it
        for _ in range(others):  # a new eval loader each time, each a whole pass
            assert Counter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=FORK)) == ALL
    finally:
        go.release()
    delivered = first + list(batches)
    assert Counter(delivered) == ALL  # every sample exactly once
    assert delivered == epoch_order(store, 0)  # and all of epoch 0, the one A's pass took first
    assert ds.epoch == others + 1


def test_more_loaders_beginning_at_once_than_the_table_holds_fail_loudly(store):
    ds = dataset(store)
    go = FORK.Semaphore(0)
    loaders = [DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=FORK,
                          worker_init_fn=functools.partial(hold_worker_1, go)) for _ in range(PASSES + 1)]
    try:
        started = [iter(loader) for loader in loaders[:PASSES]]
        firsts = [next(batches) for batches in started]  # each loader's worker 0 began a pass; each worker 1 waits
        one_too_many = iter(loaders[PASSES])
        with pytest.raises(ConfigError, match="set_epoch"):
            next(one_too_many)
    finally:
        go.release()
    for first, batches in zip(firsts, started, strict=True):  # the passes that began stay whole
        assert Counter([first, *batches]) == ALL
