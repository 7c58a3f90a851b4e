"""torchdata's StatefulDataLoader checkpoints a RemoteDataset with no counting by the user:
its state_dict() holds each worker's position, load_state_dict() resumes where it stopped,
and the states of every rank resume on other ranks and worker counts."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from remote_loader import ConfigError, ResumeError, loader
from remote_loader.pipeline.state.resume.states import MARK, find_states
from tests.pipeline.test_checkpoints import ALL, make

stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed (extra: torchdata)")
StatefulDataLoader = stateful.StatefulDataLoader


def keys(batches):
    return [k for batch in batches for k in batch]


def saved(state):
    """The state as a checkpoint file gives it back (torch.load's default weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def take(loader, count):
    stream = iter(loader)
    return [next(stream) for _ in range(count)], stream


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stopped_epoch_continues_where_it_stopped(location, workers):
    # DataLoader batching with workers: counting batches got this wrong; the loader's state does not.
    loader = StatefulDataLoader(make(location), batch_size=8, num_workers=workers)
    before, stream = take(loader, 9)
    state = saved(loader.state_dict())
    del stream
    resumed = StatefulDataLoader(make(location), batch_size=8, num_workers=workers)
    resumed.load_state_dict(state)
    after = list(resumed)
    assert Counter(keys(before)) + Counter(keys(after)) == ALL


def test_a_resume_on_the_same_workers_continues_their_own_streams(location):
    whole = list(StatefulDataLoader(make(location), batch_size=None, num_workers=2))
    loader = StatefulDataLoader(make(location), batch_size=None, num_workers=2)
    before, _ = take(loader, 50)
    resumed = StatefulDataLoader(make(location), batch_size=None, num_workers=2)
    resumed.load_state_dict(saved(loader.state_dict()))
    after = list(resumed)
    assert before == whole[:50]  # the order before the stop is the uninterrupted one
    assert Counter(before) + Counter(after) == ALL


def test_two_ranks_resume_on_one_rank_with_other_workers(location):
    states, before = [], Counter()
    for rank, count in [(0, 5), (1, 2)]:
        loader = StatefulDataLoader(make(location, rank, 2), batch_size=8, num_workers=2)
        batches, _ = take(loader, count)
        before += Counter(keys(batches))
        states.append(saved(loader.state_dict()))
    dataset = make(location)
    dataset.load_state_dict(states)  # the loader starts afresh: its own state is for 2 workers
    after = keys(StatefulDataLoader(dataset, batch_size=8, num_workers=1))
    assert before + Counter(after) == ALL


def test_persistent_workers_resume_then_run_the_next_epoch_whole(location):
    loader = StatefulDataLoader(make(location), batch_size=None, num_workers=2, persistent_workers=True)
    before, _ = take(loader, 30)
    dataset = make(location)
    resumed = StatefulDataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    resumed.load_state_dict(saved(loader.state_dict()))
    assert Counter(before) + Counter(resumed) == ALL
    dataset.set_epoch(1)
    assert Counter(resumed) == ALL


def test_a_state_saved_at_the_end_of_an_epoch_starts_the_next_whole(location):
    loader = StatefulDataLoader(make(location), batch_size=None, num_workers=2)
    assert Counter(loader) == ALL
    dataset = make(location)
    resumed = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    resumed.load_state_dict(saved(loader.state_dict()))
    dataset.set_epoch(1)
    assert Counter(resumed) == ALL


def test_a_state_from_sparse_snapshots_is_refused_not_resumed_wrongly(location):
    # With snapshot_every_n_steps=5, a state taken after 13 batches holds the workers as they
    # were 3 batches earlier; resuming from it elastically repeated and lost samples.
    loader = StatefulDataLoader(make(location), batch_size=8, num_workers=2, snapshot_every_n_steps=5)
    take(loader, 13)
    state = saved(loader.state_dict())
    with pytest.raises(ConfigError, match="snapshot_every_n_steps=1"):
        make(location).load_state_dict([state])


@pytest.mark.parametrize("batch_size, interval, steps", [(8, 5, 13), (None, 7, 40), (4, 3, 1)])
def test_sparse_snapshots_resume_on_the_same_workers_exactly_once(location, batch_size, interval, steps):
    # torchdata restores each worker from its last snapshot and replays the batches since,
    # discarding them: the resumed workers must give those batches again, the same ones.
    # Before, 20 samples were repeated and 20 lost after 13 batches of 8 at interval 5.
    whole = list(StatefulDataLoader(make(location), batch_size=batch_size, num_workers=2))
    loader = StatefulDataLoader(make(location), batch_size=batch_size, num_workers=2, snapshot_every_n_steps=interval)
    before, _ = take(loader, steps)
    resumed = StatefulDataLoader(make(location), batch_size=batch_size, num_workers=2, snapshot_every_n_steps=interval)
    resumed.load_state_dict(saved(loader.state_dict()))
    after = list(resumed)
    assert before + after == whole  # the uninterrupted order, each sample once


def test_sparse_snapshots_resume_twice_and_through_a_select_after_the_shuffle(location):
    keep = lambda key: int(key) % 3 != 0  # noqa: E731 - dropped after the shuffle, so placeholders pass it
    whole = list(StatefulDataLoader(make(location, keep=keep, batch=4), batch_size=None, num_workers=2))
    loader = StatefulDataLoader(make(location, keep=keep, batch=4), batch_size=None, num_workers=2,
                                snapshot_every_n_steps=4)
    first, _ = take(loader, 9)
    state = saved(loader.state_dict())
    second_loader = StatefulDataLoader(make(location, keep=keep, batch=4), batch_size=None, num_workers=2,
                                       snapshot_every_n_steps=4)
    second_loader.load_state_dict(state)
    second, _ = take(second_loader, 6)
    third_loader = StatefulDataLoader(make(location, keep=keep, batch=4), batch_size=None, num_workers=2,
                                      snapshot_every_n_steps=4)
    third_loader.load_state_dict(saved(second_loader.state_dict()))
    assert first + second + list(third_loader) == whole


@pytest.mark.parametrize("workers", [0, 2])
def test_without_set_epoch_a_resume_continues_its_epoch_then_takes_the_next(location, workers):
    loader = StatefulDataLoader(make(location, epoch=None), batch_size=None, num_workers=workers)
    first = list(loader)  # epoch 0
    before, _ = take(loader, 30)  # epoch 1, stopped
    state = saved(loader.state_dict())
    dataset = make(location, epoch=None)
    resumed = StatefulDataLoader(dataset, batch_size=None, num_workers=workers)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert Counter(before) + Counter(rest) == ALL
    nxt = list(resumed)  # epoch 2, whole
    reference = make(location, epoch=2)
    assert Counter(nxt) == ALL and sorted(nxt) == sorted(reference) and nxt != first
    assert nxt == list(StatefulDataLoader(reference, batch_size=None, num_workers=workers))


def test_without_set_epoch_a_state_saved_at_an_epochs_end_starts_the_next(location):
    loader = StatefulDataLoader(make(location, epoch=None), batch_size=None, num_workers=2)
    first = list(loader)
    state = saved(loader.state_dict())
    dataset = make(location, epoch=None)  # set_epoch never called
    resumed = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    nxt = list(resumed)
    # torchdata restores the workers for a pass that finds the epoch done, then starts another:
    # that one is epoch 1 (the restored pass took an epoch of its own, and this was epoch 2)
    assert nxt != first and nxt == list(StatefulDataLoader(make(location, epoch=1), batch_size=None, num_workers=2))
    assert list(resumed) == list(StatefulDataLoader(make(location, epoch=2), batch_size=None, num_workers=2))


def test_a_state_of_a_finished_epoch_from_sparse_snapshots_resumes_the_next_epoch_set(location):
    # The workers' last snapshots are mid-epoch while the loader had finished: the restored pass
    # replays the epoch's end and is dropped, then the next epoch set comes. It was refused: the
    # workers held a mid-epoch state of epoch 1 in an iteration of epoch 2.
    loader = StatefulDataLoader(make(location, epoch=1), batch_size=8, num_workers=2, snapshot_every_n_steps=3)
    assert Counter(keys(loader)) == ALL
    dataset = make(location, epoch=1)
    resumed = StatefulDataLoader(dataset, batch_size=8, num_workers=2, snapshot_every_n_steps=3)
    resumed.load_state_dict(saved(loader.state_dict()))
    dataset.set_epoch(2)
    assert keys(resumed) == keys(StatefulDataLoader(make(location, epoch=2), batch_size=8, num_workers=2))


def test_a_state_loaded_after_persistent_workers_started_is_refused_and_a_new_loader_resumes_it(location, capfd):
    # The refusal killed both workers inside torchdata (UnboundLocalError: 'initial_state'): the
    # dataset's state_dict(), asked as the pass began, raised it. The loader's next pass then
    # found them dead, and a new loader, as the message advises, was blamed for their exit.
    dataset = make(location)
    stopped = loader(dataset, stateful=True, num_workers=2)
    before, stream = take(stopped, 10)
    state = saved(stopped.state_dict())
    list(stream)
    dataset.load_state_dict(state)  # too late: the loader's workers run already
    for _ in range(2):  # its workers live on: every pass says why it cannot resume
        with pytest.raises(ResumeError) as refused:
            list(stopped)
        assert str(refused.value) == ("load_state_dict was called after this DataLoader's persistent workers started;"
                                      " load the state before the first epoch, or create a new DataLoader")
    resumed = make(location)
    resumed.load_state_dict(state)
    after = list(loader(resumed, stateful=True, num_workers=2))
    assert Counter(before) + Counter(after) == ALL and len(after) == sum(ALL.values()) - 10
    assert "Traceback" not in capfd.readouterr().err  # no worker died printing torchdata's


@pytest.mark.parametrize("taken, resumed", [(0, 2), (2, 0)])
def test_a_loaders_state_for_another_worker_count_is_refused_and_resumes_through_the_dataset(location, taken,
                                                                                            resumed):
    # torchdata refused it with a bare AssertionError ("State doesn't contain key '_snapshot'
    # expected for multiprocess dataloader"; '_num_yielded' the other way round).
    stopped = loader(make(location), stateful=True, num_workers=taken)
    before, _ = take(stopped, 30)
    state = saved(stopped.state_dict())
    with pytest.raises(ResumeError, match=r"ds\.load_state_dict\(state\)") as refused:
        loader(make(location), stateful=True, num_workers=resumed).load_state_dict(state)
    assert "\n" not in str(refused.value) and f"{taken or 'no'} DataLoader worker" in str(refused.value)
    dataset = make(location)
    dataset.load_state_dict(state)  # as the message advises
    assert Counter(before) + Counter(loader(dataset, stateful=True, num_workers=resumed)) == ALL


def epoch_of(location, epoch, workers):
    """What ``loader(..., stateful=True)`` on ``workers`` workers delivers of ``epoch``, in order."""
    return list(loader(make(location, epoch=epoch), stateful=True, num_workers=workers))


@pytest.mark.parametrize("workers", [0, 2])
def test_without_set_epoch_a_state_saved_once_the_pass_ended_resumes_the_next_epoch_whole(location, workers):
    # Without workers, torchdata restored the finished pass in this process, which took epoch 1
    # by itself, dropped it, and began another: epoch 2. Epoch 1 was never delivered.
    stopped = loader(make(location, epoch=None), stateful=True, num_workers=workers)
    assert Counter(stopped) == ALL  # epoch 0, to its end
    state = saved(stopped.state_dict())
    resumed = loader(make(location, epoch=None), stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    assert list(resumed) == epoch_of(location, 1, workers)
    assert list(resumed) == epoch_of(location, 2, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_once_the_pass_ended_resumes_the_epoch_set_after_it(location, workers):
    # Without workers, the finished epoch 1 came again where epoch 2 was set: the dataset's
    # state, loaded in this process as the pass began, moved the epoch set back to its own.
    stopped = loader(make(location, epoch=1), stateful=True, num_workers=workers)
    assert Counter(stopped) == ALL
    state = saved(stopped.state_dict())
    dataset = make(location, epoch=None)
    resumed = loader(dataset, stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    dataset.set_epoch(2)
    assert list(resumed) == epoch_of(location, 2, workers)


def at_the_last_item(loader):
    """The whole pass of ``loader`` and its state taken at its last item, inside the loop: after
    the last item came, before the pass ended."""
    items, state = [], None
    for item in loader:
        items.append(item)
        if len(items) == sum(ALL.values()):
            state = saved(loader.state_dict())
    return items, state


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_at_the_last_item_resumes_the_next_epoch_set_after_it_whole(location, workers):
    # The state said epoch 1 had nothing left; the pass of epoch 2 set after the load gave that
    # nothing (the state's epoch again) and epoch 2 was never delivered: without workers the state,
    # loaded as the pass began, moved the epoch set back to its own; each worker followed its own.
    items, state = at_the_last_item(loader(make(location, epoch=1), stateful=True, num_workers=workers))
    assert Counter(items) == ALL
    dataset = make(location, epoch=None)
    resumed = loader(dataset, stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    dataset.set_epoch(2)
    assert list(resumed) == epoch_of(location, 2, workers)
    dataset.set_epoch(3)
    assert list(resumed) == epoch_of(location, 3, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_at_the_last_item_resumes_its_own_epoch_empty_then_the_next(location, workers):
    # The uninterrupted loop had its epoch 1 to end: set again, it ends with nothing more.
    _, state = at_the_last_item(loader(make(location, epoch=1), stateful=True, num_workers=workers))
    dataset = make(location, epoch=None)
    resumed = loader(dataset, stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    dataset.set_epoch(1)
    assert list(resumed) == []
    dataset.set_epoch(2)
    assert list(resumed) == epoch_of(location, 2, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_without_set_epoch_a_state_taken_at_the_last_item_resumes_the_next_epoch_whole(location, workers):
    # With workers the first pass was epoch 0's empty rest and epoch 1 came a pass later; without
    # them it was epoch 1: now the same on both.
    _, state = at_the_last_item(loader(make(location, epoch=None), stateful=True, num_workers=workers))
    resumed = loader(make(location, epoch=None), stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    assert list(resumed) == epoch_of(location, 1, workers)
    assert list(resumed) == epoch_of(location, 2, workers)


def test_a_hand_made_loaders_state_saved_once_the_pass_ended_resumes_the_epoch_set_after_it(location):
    # torchdata loads the dataset's state as the next pass begins, after set_epoch(2): the state of
    # the finished epoch 1 moved the epoch set back to its own, and epoch 1 came whole again.
    stopped = StatefulDataLoader(make(location, epoch=1), batch_size=None, num_workers=0)
    assert Counter(stopped) == ALL
    state = saved(stopped.state_dict())
    dataset = make(location, epoch=None)
    resumed = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    resumed.load_state_dict(state)
    dataset.set_epoch(2)
    assert list(resumed) == list(StatefulDataLoader(make(location, epoch=2), batch_size=None, num_workers=0))


def broken(state, how):
    """``state`` with its first worker's state made bad ``how``."""
    worker = find_states(state)[0]
    if how == "remaining":
        worker["remaining"] = [5]
    elif how == "version":
        worker[MARK] = 99
    elif how == "epoch":
        worker["epoch"] = "x"
    elif how == "mixing":
        del worker["mixing"]
    elif how == "unfinished":  # a finished worker's state made to say it has samples left
        worker["remaining"] = [0, 3]
    return state


@pytest.mark.parametrize("how", ["remaining", "version", "epoch", "mixing", "unfinished"])
@pytest.mark.parametrize("at_end", [False, True])
def test_a_loaders_state_with_a_bad_worker_state_is_refused_in_one_line(location, how, at_end, capfd):
    # Each worker found its state bad as the next pass began: a ResumeError whose message was
    # torchdata's "Caught ResumeError in DataLoader worker process 0." and the worker's traceback.
    stopped = loader(make(location), stateful=True, num_workers=2)
    if at_end:
        list(stopped)
    else:
        take(stopped, 30)
    state = broken(saved(stopped.state_dict()), how)
    with pytest.raises(ResumeError) as refused:
        loader(make(location), stateful=True, num_workers=2).load_state_dict(state)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(("RemoteDataset", "the state of"))
    assert "Traceback" not in capfd.readouterr().err


def test_a_sparse_snapshots_state_taken_at_the_last_item_resumes_its_own_epoch_empty_then_the_next(location):
    # Its workers' states are 3 batches old and say epoch 1 has samples left: the next pass is
    # epoch 1's (empty) rest whatever epoch is set, so docs/checkpointing.md says to set epoch 1.
    sparse = dict(stateful=True, num_workers=2, snapshot_every_n_steps=3)
    items, state = at_the_last_item(loader(make(location, epoch=1), **sparse))
    assert Counter(items) == ALL
    dataset = make(location, epoch=None)
    resumed = loader(dataset, **sparse)
    resumed.load_state_dict(state)
    dataset.set_epoch(1)
    assert list(resumed) == []
    dataset.set_epoch(2)
    assert list(resumed) == epoch_of(location, 2, 2)


GONE = object()  # a field taken out of the state
GARBLED_WITHOUT_WORKERS = {  # where, in a state taken without workers; what it is made
    "not a dict": ((), None), "a list": ((), ["_num_yielded", 30]), "a string": ((), "state"),
    "_num_yielded gone": (("_num_yielded",), GONE), "_num_yielded a string": (("_num_yielded",), "30"),
    "_num_yielded negative": (("_num_yielded",), -1), "_sampler_iter_yielded gone": (("_sampler_iter_yielded",), GONE),
    "_iterator_finished a string": (("_iterator_finished",), "no"), "fetcher_state a list": (("fetcher_state",), []),
    "fetcher_ended gone": (("fetcher_state", "fetcher_ended"), GONE), "dataset_state gone": (("dataset_state",), GONE),
    "dataset_state None": (("dataset_state",), None), "_shared_seed a list": (("_shared_seed",), [1]),
}
GARBLED_WITH_WORKERS = {  # where, in a state taken with 2 workers; what it is made
    "not a dict": ((), None), "a list": ((), ["_snapshot"]), "_snapshot None": (("_snapshot",), None),
    "_snapshot a list": (("_snapshot",), []), "_snapshot gone": (("_snapshot",), GONE),
    "_worker_snapshots a list": (("_snapshot", "_worker_snapshots"), [{}, {}]),
    "_worker_snapshots gone": (("_snapshot", "_worker_snapshots"), GONE),
    "_worker_snapshots empty": (("_snapshot", "_worker_snapshots"), {}),
    "worker snapshot None": (("_snapshot", "_worker_snapshots", "worker_1"), None),
    "worker snapshot a list": (("_snapshot", "_worker_snapshots", "worker_0"), [0]),
    "worker snapshot renamed": (("_snapshot", "_worker_snapshots", "worker_7"), "worker_1"),
    "worker_id another": (("_snapshot", "_worker_snapshots", "worker_1", "worker_id"), 0),
    "dataset_state None": (("_snapshot", "_worker_snapshots", "worker_0", "dataset_state"), None),
    "fetcher_state a string": (("_snapshot", "_worker_snapshots", "worker_0", "fetcher_state"), "x"),
    "_main_snapshot gone": (("_snapshot", "_main_snapshot"), GONE),
    "_main_snapshot None": (("_snapshot", "_main_snapshot"), None),
    "_num_workers another": (("_snapshot", "_main_snapshot", "_num_workers"), 3),
    "_base_seed gone": (("_snapshot", "_main_snapshot", "_base_seed"), GONE),
    "_snapshot_step a string": (("_snapshot", "_snapshot_step"), "30"),
    "_last_yielded_worker_id out of range": (("_snapshot", "_last_yielded_worker_id"), 5),
    "_steps_since_snapshot negative": (("_steps_since_snapshot",), -1),
    "_steps_since_snapshot gone": (("_steps_since_snapshot",), GONE),
    "_iterator_finished gone": (("_iterator_finished",), GONE),
}


def garbled(state, where, value):
    """``state`` with the field at the path ``where`` made ``value`` (taken out: ``GONE``; a
    worker snapshot "renamed": moved to the key ``where[-1]``)."""
    if not where:
        return value
    *above, last = where
    parent = state
    for key in above:
        parent = parent[key]
    if last.startswith("worker_") and isinstance(value, str) and value.startswith("worker_"):
        parent[last] = parent.pop(value)
    elif value is GONE:
        del parent[last]
    else:
        parent[last] = value
    return state


@pytest.mark.parametrize("workers, how", [*((0, how) for how in GARBLED_WITHOUT_WORKERS),
                                          *((2, how) for how in GARBLED_WITH_WORKERS)])
def test_a_loaders_state_garbled_in_torchdatas_fields_is_refused_at_load_naming_the_field(location, workers, how,
                                                                                         capfd):
    # torchdata looked at these only as the next pass began: a bare AssertionError, KeyError or
    # TypeError from inside it (a worker's, with its traceback); a state that was None, or a
    # worker's snapshot or dataset state that was None, resumed nothing and delivered the
    # samples of before the stop again.
    where, value = (GARBLED_WITH_WORKERS if workers else GARBLED_WITHOUT_WORKERS)[how]
    stopped = loader(make(location), stateful=True, num_workers=workers)
    take(stopped, 30)
    state = garbled(saved(stopped.state_dict()), where, value)
    resumed = loader(make(location), stateful=True, num_workers=workers)
    with pytest.raises(ResumeError) as refused:
        resumed.load_state_dict(state)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("StatefulDataLoader state")
    assert (where[-1] if where else "not a dict") in message
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaders_state_taken_before_its_first_item_resumes_the_whole_epoch(location, workers):
    fresh = loader(make(location), stateful=True, num_workers=workers)
    state = saved(fresh.state_dict())
    resumed = loader(make(location), stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    assert Counter(resumed) == ALL


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("set_after_the_load", [False, True])
def test_a_resumed_pass_leaves_the_epoch_set_to_the_passes_after_it(location, workers, set_after_the_load):
    # Without workers, the state (loaded by torchdata as the pass began) made its own epoch 1 the
    # epoch set: with epoch 3 set, the passes after the resumed one were epoch 1 again, until the
    # next set_epoch. With workers, each restored its own state for that pass only.
    stopped = loader(make(location, epoch=1), stateful=True, num_workers=workers)
    before, _ = take(stopped, 30)
    state = saved(stopped.state_dict())
    dataset = make(location, epoch=None if set_after_the_load else 3)
    resumed = loader(dataset, stateful=True, num_workers=workers)
    resumed.load_state_dict(state)
    if set_after_the_load:
        dataset.set_epoch(3)
    assert Counter(before) + Counter(resumed) == ALL  # the rest of epoch 1, whatever epoch is set
    third = epoch_of(location, 3, workers)
    assert list(resumed) == third
    assert list(resumed) == third


def test_a_state_is_left_to_torchdata_under_a_torchdata_whose_layout_is_not_known(monkeypatch):
    """The fields checked are torchdata 0.11's: under another version a state that torchdata
    wrote itself, in a layout of its own, must not be refused here."""
    from remote_loader.pipeline.run import loader_state

    with pytest.raises(ResumeError, match="lacks its field '_snapshot'"):
        loader_state.check({"other": 1}, num_workers=2, stateful=True)
    monkeypatch.setattr(loader_state, "KNOWN_LAYOUT", False)
    assert loader_state.check({"other": 1}, num_workers=2, stateful=True) is None
