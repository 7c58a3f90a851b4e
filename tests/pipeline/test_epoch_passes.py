"""The workers of one DataLoader pass agree on its epoch through shared memory (``pipeline/epochs.py``),
whatever order they begin in; the next pass, of any loader, takes the next epoch. Played here with
worker infos as a DataLoader gives them, without a server."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

from remote_loader.pipeline.epochs import Epochs


def worker(id_: int, num_workers: int, base_seed: int = 7) -> SimpleNamespace:
    """What ``get_worker_info()`` says in worker ``id_`` of a pass whose loader drew ``base_seed``."""
    return SimpleNamespace(id=id_, num_workers=num_workers, seed=base_seed + id_)


def test_the_workers_of_a_pass_share_its_epoch_in_any_order_and_the_next_pass_takes_the_next():
    epochs = Epochs()
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [0, 0]
    # Persistent workers: the same base seed each pass, each worker begins once per pass.
    assert [epochs.begin(worker(0, 2)), epochs.begin(worker(1, 2))] == [1, 1]
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [2, 2]
    assert epochs.epoch == 3


def test_a_pass_of_another_loader_with_the_same_seed_and_more_workers_is_a_new_pass():
    # A loader made anew with the same seeded generator draws the same base seed: with one worker
    # first, then two, whose worker 1 begins first, that worker must not join the one-worker pass.
    epochs = Epochs()
    assert epochs.begin(worker(0, 1)) == 0
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [1, 1]


def _begin_and_exit(epochs: Epochs) -> None:
    epochs.begin(worker(0, 2))


def test_a_worker_whose_pass_ended_without_it_starts_a_new_pass():
    # Worker 1 of the first pass never began (it was killed, or the pass was dropped at once);
    # worker 1 of the next loader, with the same seed, begins before its worker 0.
    epochs = Epochs()
    first = multiprocessing.get_context("fork").Process(target=_begin_and_exit, args=(epochs,))
    first.start()
    first.join(timeout=60)
    assert first.exitcode == 0 and epochs.epoch == 1
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [1, 1]
