"""The workers of one DataLoader pass agree on its epoch through shared memory (``pipeline/epochs.py``),
whatever order they begin in; the next pass, of any loader, takes the next epoch. Played here with
worker infos as a DataLoader gives them, without a server."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

from remote_loader.pipeline.epochs import EpochClock


def worker(id_: int, num_workers: int, base_seed: int = 7) -> SimpleNamespace:
    """What ``get_worker_info()`` says in worker ``id_`` of a pass whose loader drew ``base_seed``."""
    return SimpleNamespace(id=id_, num_workers=num_workers, seed=base_seed + id_)


def test_the_workers_of_a_pass_share_its_epoch_in_any_order_and_the_next_pass_takes_the_next():
    epochs = EpochClock()
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [0, 0]
    # Persistent workers: the same base seed each pass, each worker begins once per pass.
    assert [epochs.begin(worker(0, 2)), epochs.begin(worker(1, 2))] == [1, 1]
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [2, 2]
    assert epochs.epoch == 3


def test_a_pass_of_another_loader_with_the_same_seed_and_more_workers_is_a_new_pass():
    # A loader made anew with the same seeded generator draws the same base seed: with one worker
    # first, then two, whose worker 1 begins first, that worker must not join the one-worker pass.
    epochs = EpochClock()
    assert epochs.begin(worker(0, 1)) == 0
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [1, 1]


def _begin_and_exit(epochs: EpochClock) -> None:
    epochs.begin(worker(0, 2))


def test_a_worker_whose_pass_ended_without_it_starts_a_new_pass():
    # Worker 1 of the first pass never began (it was killed, or the pass was dropped at once);
    # worker 1 of the next loader, with the same seed, begins before its worker 0.
    epochs = EpochClock()
    first = multiprocessing.get_context("fork").Process(target=_begin_and_exit, args=(epochs,))
    first.start()
    first.join(timeout=60)
    assert first.exitcode == 0 and epochs.epoch == 1
    assert [epochs.begin(worker(1, 2)), epochs.begin(worker(0, 2))] == [1, 1]


def test_a_pass_of_another_loader_begun_meanwhile_leaves_the_first_loaders_pass_whole():
    # Loader A's worker 0 begins; loader B (another base seed) and an iteration in the main process
    # each make a whole pass; then A's worker 1 begins: it joins A's pass (it took the next epoch,
    # and A's pass read two epochs, half of each).
    epochs = EpochClock()
    assert epochs.begin(worker(0, 2, base_seed=7)) == 0
    assert epochs.begin(worker(0, 1, base_seed=11)) == 1
    assert epochs.begin(None) == 2
    assert epochs.begin(worker(1, 2, base_seed=7)) == 0
    assert epochs.epoch == 3
    assert [epochs.begin(worker(1, 2, base_seed=7)), epochs.begin(worker(0, 2, base_seed=7))] == [3, 3]


def test_passes_are_remembered_while_fewer_than_the_table_holds_began_since():
    from remote_loader.pipeline.epochs import PASSES

    epochs = EpochClock()
    assert epochs.begin(worker(0, 2, base_seed=1000)) == 0
    for other in range(PASSES - 1):
        epochs.begin(worker(0, 1, base_seed=other))
    assert epochs.begin(worker(1, 2, base_seed=1000)) == 0  # PASSES - 1 passes since: still found
    late = EpochClock()
    late.begin(worker(0, 2, base_seed=1000))
    for other in range(PASSES):
        late.begin(worker(0, 1, base_seed=other))
    assert late.begin(worker(1, 2, base_seed=1000)) == PASSES + 1  # written over: a pass of its own
