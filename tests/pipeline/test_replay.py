"""A worker resumed from its own state goes on exactly as it would have: what torchdata's
StatefulDataLoader needs with ``snapshot_every_n_steps`` > 1, where it restores each worker
from a snapshot some batches old and throws away the batches it replays since. The worker
regenerates its delivery order up to its state's count, on integers, and goes on from there.

Workers are played in this process as in ``test_checkpoints.py``; the real
StatefulDataLoader runs in ``test_stateful_dataloader.py``.
"""

from __future__ import annotations

import itertools
import pickle
from operator import itemgetter

import pytest

from remote_loader import ConfigError, RemoteDataset
from remote_loader.read import DatasetReader
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket
from tests.pipeline.test_checkpoints import _not_every_third, as_worker, flat, make


def stop_and_resume(dataset_factory, worker, workers, stop):
    """The worker's uninterrupted items, the first ``stop`` of them, and what a fresh
    dataset that loads the state taken there delivers."""
    whole = dataset_factory()
    with as_worker(whole, worker, workers):
        uninterrupted = list(whole)
    stopped = dataset_factory()
    with as_worker(stopped, worker, workers):
        stream = iter(stopped)
        before = list(itertools.islice(stream, stop))
        state = pickle.loads(pickle.dumps(stopped.state_dict()))
        stream.close()
    resumed = dataset_factory()
    with as_worker(resumed, worker, workers):
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # before it iterates, the state it loaded
        after = list(resumed)
    return uninterrupted, before, after, state


@pytest.mark.parametrize("batch, keep", [(None, None), (7, None), (7, _not_every_third), (None, _not_every_third)],
                         ids=["shuffle", "batched", "select before batched", "select after shuffle"])
@pytest.mark.parametrize("stop", [0, 1, 5, 17])
def test_a_worker_resumed_from_its_own_state_goes_on_as_it_would_have(location, batch, keep, stop):
    uninterrupted, before, after, _ = stop_and_resume(lambda: make(location, batch=batch, keep=keep), 1, 2, stop)
    assert before + after == uninterrupted


def test_a_resume_of_a_resume_goes_on_as_it_would_have(location):
    uninterrupted, before, after, state = stop_and_resume(lambda: make(location), 0, 3, 9)
    again = make(location)
    with as_worker(again, 0, 3):
        again.load_state_dict(state)
        stream = iter(again)
        middle = list(itertools.islice(stream, 11))
        second = pickle.loads(pickle.dumps(again.state_dict()))
        stream.close()
    assert second["delivered"] == state["delivered"] + 11  # the same order, further on
    last = make(location)
    with as_worker(last, 0, 3):
        last.load_state_dict(second)
        rest = list(last)
    assert before + middle + rest == uninterrupted


def test_a_state_in_a_pipeline_that_mixes_otherwise_is_refused_not_resumed_wrongly(location):
    _, _, _, state = stop_and_resume(lambda: make(location), 0, 2, 12)
    other = (RemoteDataset(location, "checkpoint-tests", "d", seed=5, open_shards=3).shuffle(10)
             .map(itemgetter("__key__")))  # another shuffle buffer: another order
    with as_worker(other, 0, 2):
        other.load_state_dict(state)
        with pytest.raises(ConfigError, match="mixes samples otherwise"):
            list(other)


def test_a_state_whose_positions_are_not_its_orders_is_refused(location):
    _, _, _, state = stop_and_resume(lambda: make(location, 0, 2), 0, 1, 12)
    for altered in ({**state, "remaining": state["remaining"][2:]}, {**state, "delivered": state["delivered"] + 1}):
        with pytest.raises(ConfigError, match="does not add up"):  # its counts and lists disagree
            make(location, 0, 2).load_state_dict(altered)
        older = {k: v for k, v in altered.items() if k != "planned"}  # as saved before 'planned' was added
        dataset = make(location, 0, 2)
        dataset.load_state_dict(older)
        with pytest.raises(ConfigError, match="lists positions its order does not leave undelivered"):
            list(dataset)


def test_samples_skipped_under_on_error_skip_are_skipped_again_by_the_replay(seaweed):
    # A shard whose index is damaged is skipped whole when opened, a sample whose bytes are
    # damaged alone: the replay must skip the same, or its flow would shift.
    client = seaweed.client()
    upload_to_new_bucket(client, "replay-skips", "d", SyntheticImages(120, size=(32, 24)), maxcount=20)
    reader = DatasetReader(client, "replay-skips", "d")
    damaged_index, damaged_sample = reader.manifest.shards[1], reader.manifest.shards[4]
    start, end = reader.read_index(damaged_sample).byte_range(2)
    data = bytearray(client.get("replay-skips", f"d/{damaged_sample.name}"))
    data[(start + end) // 2] ^= 0xFF  # inside sample 2's bytes
    client.put("replay-skips", f"d/{damaged_sample.name}", bytes(data))
    data = bytearray(client.get("replay-skips", f"d/{damaged_index.name}"))
    data[damaged_index.index_offset + 3] ^= 0xFF
    client.put("replay-skips", f"d/{damaged_index.name}", bytes(data))

    def factory():
        return (RemoteDataset(client, "replay-skips", "d", seed=3, open_shards=3, on_error="skip")
                .shuffle(30, initial=30).map(lambda s: s["__key__"]).batched(4, collation_fn=list))

    for stop in (2, 22):  # of 25 batches
        uninterrupted, before, after, state = stop_and_resume(factory, 0, 1, stop)
        assert len(flat(uninterrupted)) == 120 - damaged_index.samples - 1
        assert flat(before + after) == flat(uninterrupted)
    client.close()
