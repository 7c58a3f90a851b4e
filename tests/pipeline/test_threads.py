"""Stages on threads: the same output in the same order, failures naming their sample,
threads ended with the iteration; crops fixed by (seed, epoch, key) whatever the layout."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import weakref
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import ConfigError, DecodeError, RandomResizedCrop, RemoteDataset
from remote_loader.pipeline.stages.threads import threaded_map
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

N = 120


@pytest.fixture(scope="module")
def uploaded(seaweed):
    client = seaweed.client()
    upload_to_new_bucket(client, "thread-tests", "d", SyntheticImages(N, size=(80, 60)), maxcount=20)
    yield client
    client.close()


def _stage_threads():
    return [t for t in threading.enumerate() if t.name.startswith("remote-loader-stage")]


def test_threaded_map_keeps_order_and_bounds_what_is_in_flight():
    started = []
    lock = threading.Lock()

    def square(x):
        with lock:
            started.append(x)
        return x * x

    out = threaded_map(square, range(1000), threads=4)
    assert [next(out) for _ in range(10)] == [x * x for x in range(10)]
    assert len(started) <= 10 + 2 * 4  # what was taken, plus at most 2 x threads ahead
    assert list(out) == [x * x for x in range(10, 1000)]


@pytest.mark.parametrize("workers", [0, 2])
def test_threaded_stages_give_the_unthreaded_output_in_order(uploaded, workers):
    def tensors(threads):
        ds = (RemoteDataset(uploaded, "thread-tests", "d", seed=4).shuffle(50)
              .decode("torchrgb", threads=threads).map(lambda s: (s["__key__"], s["jpg"].float().mean().item()),
                                                        threads=threads))
        return list(DataLoader(ds, batch_size=None, num_workers=workers))

    plain = tensors(0)
    assert len(plain) == N and tensors(3) == plain


def test_a_failure_on_a_thread_names_its_sample(uploaded):
    def fail_on_one(sample):
        if sample["__key__"] == "000017":
            raise ValueError("bad augmentation")
        return sample

    with pytest.raises(ValueError, match="bad augmentation") as caught:
        list(RemoteDataset(uploaded, "thread-tests", "d").map(fail_on_one, threads=2))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "sample '000017' of shard-" in notes, notes


def test_a_decode_error_on_a_thread_keeps_its_type(uploaded):
    with pytest.raises(DecodeError):
        list(
            RemoteDataset(uploaded, "thread-tests", "d")
            .map(lambda s: {**s, "jpg": b"garbage"})
            .decode("pil", threads=2)
        )


def test_abandoning_an_iteration_ends_the_stage_threads(uploaded):
    before = len(_stage_threads())
    stream = iter(RemoteDataset(uploaded, "thread-tests", "d").decode("rgb8", threads=3))
    next(stream)
    assert len(_stage_threads()) > before
    stream.close()
    assert len(_stage_threads()) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda ds: ds.map(len, threads=-1),
        lambda ds: ds.decode("pil", threads=1.5),
        lambda ds: ds.map("not a function"),
        lambda ds: ds.shuffle(0),
        lambda ds: ds.batched(0),
        lambda ds: ds.decode("jpeg-please"),
        lambda ds: ds.to_tuple(),
        lambda ds: ds.select(None),
    ],
)
def test_chain_arguments_are_checked_when_the_chain_is_built(uploaded, call):
    with pytest.raises(ConfigError):
        call(RemoteDataset(uploaded, "thread-tests", "d"))


def _crops(uploaded, workers, threads, epoch=0, **dataset):
    ds = (
        RemoteDataset(uploaded, "thread-tests", "d", seed=7, **dataset)
        .decode(RandomResizedCrop(32), threads=threads)
        .to_tuple("__key__", "jpg")
    )
    ds.set_epoch(epoch)
    return {key: crop for key, crop in DataLoader(ds, batch_size=None, num_workers=workers)}


def test_crops_depend_on_seed_epoch_and_key_not_on_the_layout(uploaded):
    reference = _crops(uploaded, workers=0, threads=0)
    assert len(reference) == N
    for workers, threads in ((1, 0), (2, 0), (0, 3), (2, 2)):
        got = _crops(uploaded, workers, threads)
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference), (workers, threads)
    ranks = {}
    for rank in range(2):
        ranks.update(_crops(uploaded, 1, 0, rank=rank, world_size=2, equalize=False))
    assert all(torch.equal(ranks[k], reference[k]) for k in reference)
    other_epoch = _crops(uploaded, 0, 0, epoch=1)
    assert sum(not torch.equal(other_epoch[k], reference[k]) for k in reference) > N // 2
    assert Counter(len(c.shape) for c in reference.values()) == Counter({3: N})


_BLOCKED_MAP = """
import sys, threading
from remote_loader import RemoteDataset, make_client
endpoint, key, secret = sys.argv[1:4]
never = threading.Event()

def stuck(sample):
    if sample["__key__"] == "000007":
        print("blocked", flush=True)
        never.wait()  # a user function that never returns
    return sample

ds = RemoteDataset(make_client(endpoint, key, secret), "thread-tests", "d", shuffle_shards=False).map(stuck, threads=2)
try:
    for _ in ds:
        pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
    raise
"""


def test_ctrl_c_ends_a_loop_whose_threaded_map_never_returns(uploaded, seaweed):
    process = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_MAP, seaweed.endpoint_url, seaweed.access_key, seaweed.secret_key],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "blocked"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)  # before: the loop never saw it, and exit joined the thread
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "interrupted" in out and "KeyboardInterrupt" in err, err[-2000:]
    assert process.returncode != 0


def test_a_failure_after_to_tuple_names_its_sample_not_an_item_number(uploaded):
    def fail_on_one(pair):
        image, label = pair
        if bytes(image)[-20:] == target:
            raise ValueError("bad augmentation")
        return pair

    target = bytes(next(s for s in RemoteDataset(uploaded, "thread-tests", "d") if s["__key__"] == "000017")["jpg"])[
        -20:
    ]
    for threads in (0, 2):
        ds = RemoteDataset(uploaded, "thread-tests", "d").to_tuple("jpg", "cls").map(fail_on_one, threads=threads)
        with pytest.raises(ValueError, match="bad augmentation") as caught:
            list(ds)
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "sample '000017' of shard-" in notes, notes


class _Failed(Exception):
    made: list[weakref.ref[_Failed]] = []

    def __init__(self) -> None:
        super().__init__("no")
        _Failed.made.append(weakref.ref(self))


def _fail_on_3(item: int) -> int:
    if item == 3:
        raise _Failed()
    return item


def test_a_failure_on_a_thread_leaves_nothing_to_the_garbage_collector():
    # The error's traceback held the frame that waited for it, which held its future, which
    # held the error: the frames of a failed pass (and the samples they held) lived until the
    # garbage collector ran.
    gc.disable()
    try:
        mapped = threaded_map(_fail_on_3, range(10), 2)
        with pytest.raises(_Failed):
            list(mapped)
        mapped.close()
        for thread in threading.enumerate():
            if thread.name.startswith("remote-loader-stage"):
                thread.join(60)
        del mapped
        assert _Failed.made[-1]() is None
    finally:
        gc.enable()
