"""Pipeline stages as plain generators."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.pipeline.order.delivery import Shuffler
from remote_loader.pipeline.stages.chain import (
    Batched,
    Context,
    Map,
    batched_stage,
    map_tuple_stage,
    select_stage,
    to_tuple_stage,
)


def shuffle_stage(samples, bufsize, initial, seed):
    return Shuffler(bufsize, initial, seed).run(iter(samples))


@pytest.mark.parametrize("bufsize, initial", [(1, 0), (1, 1), (10, 3), (100, 100), (1000, 10)])
def test_shuffle_yields_every_sample_once(bufsize, initial):
    out = list(shuffle_stage(range(500), bufsize, initial, seed=[1]))
    assert sorted(out) == list(range(500))


def test_shuffle_is_seeded_and_mixes():
    a = list(shuffle_stage(range(1000), 200, 50, seed=[3, 0]))
    assert a == list(shuffle_stage(range(1000), 200, 50, seed=[3, 0]))
    assert a != list(shuffle_stage(range(1000), 200, 50, seed=[3, 1]))
    # Displacement grows with the buffer: a buffer of 200 moves samples far on average.
    assert np.mean(np.abs(np.array(a) - np.arange(1000))) > 50
    assert list(shuffle_stage(range(10), 1, 1, seed=[0])) == list(range(10))


def test_to_tuple_takes_the_first_present_field():
    samples = [{"__key__": "a", "jpg": 1, "cls": 2}, {"__key__": "b", "png": 3, "cls": 4}]
    assert list(to_tuple_stage(samples, ["jpg;png", "cls"])) == [(1, 2), (3, 4)]
    with pytest.raises(DecodeError, match="'b'.*jpg"):
        list(to_tuple_stage(samples, ["jpg", "cls"]))
    assert list(to_tuple_stage(samples, ["cls"])) == [(2,), (4,)]


def test_map_select_map_tuple():
    assert list(Map(lambda x: x * 2).run(range(4), Context(0, 0, 0, 0))) == [0, 2, 4, 6]
    assert list(select_stage(range(6), lambda x: x % 3 == 0)) == [0, 3]
    assert list(map_tuple_stage([(1, "a")], [lambda x: x + 1, None])) == [(2, "a")]
    with pytest.raises(ConfigError, match="2 functions"):
        list(map_tuple_stage([(1, 2, 3)], [None, None]))


def test_batched_partial_and_collation():
    assert list(batched_stage(range(7), 3, None, True)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(batched_stage(range(7), 3, None, False)) == [[0, 1, 2], [3, 4, 5]]
    assert list(batched_stage(range(4), 2, sum, True)) == [1, 5]


def test_stage_objects_pickle_and_run_after():
    context = Context(seed=0, epoch=0, rank=0, worker=0)
    batched = pickle.loads(pickle.dumps(Batched(4, None, True)))
    assert list(batched.run(range(5), context)) == [[0, 1, 2, 3], [4]]


def test_decoded_rgb8_arrays_are_writable_and_batch_into_tensors_without_a_warning():
    """``np.asarray`` of a Pillow image is read-only: torch's default collate then warned, at
    the first batch, that writing to the tensor would be undefined behaviour."""
    from torch.utils.data import default_collate

    from remote_loader.pipeline.stages.decode import decode_sample
    from remote_loader.testing.synthetic import SyntheticImages

    jpeg = SyntheticImages(1, size=(32, 24)).encoded(0)
    arrays = [decode_sample({"__key__": str(i), "jpg": jpeg}, "rgb8")["jpg"] for i in range(2)]
    assert all(array.flags.writeable for array in arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_collate(arrays).shape == (2, *arrays[0].shape)
