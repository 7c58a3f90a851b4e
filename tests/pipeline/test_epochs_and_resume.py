"""The epoch and a loaded resume state reach DataLoader workers, persistent ones too; a
resume applies once, to its own epoch; hostile state dicts are refused with ConfigError."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import ConfigError, RemoteDataset, ResumeError, loader
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

N = 300


@pytest.fixture(scope="module")
def dataset(seaweed):
    client = seaweed.client()
    upload_to_new_bucket(client, "epoch-resume-tests", "d", SyntheticImages(N, size=(32, 24)), maxcount=25)
    yield RemoteDataset(client, "epoch-resume-tests", "d", seed=3).map(lambda s: s["__key__"])
    client.close()


ALL = Counter(f"{i:06d}" for i in range(N))


def test_persistent_workers_follow_set_epoch(dataset):
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        order = list(loader)
        assert Counter(order) == ALL
        orders.append(order)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    fresh = []
    for epoch in range(3):  # the same orders as new workers would give for those epochs
        dataset.set_epoch(epoch)
        fresh.append(list(DataLoader(dataset, batch_size=None, num_workers=2)))
    assert fresh == orders


@pytest.mark.parametrize("persistent", [False, True])
def test_a_resume_applies_once_and_to_its_epoch_only(dataset, persistent):
    dataset.set_epoch(0)
    full = list(DataLoader(dataset, batch_size=None, num_workers=2))
    state = dataset.state_dict(consumed=80, num_workers=2)
    dataset.load_state_dict(state)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    rest = list(loader)
    assert Counter(full[:80]) + Counter(rest) == ALL and len(rest) == N - 80
    assert Counter(list(loader)) == ALL  # the same epoch again: whole, the state was used up
    dataset.set_epoch(1)
    assert Counter(list(loader)) == ALL


def test_a_resume_applies_once_without_workers(dataset):
    dataset.set_epoch(2)
    full = list(dataset)
    dataset.load_state_dict(dataset.state_dict(consumed=40))
    assert list(dataset) == full[40:]
    assert list(dataset) == full


def test_loading_a_state_after_persistent_workers_started_is_refused(dataset):
    dataset.set_epoch(0)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, persistent_workers=True)
    assert Counter(list(loader)) == ALL
    dataset.load_state_dict(dataset.state_dict(consumed=10, num_workers=1))
    with pytest.raises(ConfigError, match="persistent workers started"):
        list(loader)


def test_loader_refuses_a_state_loaded_after_its_persistent_workers_started_in_one_line(dataset, seaweed):
    # Each worker refused it in its own process: the error came in PyTorch's wrapper, 20 lines
    # of a worker's traceback before the one that says what to do.
    _ = dataset  # uploaded; read by a dataset of this test's own, which no other test loaded a state into
    dataset = RemoteDataset(seaweed.client(), "epoch-resume-tests", "d", seed=3).map(lambda s: s["__key__"])
    dataset.set_epoch(0)
    workers = loader(dataset, num_workers=1)
    assert Counter(list(workers)) == ALL
    dataset.load_state_dict(dataset.state_dict(consumed=10, num_workers=1))
    for _ in range(2):
        with pytest.raises(ResumeError) as refused:
            list(workers)
        assert str(refused.value) == ("load_state_dict was called after this DataLoader's persistent workers started;"
                                      " load the state before the first epoch, or create a new DataLoader")
    resumed = loader(dataset, num_workers=1)  # as the message says: the state is still owed
    assert len(list(resumed)) == N - 10


def _state(dataset, **changes):
    state = dataset.state_dict(consumed=10, num_workers=2)
    state.update(changes)
    return state


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"skip": [-1, 5]}, r"'skip\[0\]' must be an integer in 0"),
        ({"skip": [10_000, 0]}, "state skips 10000 samples of worker 0"),
        ({"skip": [True, 0]}, r"'skip\[0\]' must be an integer"),
        ({"skip": [1.5, 0]}, r"'skip\[0\]' must be an integer"),
        ({"skip": "5,5"}, "'skip' must list one count per worker"),
        ({"skip": [1]}, "'skip' must list one count per worker"),
        ({"epoch": -1}, "'epoch' must be an integer"),
        ({"epoch": "0"}, "'epoch' must be an integer"),
        ({"num_workers": 10**9}, "'num_workers' must be an integer in 1..1024"),
        ({"num_workers": 0}, "'num_workers' must be an integer in 1..1024"),
        ({"version": 99}, "state version 99"),
        ({"seed": 4}, "saved with seed 4"),
        ({"version": [1, 1]}, r"state version \[1, 1\] is not 1"),
        ({"version": torch.tensor([1, 1])}, "state version tensor"),
        ({"mixing": [4, -1, 0]}, r"'mixing\[1\]' must be an integer"),
        ({"mixing": "4,0,0"}, "'mixing' must be"),
    ],
)
def test_hostile_state_dicts_are_refused(dataset, changes, message):
    with pytest.raises(ConfigError, match=message):
        dataset.load_state_dict(_state(dataset, **changes))


@pytest.mark.parametrize("field", ["version", "epoch", "seed"])
def test_a_state_field_that_holds_a_long_list_is_named_in_a_message_of_one_short_line(dataset, field):
    # A list of 100,000 numbers was echoed whole: a message of 690,000 characters.
    with pytest.raises(ConfigError) as caught:
        dataset.load_state_dict(_state(dataset, **{field: list(range(100_000))}))
    assert len(str(caught.value)) < 300 and "\n" not in str(caught.value)


def test_a_worker_state_whose_version_is_an_array_is_refused_naming_it(dataset):
    # An array compared with != had numpy raise "The truth value of an array ... is ambiguous".
    ds = _fresh(dataset)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    with pytest.raises(ResumeError, match="worker state version array"):
        _fresh(dataset).load_state_dict({**state, "remote_loader_state": np.array([3, 3])})


@pytest.mark.parametrize("consumed", [np.int64(3), torch.tensor(3)])
def test_a_count_state_of_a_numpy_or_torch_count_holds_plain_ints_and_resumes(dataset, consumed):
    state = _fresh(dataset).state_dict(consumed=consumed, num_workers=2)
    assert type(state["skip"][0]) is int
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    _fresh(dataset).load_state_dict(torch.load(buffer))  # weights_only=True, the default


@pytest.mark.parametrize(
    "consumed, num_workers, message",
    [
        (2.5, 2, "consumed"),
        ("3", 2, "consumed"),
        (True, 2, "consumed"),
        (-1, 2, "consumed"),
        (3, "2", "num_workers"),
        (3, -1, "num_workers"),
        (3, 10**6, "num_workers"),
    ],
)
def test_state_dict_names_a_bad_count_or_worker_count(dataset, consumed, num_workers, message):
    with pytest.raises(ConfigError, match=f"state_dict's {message}"):
        _fresh(dataset).state_dict(consumed=consumed, num_workers=num_workers)


@pytest.mark.parametrize("mixing", [{"open_shards": 2}, {"shuffle": 50}])
def test_a_count_state_refuses_a_pipeline_that_mixes_otherwise(dataset, seaweed, mixing):
    # Loaded into another shuffle buffer (or open_shards), a count state repeated some samples
    # and lost as many, without a word: each worker's order depends on them.
    client = seaweed.client()

    def pipeline(open_shards: int = 4, shuffle: int = 100) -> RemoteDataset:
        ds = RemoteDataset(client, "epoch-resume-tests", "d", seed=3, open_shards=open_shards).shuffle(shuffle)
        return ds.map(lambda s: s["__key__"]).batched(4)

    saved = pipeline().state_dict(consumed=4, num_workers=2)
    other = pipeline(**mixing)
    with pytest.raises(ResumeError, match="mixes them otherwise"):
        other.load_state_dict(saved)
        list(DataLoader(other, batch_size=None, num_workers=2))
    full = [k for batch in DataLoader(pipeline(), batch_size=None, num_workers=2) for k in batch]
    same = pipeline()
    same.load_state_dict(saved)
    rest = [k for batch in DataLoader(same, batch_size=None, num_workers=2) for k in batch]
    assert Counter(full[:16]) + Counter(rest) == ALL


def test_a_count_state_saved_before_it_named_its_mixing_still_resumes(dataset):
    state = _fresh(dataset).state_dict(consumed=10, num_workers=2)
    del state["mixing"]
    _fresh(dataset).load_state_dict(state)


@pytest.mark.parametrize("state", [None, [], "state", {"version": 1}])
def test_what_is_not_a_state_dict_is_refused(dataset, state):
    with pytest.raises(ConfigError, match="state"):
        dataset.load_state_dict(state)


def test_set_epoch_refuses_what_is_not_an_epoch(dataset):
    for bad in (-1, 1.0, "1"):
        with pytest.raises(ConfigError, match="epoch must be an integer"):
            dataset.set_epoch(bad)


def test_spawned_persistent_workers_follow_set_epoch_too(seaweed, dataset):
    """Under spawn the shared state travels through torch's shared-memory pickling."""
    plain = RemoteDataset(dataset.reader.client, "epoch-resume-tests", "d", seed=3)
    loader = DataLoader(plain, batch_size=None, num_workers=1, persistent_workers=True,
                        multiprocessing_context="spawn")
    orders = []
    for epoch in range(2):
        plain.set_epoch(epoch)
        order = [s["__key__"] for s in loader]
        assert Counter(order) == ALL
        orders.append(order)
    assert orders[0] != orders[1]


def test_a_count_resume_continues_each_workers_stream_but_not_the_interleaving(dataset):
    # What docs/checkpointing.md promises: the items not yet consumed, each worker's in its own order;
    # the DataLoader's round-robin restarts at worker 0, so the interleaving may differ.
    ds = _fresh(dataset)  # a pipeline of its own: no state other tests loaded (a chain call carries one)
    ds.set_epoch(4)
    full = list(DataLoader(ds, batch_size=None, num_workers=2))
    ours = {w: full[w::2] for w in (0, 1)}  # equal shares: items alternate between the workers
    ds.load_state_dict(ds.state_dict(consumed=13, num_workers=2))
    rest = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert Counter(full[:13]) + Counter(rest) == ALL
    for worker, stream in ours.items():
        assert [k for k in rest if k in set(stream)] == stream[7 - worker:]  # worker 0 gave 7, worker 1 gave 6
    assert rest[:2] == [full[14], full[13]]  # the first pair swapped: worker 0 comes first again


# --------------------------------------------------------------------------- epochs without set_epoch


def _fresh(dataset, **options):
    """A new pipeline over the module's dataset, set_epoch never called."""
    ds = RemoteDataset(dataset.reader.client, "epoch-resume-tests", "d", seed=3, **options)
    return ds.map(lambda s: s["__key__"])


def _explicit(dataset, epochs):
    ds = _fresh(dataset)
    orders = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        orders.append(list(ds))
    return orders


@pytest.mark.parametrize("how", ["directly", "workers", "persistent workers"])
def test_without_set_epoch_each_iteration_takes_the_next_epoch(dataset, how):
    ds = _fresh(dataset)
    assert ds.epoch == 0
    if how == "directly":
        passes = [list(ds) for _ in range(3)]
    else:
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=how == "persistent workers")
        passes = [list(loader) for _ in range(3)]
    assert ds.epoch == 3
    assert all(Counter(order) == ALL for order in passes)
    assert passes[0] != passes[1] != passes[2] != passes[0]
    # The same order within an epoch whatever the workers: DataLoader interleaves their streams.
    expected = _explicit(dataset, range(3))
    if how == "directly":
        assert passes == expected
    else:
        assert [sorted(p) for p in passes] == [sorted(e) for e in expected]
        assert passes == [list(DataLoader(_at(dataset, e), batch_size=None, num_workers=2)) for e in range(3)]


def _at(dataset, epoch):
    ds = _fresh(dataset)
    ds.set_epoch(epoch)
    return ds


def test_set_epoch_then_follows_the_epoch_set_exactly(dataset):
    ds = _fresh(dataset)
    first = list(ds)  # epoch 0, taken by itself
    ds.set_epoch(5)
    again = [list(ds), list(ds)]
    assert again[0] == again[1] == _explicit(dataset, [5])[0] != first
    assert ds.epoch == 5


def test_loaders_with_other_worker_counts_take_the_next_epoch_each(dataset):
    ds = _fresh(dataset)
    orders = [list(DataLoader(ds, batch_size=None, num_workers=workers)) for workers in (2, 1, 0, 2)]
    assert all(Counter(order) == ALL for order in orders)
    assert [sorted(o) for o in orders] == [sorted(e) for e in _explicit(dataset, range(4))]
    assert len({tuple(o) for o in orders}) == 4


@pytest.mark.parametrize("persistent", [False, True])
def test_a_resume_without_set_epoch_continues_its_epoch_then_the_next(dataset, persistent):
    ds = _fresh(dataset)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    list(loader)  # epoch 0
    stream = iter(loader)  # epoch 1, stopped after 80 items
    before = [next(stream) for _ in range(80)]
    state = ds.state_dict(consumed=80, num_workers=2)
    del stream
    resumed = _fresh(dataset)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    loader = DataLoader(resumed, batch_size=None, num_workers=2, persistent_workers=persistent)
    rest = list(loader)
    assert Counter(before) + Counter(rest) == ALL and len(rest) == N - 80
    after = list(loader)
    assert after == list(DataLoader(_at(dataset, 2), batch_size=None, num_workers=2)) and resumed.epoch == 3


def test_spawned_persistent_workers_take_the_next_epoch_too(dataset):
    ds = RemoteDataset(dataset.reader.client, "epoch-resume-tests", "d", seed=3).to_tuple("__key__")  # picklable
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="spawn")
    orders = [[key for (key,) in loader] for _ in range(2)]
    assert all(Counter(o) == ALL for o in orders) and orders[0] != orders[1]
    assert [sorted(o) for o in orders] == [sorted(e) for e in _explicit(dataset, range(2))]


def test_a_dataloader_made_anew_each_epoch_with_a_seeded_generator_takes_the_next_epoch(dataset):
    # Its workers draw the same base seed each time and count their passes from 0: only the
    # numbers of their processes tell one DataLoader's pass from the next.
    ds = _fresh(dataset)
    orders = [list(DataLoader(ds, batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(7)))
              for _ in range(3)]
    assert ds.epoch == 3
    assert [sorted(o) for o in orders] == [sorted(e) for e in _explicit(dataset, range(3))]
    assert len({tuple(o) for o in orders}) == 3


def test_a_count_state_resumes_the_pipeline_it_counted_and_refuses_another_batch_size(dataset, seaweed):
    # Loaded into batches of 8, a count state of batches of 4 repeated some samples and lost others.
    client = seaweed.client()

    def pipeline(batch: int) -> RemoteDataset:
        return RemoteDataset(client, "epoch-resume-tests", "d", seed=3).map(lambda s: s["__key__"]).batched(batch)

    saved = pipeline(4).state_dict(consumed=4, num_workers=2)
    other = pipeline(8)
    with pytest.raises(ResumeError, match=r"counts items of 4 samples on 1 rank\(s\); this pipeline's items hold 8"):
        other.load_state_dict(saved)
        list(DataLoader(other, batch_size=None, num_workers=2))
    full = [k for batch in DataLoader(pipeline(4), batch_size=None, num_workers=2) for k in batch]
    same = pipeline(4)
    same.load_state_dict(saved)
    rest = [k for batch in DataLoader(same, batch_size=None, num_workers=2) for k in batch]
    assert Counter(full[:16]) + Counter(rest) == ALL and len(rest) == N - 16


def test_a_count_state_on_other_workers_is_refused_naming_the_workers_it_counted(dataset):
    state = _fresh(dataset).state_dict(consumed=10, num_workers=2)
    resumed = _fresh(dataset)
    resumed.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"rank 0/1 worker 0/2's own, not this worker's \(0/1, 0/1\): a count state"
                                          " resumes the ranks and workers it counted only"):
        list(resumed)


def test_an_end_of_epoch_count_state_without_short_batches_lets_the_next_epoch_start_whole(dataset):
    # Batches of 8 without the short one leave some samples of each worker's share undelivered
    # for good: such a state was taken for mid-epoch, and set_epoch(1) refused.
    def pipeline():
        return _fresh(dataset).batched(8, partial=False)

    ds = pipeline()
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    resumed = pipeline()
    resumed.load_state_dict(ds.state_dict(consumed=len(batches), num_workers=2))
    assert resumed.epoch == 1
    resumed.set_epoch(1)
    expected = pipeline()
    expected.set_epoch(1)
    assert list(DataLoader(resumed, batch_size=None, num_workers=2)) == list(
        DataLoader(expected, batch_size=None, num_workers=2))


def test_a_count_state_taken_after_a_resume_counts_the_whole_epoch(dataset):
    # The resumed DataLoader starts its round-robin anew: the items before the resume are the
    # loaded state's, those after it are dealt from there (a second count state repeated one).
    ds = _fresh(dataset)
    ds.set_epoch(0)
    stream = iter(DataLoader(ds, batch_size=None, num_workers=2))
    first = [next(stream) for _ in range(5)]
    del stream
    resumed = _fresh(dataset)
    resumed.load_state_dict(ds.state_dict(consumed=5, num_workers=2))
    resumed.set_epoch(0)
    stream = iter(DataLoader(resumed, batch_size=None, num_workers=2))
    more = [next(stream)]
    del stream
    with pytest.raises(ResumeError, match="had delivered 5 items: count every item of the epoch"):
        resumed.state_dict(consumed=1, num_workers=2)
    last = _fresh(dataset)
    last.load_state_dict(resumed.state_dict(consumed=6, num_workers=2))
    last.set_epoch(0)
    rest = list(DataLoader(last, batch_size=None, num_workers=2))
    assert Counter(first + more + rest) == ALL and len(first + more + rest) == N


def test_a_count_state_that_cuts_an_item_is_refused(dataset):
    state = _fresh(dataset).batched(4).state_dict(consumed=2, num_workers=2)
    state["skip"] = [5, 4]
    with pytest.raises(ResumeError, match="skips 5 samples of worker 0: not a whole number of items of 4"):
        _fresh(dataset).batched(4).load_state_dict(state)


def _key(sample):
    return sample["__key__"]


def test_a_state_loaded_before_the_stages_are_chained_is_carried_into_the_chain(dataset):
    client = dataset.reader.client

    def base():
        return RemoteDataset(client, "epoch-resume-tests", "d", seed=3)

    full = list(DataLoader(base().map(_key), batch_size=None, num_workers=2))
    state = base().map(_key).state_dict(consumed=20, num_workers=2)
    loaded = base()
    loaded.load_state_dict(state)  # before the stages: the chain holds it (it dropped it: every sample came again)
    rest = list(DataLoader(loaded.map(_key), batch_size=None, num_workers=2))
    assert Counter(full[:20]) + Counter(rest) == ALL and len(rest) == N - 20
    batched = base().map(_key).batched(4, collation_fn=list)
    with pytest.raises(ResumeError, match="a count state resumes the pipeline it counted only"):
        base().load_state_dict(batched.state_dict(consumed=5, num_workers=2))  # counted in batches: chain first


def _worker_1_waits_for(fifo, worker_id):
    """A worker_init_fn: worker 1 begins once the test opens ``fifo`` for writing."""
    if worker_id == 1:
        with open(fifo, "rb") as gate:
            gate.read(1)


def test_a_pass_of_another_loader_made_while_the_first_begins_leaves_its_epoch_whole(dataset, tmp_path):
    import functools
    import os

    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    ds = _fresh(dataset)
    first = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=functools.partial(_worker_1_waits_for, fifo))
    items = iter(first)
    got = [next(items)]  # worker 0 began the pass; worker 1 waits at the gate
    other = list(DataLoader(ds, batch_size=None, num_workers=1))  # another loader's whole pass meanwhile
    with open(fifo, "wb") as gate:
        gate.write(b"1")
    got += list(items)
    assert Counter(other) == ALL
    assert Counter(got) == ALL  # one epoch (worker 1 took the next: 12 of 40 twice, 12 never)


def test_a_count_state_after_a_resume_from_gathered_states_is_refused(dataset):
    # 1 worker -> 2 workers from a gathered state: a count of items cannot place the rest that was
    # divided anew (counted either way, samples came twice and others never).
    ds = _fresh(dataset)
    ds.set_epoch(0)
    stream = iter(ds)
    first = [next(stream) for _ in range(10)]
    gathered = [ds.state_dict()]  # a list of workers' states: the gathered form, divided anew
    del stream
    resumed = _fresh(dataset)
    resumed.load_state_dict(gathered)
    resumed.set_epoch(0)
    stream = iter(DataLoader(resumed, batch_size=None, num_workers=2))
    more = [next(stream) for _ in range(20)]
    del stream
    for consumed in (30, 20):
        with pytest.raises(ResumeError, match="epoch 0 resumed from workers' own or gathered states"):
            resumed.state_dict(consumed=consumed, num_workers=2)
    assert len(set(first + more)) == 30


def test_a_state_of_another_upload_is_refused_and_one_that_names_none_is_not_taken_silently(dataset, seaweed,
                                                                                          caplog):
    """A worker state always names its upload: one cut short of that field was taken by
    another dataset of the same size and delivered its positions there (70 of 100 samples).
    A count state saved before states named their upload still loads, said in the log. The
    refusal no longer says the state was saved on the dataset that refuses it."""
    import logging

    client = seaweed.client()
    other = "epoch-resume-other"
    upload_to_new_bucket(client, other, "d", SyntheticImages(N, size=(32, 24), seed=5), maxcount=25)
    def elsewhere():
        return RemoteDataset(client, other, "d", seed=3).map(lambda s: s["__key__"])

    ds = _fresh(dataset)
    it = iter(ds)
    next(it)
    worker = ds.state_dict()
    counted = _fresh(dataset).state_dict(consumed=10, num_workers=2)
    with pytest.raises(ResumeError, match=f"saved on another upload than s3://{other}/d's .*another dataset, or"):
        elsewhere().load_state_dict(worker)
    with pytest.raises(ResumeError, match="state lacks dataset"):
        elsewhere().load_state_dict({k: v for k, v in worker.items() if k != "dataset"})
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        elsewhere().load_state_dict({k: v for k, v in counted.items() if k != "dataset"})
    assert any("count state holds no dataset (saved before" in r.getMessage() for r in caplog.records)
    client.close()


@pytest.mark.parametrize("field", ["mixing", "split"])
def test_a_count_state_without_its_mixing_or_split_loads_said_in_the_log(dataset, caplog, field):
    """A count state without the mixing or split it was counted in cannot be checked against
    another shuffle buffer or world size, where its counts repeat samples (110 of 640 under
    shuffle(200) for a state of shuffle(100)): it still loads, as one saved before states held
    them, and the log says so, naming the field."""
    import logging

    counted = _fresh(dataset).state_dict(consumed=10, num_workers=2)
    assert field in counted
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        _fresh(dataset).load_state_dict({k: v for k, v in counted.items() if k != field})
    said = [r.getMessage() for r in caplog.records if "count state holds no" in r.getMessage()]
    assert len(said) == 1 and f"holds no {field} (saved before states did" in said[0]


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_spawned_workers_read_the_rank_torch_distributed_gave_this_process(dataset, monkeypatch, start):
    """A process group set up with rank= and world_size= (mp.spawn, SLURM), no RANK / WORLD_SIZE:
    a spawned worker has no group, and read the whole dataset on every rank (2 x 150 of 300 each)."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    given = RemoteDataset(dataset.reader.client, "epoch-resume-tests", "d", seed=3, rank=1, world_size=2)
    ours = [s["__key__"] for s in given]
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        plain = RemoteDataset(dataset.reader.client, "epoch-resume-tests", "d", seed=3)
        loader = DataLoader(plain, batch_size=None, num_workers=2, multiprocessing_context=start)
        keys = [s["__key__"] for s in loader]
        assert len(plain) == len(loader) == N // 2
    finally:
        dist.destroy_process_group()
    assert len(keys) == N // 2 and Counter(keys) == Counter(ours)


def test_a_copy_made_under_a_process_group_reads_the_whole_dataset_once_the_group_is_gone(dataset, monkeypatch):
    """A pipeline copied while a group existed carried that rank into its spawned workers for
    good: with the group destroyed (evaluation alone), len() said 300 and they read 150."""
    import copy

    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    plain = RemoteDataset(dataset.reader.client, "epoch-resume-tests", "d", seed=3)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        kept = copy.deepcopy(plain)
    finally:
        dist.destroy_process_group()
    keys = [s["__key__"] for s in DataLoader(kept, batch_size=None, num_workers=2, multiprocessing_context="spawn")]
    assert len(kept) == len(keys) == N and Counter(keys) == ALL
