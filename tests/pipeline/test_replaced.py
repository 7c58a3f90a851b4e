"""A dataset overwritten between passes, or under one: the pass that sees it raises
``DatasetChanged`` once, and the next pass reads the new upload, in this process, in
persistent DataLoader workers and in a new loader over the same pipeline. No pass mixes the
two uploads, and the DataLoader prints nothing when it ends."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import sys
import weakref

import pytest
from torch.utils.data import DataLoader

from remote_loader import DatasetChanged, LocalStore, RemoteDataset, ResumeError, loader
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload

OLD, NEW = 40, 30


@pytest.fixture
def store(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.create_bucket("b")
    upload(store, "b", "d", SyntheticImages(OLD, size=(16, 12)), maxcount=10)
    return store


def overwrite(store, seed: int = 5) -> None:
    """Upload other data in place of the dataset: ``NEW`` samples, of other sizes and labels."""
    upload(store, "b", "d", SyntheticImages(NEW, size=(20, 14), num_classes=3, seed=seed), maxcount=10,
           overwrite=True)


def pipeline(store, **options):
    return RemoteDataset(store, "b", "d", seed=3, **options).to_tuple("__key__", "cls", "jpg")


def samples(items) -> list[tuple[str, int, bytes]]:
    return sorted((str(key), int(label), bytes(image)) for key, label, image in items)


def new_data(store) -> list[tuple[str, int, bytes]]:
    return samples(pipeline(store))  # what a new RemoteDataset reads


@pytest.mark.parametrize("cached", [False, True], ids=["store", "node-cache"])
def test_the_pass_after_the_one_that_saw_an_overwrite_reads_the_new_upload(store, tmp_path, cached):
    ds = pipeline(store, **({"cache_dir": tmp_path / "cache"} if cached else {}))
    assert len(samples(ds)) == len(ds) == OLD
    overwrite(store)
    with pytest.raises(DatasetChanged, match="the next pass reads the new upload"):
        list(ds)
    assert samples(ds) == new_data(store) and len(ds) == NEW
    assert samples(ds) == new_data(store)  # and the passes after it


@pytest.mark.parametrize("cached", [False, True], ids=["store", "node-cache"])
def test_persistent_workers_and_a_new_loader_read_the_new_upload_and_print_nothing(store, tmp_path, cached, capfd):
    ds = pipeline(store, **({"cache_dir": tmp_path / "cache"} if cached else {}))
    batches = loader(ds, num_workers=2)
    assert batches.persistent_workers and len(samples(batches)) == OLD
    overwrite(store)
    with pytest.raises(DatasetChanged, match="the next pass reads the new upload"):
        list(batches)
    assert samples(batches) == new_data(store) and len(ds) == len(batches) == NEW
    overwrite(store, seed=6)  # once more, now with a new loader over the same pipeline
    with pytest.raises(DatasetChanged, match="the next pass reads the new upload"):
        list(loader(ds, num_workers=2))
    # The failed loader's iterator, held in a cycle by the error's traceback, is garbage now: a
    # worker forked before it is freed, whose collector frees it, printed AssertionErrors.
    assert samples(loader(ds, num_workers=2, worker_init_fn=_collect_garbage)) == new_data(store)
    del batches
    assert "AssertionError" not in capfd.readouterr().err


def _collect_garbage(worker: int) -> None:
    sys.unraisablehook = sys.__unraisablehook__  # pytest's, inherited, would keep what __del__ raises from stderr
    gc.collect()  # as a worker's collector does at some point: here, surely before it reads


def test_after_set_epoch_too(store):
    ds = pipeline(store)
    batches = loader(ds, num_workers=2)
    ds.set_epoch(0)
    assert len(samples(batches)) == OLD
    overwrite(store)
    ds.set_epoch(1)
    with pytest.raises(DatasetChanged):
        list(batches)
    ds.set_epoch(1)  # the epoch again
    assert samples(batches) == new_data(store)


def _late(event, worker: int) -> None:
    if worker == 1:
        assert event.wait(timeout=120), "the test never let worker 1 begin"


@pytest.mark.parametrize("epochs", ["taken", "set"])
def test_a_worker_that_begins_after_another_of_its_pass_saw_the_overwrite_reads_no_new_sample(store, epochs):
    """Worker 0 sees the overwrite at its first sample; worker 1 of the same pass begins only
    then: it must not read the new upload into a pass that delivered the old one."""
    ds = pipeline(store)
    assert len(samples(ds)) == OLD
    overwrite(store)
    if epochs == "set":
        ds.set_epoch(1)
    begin = multiprocessing.get_context("fork").Event()
    late = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=functools.partial(_late, begin),
                      multiprocessing_context="fork")
    items = iter(late)
    with pytest.raises(DatasetChanged):
        next(items)  # worker 0's
    begin.set()
    with pytest.raises(DatasetChanged, match="while this pass was under way"):
        next(items)  # worker 1's: not a sample of either upload
    del items
    if epochs == "set":
        ds.set_epoch(1)  # the epoch again
    assert samples(late) == new_data(store)  # the next pass


def test_a_checkpoint_of_the_old_upload_says_what_works(store):
    ds = pipeline(store)
    stream = iter(ds)
    for _ in range(5):
        next(stream)
    state = ds.state_dict()
    del stream
    overwrite(store)
    with pytest.raises(DatasetChanged):
        list(ds)
    with pytest.raises(ResumeError, match="another dataset|replaced since"):
        ds.load_state_dict(state)
    assert samples(ds) == new_data(store)


def test_a_checkpoint_loaded_before_the_overwrite_and_not_yet_resumed_is_not_followed_onto_the_new_upload(
        store, tmp_path):
    ds = pipeline(store, cache_dir=tmp_path / "cache")  # the cache sees an overwrite before a pass reads anything
    stream = iter(ds)
    for _ in range(5):
        next(stream)
    state = ds.state_dict()
    del stream
    ds.load_state_dict(state)
    overwrite(store)
    with pytest.raises(DatasetChanged, match="the next pass reads the new upload"):
        list(ds)
    for _ in range(2):
        with pytest.raises(DatasetChanged, match="cannot resume the new one: to read it, make a new RemoteDataset"):
            list(ds)
    assert samples(pipeline(store, cache_dir=tmp_path / "cache")) == new_data(store)


@pytest.mark.parametrize("through", ["dataset", "persistent workers"])
def test_a_dataset_overwritten_twice_between_passes_raises_once_then_reads_the_newest(store, through):
    """The pass that sees the second upload replaced too raises once; the passes after it read
    the third (every later pass raised: the first sighting was reported again over the newer)."""
    ds = pipeline(store)
    passes = ds if through == "dataset" else loader(ds, num_workers=2)
    assert sum(1 for _ in passes) == OLD  # not list(): len() would look at the manifest first
    overwrite(store)
    with pytest.raises(DatasetChanged):
        sum(1 for _ in passes)
    overwrite(store, seed=6)
    with pytest.raises(DatasetChanged):
        sum(1 for _ in passes)
    assert samples(passes) == new_data(store)
    assert samples(passes) == new_data(store)



def freed_at_once(ds) -> bool:
    """Whether the DatasetChanged that a pass over ``ds`` raises, dropped, goes at once, and
    with it what its traceback's frames hold (the pass's stream and buffers): nothing it
    holds holds it back in a reference cycle, which only the cyclic GC would free."""
    gc.collect()
    gc.disable()
    try:
        try:
            sum(1 for _ in ds)
        except DatasetChanged as caught:
            error = weakref.ref(caught)
        else:
            pytest.fail("the pass did not raise DatasetChanged")
        return error() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("taken", ["under the pass", "by the next pass"])
def test_a_dataset_changed_from_the_manifest_check_is_freed_without_the_cycle_collector(store, tmp_path, taken):
    """The check a pass over the node's cache runs beside it raises DatasetChanged, in the pass
    (its answer came while the pass ran) or in the next pass (the one that started it ended
    before its answer came)."""
    ds = pipeline(store, cache_dir=tmp_path / "cache")
    assert len(samples(ds)) == OLD  # every shard in the cache: only the check can tell the overwrite
    overwrite(store)
    if taken == "by the next pass":
        abandoned = iter(ds)  # starts the check; the pass ends before reading anything
        del abandoned
    assert freed_at_once(ds)
    assert samples(ds) == new_data(store)


def test_a_dataset_changed_for_an_upload_replaced_again_before_its_reopening_is_freed_without_the_cycle_collector(
        store, tmp_path):
    ds = pipeline(store, cache_dir=tmp_path / "cache")
    assert len(samples(ds)) == OLD
    overwrite(store)
    with pytest.raises(DatasetChanged):
        sum(1 for _ in ds)
    overwrite(store, seed=6)
    assert freed_at_once(ds)  # the pass that would reopen the second upload finds the third
    assert samples(ds) == new_data(store)


def test_a_dataset_changed_from_the_fetcher_is_freed_without_the_cycle_collector(store):
    """Without the node's cache the fetcher finds the overwrite: it keeps its failure, to
    raise it at every later check, and the failure's traceback holds the fetcher."""
    ds = pipeline(store)
    assert len(samples(ds)) == OLD
    overwrite(store)
    assert freed_at_once(ds)
