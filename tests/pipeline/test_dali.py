"""Decoding batches with DALI in the process that iterates (``decoding="dali"``, the default
on a GPU where DALI is installed), through DALI's CPU operators: the same pipeline as on a GPU. The
same samples, order and labels as the CPU path, crops within the documented distance of
its; the crops depend on neither workers nor resume; a JPEG DALI cannot decode is named,
or left out of its batch under ``skip``; no decoding process. Skipped without DALI."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from remote_loader import ConfigError, DecodeError, RandomResizedCrop, RemoteDataset, loader
from remote_loader.pipeline.device import dali
from remote_loader.pipeline.run import loader as loading
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload_to_new_bucket

if not dali.installed():
    pytest.skip("DALI is not installed (the gpu extra)", allow_module_level=True)

N, DAMAGED = 60, 23
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Damaged(SyntheticImages):
    """JPEGs, one of them (``DAMAGED``) with a Huffman table overwritten: whole (its header
    reads, its end marker is there), so the workers pass it on; libjpeg refuses it."""

    def __getitem__(self, index: int):  # type: ignore[override]
        image, label = super().__getitem__(index)
        if index != DAMAGED:
            return image, label
        data = bytearray(self.encoded(index))
        table = data.find(b"\xff\xc4") + 23
        data[table : table + 4] = b"\xff" * 4
        return bytes(data), label


@pytest.fixture(scope="module")
def client(seaweed):
    store = seaweed.client()
    upload_to_new_bucket(store, "dali-tests", "d", SyntheticImages(N, size=(160, 120)), maxcount=20)
    upload_to_new_bucket(store, "dali-damaged", "d", Damaged(40, size=(160, 120)), maxcount=20)
    yield store
    store.close()


def pipeline(client, bucket="dali-tests", crop=None, on_error="raise", **decode):
    crop = crop or RandomResizedCrop(48, reduced=False, fast=False)
    return (RemoteDataset(client, bucket, "d", seed=7, on_error=on_error).shuffle(30)
            .decode(crop, **decode).to_tuple("jpg", "cls", "__key__").batched(16))


def on_device(client, **options):
    return pipeline(client, device="cpu", batched=True, **options)


def by_key(batches):
    return {key: image for images, _, keys in batches for image, key in zip(images, keys, strict=True)}


def test_dali_is_the_default_on_a_gpu_and_decodes_in_this_process(client):
    assert loading.default_decoding(torch.device("cuda", 0)) == "dali"
    assert loading.default_decoding(torch.device("cpu")) == "process"  # beside Python, a process helps there
    batches = loader(on_device(client), num_workers=1, decoding="dali")
    assert batches.pid is None and batches.decoded_on == "CPU (DALI)"
    assert sum(len(keys) for _, _, keys in batches) == N


def test_the_same_samples_as_the_cpu_path_with_crops_within_the_documented_distance(client):
    cpu = list(loader(pipeline(client), num_workers=2))
    ours = list(loader(on_device(client), num_workers=2, decoding="dali"))
    assert [b[2] for b in ours] == [b[2] for b in cpu] and [b[1].tolist() for b in ours] == [b[1].tolist() for b in cpu]
    gaps = torch.cat([(a[0].int() - b[0].int()).abs().flatten(1) for a, b in zip(ours, cpu, strict=True)])
    inner = torch.cat([(a[0].int() - b[0].int()).abs()[..., 1:-1, 1:-1].flatten(1)
                       for a, b in zip(ours, cpu, strict=True)])
    assert ours[0][0].dtype == torch.uint8 and ours[0][0].shape == (16, 3, 48, 48)
    assert inner.max() <= 1 and gaps.float().mean() <= 0.5 and gaps.max() <= 16  # docs/gpu.md's distance


def test_normalised_crops_come_as_the_cpu_paths(client):
    crop = RandomResizedCrop(48, reduced=False, fast=False, mean=MEAN, std=STD)
    cpu = next(iter(loader(pipeline(client, crop=crop), num_workers=0)))
    ours = next(iter(loader(on_device(client, crop=crop), num_workers=0, decoding="dali")))
    assert ours[0].dtype == torch.float32 and ours[2] == cpu[2]
    inner = (ours[0] - cpu[0]).abs()[..., 1:-1, 1:-1]
    assert inner.max() <= 1 / (255 * min(STD)) + 1e-4


def test_the_crops_depend_on_neither_workers_nor_a_resume(client):
    pytest.importorskip("torchdata")
    whole = by_key(loader(on_device(client), num_workers=0, decoding="dali"))
    assert by_key(loader(on_device(client), num_workers=2, decoding="dali")).keys() == whole.keys()
    stopped = loader(on_device(client), num_workers=1, stateful=True, decoding="dali")
    first = by_key(itertools.islice(iter(stopped), 2))
    resumed = loader(on_device(client), num_workers=1, stateful=True, decoding="dali")
    resumed.load_state_dict(stopped.state_dict())
    rest = by_key(resumed)
    assert not first.keys() & rest.keys() and first.keys() | rest.keys() == whole.keys()
    assert all(torch.equal(image, whole[key]) for key, image in {**first, **rest}.items())


def test_a_jpeg_dali_cannot_decode_is_named_or_left_out_of_its_batch(client):
    with pytest.raises(DecodeError, match=r"sample '0000\d\d' of shard-.* is not a decodable JPEG: DALI on the CPU"
                                          r" could not decode it") as info:
        list(loader(on_device(client, bucket="dali-damaged"), num_workers=0, decoding="dali"))
    assert info.value.key == f"{DAMAGED:06d}"
    skipping = on_device(client, bucket="dali-damaged", on_error="skip")
    batches = list(loader(skipping, num_workers=0, decoding="dali"))
    keys = sorted(k for _, _, ks in batches for k in ks)
    assert keys == [f"{i:06d}" for i in range(40) if i != DAMAGED] and skipping.metrics.skipped == 1
    assert all(len(images) == len(labels) == len(ks) for images, labels, ks in batches)
    whole = by_key(loader(on_device(client, bucket="dali-damaged", on_error="skip"), num_workers=0, decoding="dali"))
    assert all(torch.equal(whole[k], image) for k, image in by_key(batches).items())  # the rest as decoded whole


def test_a_batch_larger_than_the_pipeline_was_built_for_is_decoded_whole():
    crops = dali.DaliCrops(torch.device("cpu"), 16, batch=2)
    data = SyntheticImages(5, size=(40, 30))
    jpegs = [np.frombuffer(data.encoded(i), np.uint8) for i in range(5)]
    box = [(2, 3, 18, 19)]
    out = crops.run(jpegs, box * 5, [False, True, False, True, False])
    alone = torch.cat([crops.run([jpeg], box, [False]) for jpeg in jpegs])
    assert out.shape == (5, 3, 16, 16)
    for k in range(5):  # each as decoded alone, flipped where asked
        assert torch.allclose(out[k], alone[k].flip(-1) if k % 2 else alone[k], atol=1e-3)


def test_dali_asked_for_where_it_is_not_installed_names_the_extra(client, monkeypatch):
    monkeypatch.setattr(dali, "installed", lambda: False)
    assert loading.default_decoding(torch.device("cuda", 0)) == "process"
    with pytest.raises(ConfigError, match=r"decoding='dali' needs NVIDIA DALI: install the gpu extra"):
        loader(on_device(client), num_workers=0, decoding="dali")


def test_a_process_that_takes_one_batch_and_ends_with_dalis_threads_alive_exits_cleanly(seaweed, client):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = (RemoteDataset(client, "dali-tests", "d").decode(RandomResizedCrop(32), device="cpu", batched=True)
              .to_tuple("jpg", "cls").batched(8))
        batches = iter(loader(ds, num_workers=1, decoding="dali"))
        images, labels = next(batches)   # the iterator, its thread and DALI's, alive as the script ends
        print(tuple(images.shape))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    assert done.stdout.split() == ["(8,", "3,", "32,", "32)"]


_FORKED = """
import json, sys, torch
from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
from tests.helpers import in_plain_fork
endpoint, access, secret, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = make_client(endpoint, access, secret)

def pipeline():
    return (RemoteDataset(client, "dali-tests", "d", seed=7).decode(RandomResizedCrop(48), device="cpu", batched=True)
            .to_tuple("jpg", "cls", "__key__").batched(16))

batches = loader(pipeline(), num_workers=workers, decoding="dali")
count = lambda stream: sum(len(keys) for _, _, keys in stream)
first = count(batches)

def made_there():
    torch.set_num_threads(1)  # as in a DataLoader worker: a fork's first parallel region waits for OpenMP's threads
    return count(loader(pipeline(), num_workers=workers, decoding="dali"))

print(json.dumps([first, in_plain_fork(lambda: count(batches), 60), in_plain_fork(made_there, 60), count(batches)]))
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_process_forked_from_one_that_ran_dali_is_told_so_rather_than_waiting_forever(seaweed, client, workers):
    """In a process of its own (a fork of this test process could inherit DALI pipelines
    other tests left to the collector, which DALI cannot free in a fork)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _FORKED, seaweed.endpoint_url, seaweed.access_key, seaweed.secret_key,
                           str(workers)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    first, inherited, made_there, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == after == N  # the parent's decodes on
    assert inherited[:2] == ["raised", "ConfigError"] and "was forked" in inherited[2], inherited
    assert "decoding='process'" in inherited[2]
    assert made_there[:2] == ["raised", "ConfigError"], made_there  # nor can a loader made in the fork
