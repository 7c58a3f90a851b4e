"""The workers of one DataLoader pass agree on its epoch through shared memory (``pipeline/state/epochs.py``),
whatever order they begin in; the next pass, of any loader, takes the next epoch. Played here with
worker infos as a DataLoader gives them, without a server."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import pytest

from remote_loader import ConfigError
from remote_loader.pipeline.state.epochs import EpochClock
from remote_loader.pipeline.state.passes import PASSES


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


def test_a_late_workers_pass_is_kept_however_many_whole_passes_begin_since():
    # Loader A's worker 0 begins; then eval loaders (both workers begun) and iterations in the main
    # process come and go, far more than the table's rows; A's worker 1 still joins A's pass.
    epochs = EpochClock()
    assert epochs.begin(worker(0, 2, base_seed=1000)) == 0
    for other in range(3 * PASSES):
        assert [epochs.begin(worker(1, 2, base_seed=other)), epochs.begin(worker(0, 2, base_seed=other))] == [
            2 * other + 1, 2 * other + 1]
        assert epochs.begin(None) == 2 * other + 2
    assert epochs.begin(worker(1, 2, base_seed=1000)) == 0
    assert epochs.epoch == 6 * PASSES + 1


def _begin_passes_and_exit(epochs: EpochClock, passes: int) -> None:
    for base_seed in range(passes):
        epochs.begin(worker(0, 2, base_seed=base_seed))


def test_the_row_of_a_pass_whose_recorder_ended_is_used_again():
    # PASSES passes, each begun by worker 0 alone in a process that then ended (its loader's
    # workers were shut down before worker 1 began): none can have a late worker any more.
    epochs = EpochClock()
    ended = multiprocessing.get_context("fork").Process(target=_begin_passes_and_exit, args=(epochs, PASSES))
    ended.start()
    ended.join(timeout=60)
    assert ended.exitcode == 0 and epochs.epoch == PASSES
    assert [epochs.begin(worker(0, 2, base_seed=1000)), epochs.begin(worker(1, 2, base_seed=1000))] == [
        PASSES, PASSES]


def test_more_passes_beginning_at_once_than_the_table_holds_fail_loudly():
    # PASSES loaders each wait for their worker 1 (whose recorder, this process, runs): a worker of
    # one more loader cannot record its pass without taking one of theirs away, and says so.
    epochs = EpochClock()
    for base_seed in range(PASSES):
        assert epochs.begin(worker(0, 2, base_seed=base_seed)) == base_seed
    with pytest.raises(ConfigError, match="set_epoch") as raised:
        epochs.begin(worker(0, 2, base_seed=1000))
    assert "\n" not in str(raised.value)
    assert epochs.epoch == PASSES  # nothing taken
    for base_seed in range(PASSES):  # the passes waiting stay whole
        assert epochs.begin(worker(1, 2, base_seed=base_seed)) == base_seed
    assert [epochs.begin(worker(1, 2, base_seed=1000)), epochs.begin(worker(0, 2, base_seed=1000))] == [
        PASSES, PASSES]
