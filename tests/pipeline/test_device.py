"""Decoding batches on a device (``decode(..., device="cuda")``), through nvImageCodec's CPU
backend: the same code path as on a GPU, where workers draw each sample's crop and the main
process decodes whole batches. Same crops as the CPU path, pixels within one level; a JPEG
that does not decode names its sample or, under ``on_error="skip"``, leaves the rest of its
batch; resume and the loader's state behave as on the CPU path."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import ConfigError, DecodeError, RandomResizedCrop, RemoteDataset, decode_batches, loader
from remote_loader.pipeline.device import EncodedBatch, nvimgcodec
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import Undecodable, upload_to_new_bucket

try:
    nvimgcodec()
except ConfigError:
    pytest.skip("nvImageCodec is not installed (the gpu extra)", allow_module_level=True)

N = 90
BROKEN = 37  # a whole JPEG no decoder decodes (helpers.Undecodable): the upload takes it
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)




@pytest.fixture(scope="module")
def client(seaweed):
    store = seaweed.client()
    upload_to_new_bucket(store, "device-tests", "d", SyntheticImages(N, size=(160, 120)), maxcount=20)
    broken = Undecodable(40, size=(160, 120), broken=BROKEN)
    upload_to_new_bucket(store, "device-tests-broken", "d", broken, maxcount=20)
    yield store
    store.close()


def pipeline(client, bucket="device-tests", crop=None, batch=16, on_error="raise", **decode):
    crop = crop or RandomResizedCrop(48, reduced=False, fast=False)
    return (RemoteDataset(client, bucket, "d", seed=7, on_error=on_error).shuffle(30)
            .decode(crop, **decode).to_tuple("jpg", "cls", "__key__").batched(batch))


def by_key(batches):
    return {key: (image, int(label)) for images, labels, keys in batches
            for image, label, key in zip(images, labels, keys, strict=True)}


def test_batches_decoded_on_the_device_path_have_the_cpu_paths_crops(client):
    cpu = list(loader(pipeline(client), num_workers=2))
    device = list(loader(pipeline(client, device="cpu", batched=True), num_workers=2))
    assert [b[2] for b in device] == [b[2] for b in cpu]  # the same samples in the same order
    assert [b[1].tolist() for b in device] == [b[1].tolist() for b in cpu]
    for (ours, _, _), (theirs, _, _) in zip(device, cpu, strict=True):
        assert ours.shape == theirs.shape and ours.dtype == torch.uint8
        assert (ours.int() - theirs.int()).abs().max() <= 1  # the same box and flip, resampled alike
    one_process = by_key(loader(pipeline(client, device="cpu", batched=True), num_workers=0))
    assert one_process.keys() == by_key(device).keys()  # another split, the same crop for each key
    assert all(torch.equal(one_process[k][0], image) for k, (image, _) in by_key(device).items())


def test_the_crops_do_not_depend_on_workers_or_threads(client):
    runs = [by_key(loader(pipeline(client, device="cpu", batched=True, threads=threads), num_workers=workers))
            for workers, threads in ((0, 0), (2, 0), (1, 2))]
    for other in runs[1:]:
        assert other.keys() == runs[0].keys() and all(torch.equal(runs[0][k][0], v[0]) for k, v in other.items())


def test_normalised_output_matches_the_cpu_path(client):
    crop = RandomResizedCrop(48, reduced=False, fast=False, mean=MEAN, std=STD)
    cpu = next(iter(loader(pipeline(client, crop=crop), num_workers=0)))
    device = next(iter(loader(pipeline(client, crop=crop, device="cpu", batched=True), num_workers=0)))
    assert device[0].dtype == cpu[0].dtype == torch.float32
    assert (device[0] - cpu[0]).abs().max() <= 1 / (255 * min(STD)) + 1e-4


def test_a_jpeg_that_does_not_decode_names_its_sample_or_leaves_the_rest_of_its_batch(client):
    undecodable = r"sample .0000\d\d. of shard-.* is not a decodable JPEG: the CPU decoder could not decode it"
    with pytest.raises(DecodeError, match=undecodable) as info:
        list(loader(pipeline(client, "device-tests-broken", device="cpu", batched=True), num_workers=0))
    assert info.value.key == f"{BROKEN:06d}"
    skipping = pipeline(client, "device-tests-broken", on_error="skip", device="cpu", batched=True)
    batches = list(loader(skipping, num_workers=0))
    keys = [k for _, _, ks in batches for k in ks]
    assert sorted(keys) == [f"{i:06d}" for i in range(40) if i != BROKEN]
    assert all(len(images) == len(labels) == len(ks) for images, labels, ks in batches)
    assert sorted(len(images) for images, _, _ in batches) in ([7, 16, 16], [8, 15, 16])  # its batch less it
    assert skipping.metrics.skipped == 1


def test_a_batch_whose_every_jpeg_is_left_out_is_left_out_whole(client):
    skipping = pipeline(client, "device-tests-broken", batch=1, on_error="skip", device="cpu", batched=True)
    keys = [k for _, _, ks in loader(skipping, num_workers=0) for k in ks]
    assert sorted(keys) == [f"{i:06d}" for i in range(40) if i != BROKEN] and skipping.metrics.skipped == 1


def test_a_resumed_epoch_gives_the_same_crops(client):
    pytest.importorskip("torchdata")
    whole = list(loader(pipeline(client, device="cpu", batched=True), num_workers=1, stateful=True))
    stopped = loader(pipeline(client, device="cpu", batched=True), num_workers=1, stateful=True)
    first = list(itertools.islice(iter(stopped), 2))
    state = stopped.state_dict()
    resumed = loader(pipeline(client, device="cpu", batched=True), num_workers=1, stateful=True)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(first) + len(rest) == len(whole)
    assert all(torch.equal(a[0], b[0]) and a[2] == b[2] for a, b in zip(first + rest, whole, strict=True))


def test_the_rest_of_an_epoch_resumed_on_other_workers_has_the_same_crops(client):
    pytest.importorskip("torchdata")
    whole = by_key(loader(pipeline(client, device="cpu", batched=True), num_workers=1))
    stopped = loader(pipeline(client, device="cpu", batched=True), num_workers=1, stateful=True)
    first = by_key(itertools.islice(iter(stopped), 2))
    resumed = pipeline(client, device="cpu", batched=True)
    resumed.load_state_dict(stopped.state_dict())  # every worker's state: the rest, divided anew
    rest = by_key(loader(resumed, num_workers=2))
    assert not first.keys() & rest.keys() and first.keys() | rest.keys() == whole.keys()
    assert all(torch.equal(image, whole[key][0]) for key, (image, _) in {**first, **rest}.items())


def test_a_dataloader_of_your_own_is_decoded_by_decode_batches(client):
    from torch.utils.data import DataLoader

    ds = pipeline(client, device="cpu", batched=True)
    raw = next(iter(DataLoader(ds, batch_size=None)))
    assert isinstance(raw[0], EncodedBatch) and len(raw[0]) == 16
    images, labels, keys = next(iter(decode_batches(DataLoader(ds, batch_size=None), ds)))
    assert images.shape == (16, 3, 48, 48) and len(keys) == 16
    with pytest.raises(ConfigError, match="decode_batches is for a pipeline with decode"):
        decode_batches([], pipeline(client))


def test_devices_are_checked_where_the_pipeline_is_made(client, monkeypatch):
    base = RemoteDataset(client, "device-tests", "d")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"needs CUDA.*device='auto'"):
            base.decode(RandomResizedCrop(48), device="cuda")
        auto = base.decode(RandomResizedCrop(48), device="auto")
        assert auto.batch_decoder() is None  # no GPU: the CPU path, in the workers
    with pytest.raises(ConfigError, match="decode device must be"):
        base.decode(RandomResizedCrop(48), device="tpu")
    with pytest.raises(ConfigError, match="is for RandomResizedCrop"):
        base.decode("pil", device="cpu", batched=True)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # as if the gpu extra were not installed
    with pytest.raises(ConfigError, match=r"install the gpu extra"):
        base.decode(RandomResizedCrop(48), device="cpu", batched=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="device='auto' falls back to the CPU where there is no GPU")
def test_decode_batches_takes_a_pipeline_whose_auto_device_fell_back_to_the_cpu(client):
    ds = pipeline(client, device="auto")
    assert ds.batch_decoder() is None and ds.fell_back
    batches = DataLoader(ds, batch_size=None, num_workers=1)
    # The same batches loader() gives, decoded in the workers (it refused them: ConfigError).
    ds.set_epoch(0)
    got = by_key(decode_batches(batches, ds))
    ds.set_epoch(0)
    expected = by_key(loader(ds, num_workers=1))
    assert got.keys() == expected.keys() and len(got) == N
    assert all(torch.equal(got[k][0], expected[k][0]) and got[k][1] == expected[k][1] for k in got)
    with pytest.raises(ConfigError, match="decode_batches is for a pipeline with decode"):
        decode_batches([], pipeline(client))  # asked for the CPU: nothing to decode, a mistake


def test_nvimagecodec_says_nothing_on_stderr(client, seaweed):
    # It prints on file descriptor 2 which GPU libraries it could not load; a user must not see that.
    code = textwrap.dedent(f"""
        from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = RemoteDataset(client, "device-tests", "d").decode(RandomResizedCrop(32), device="cpu", batched=True)
        batches = list(loader(ds.to_tuple("jpg", "cls").batched(8), num_workers=0))
        print(len(batches), tuple(batches[0][0].shape))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["12", "(8,", "3,", "32,", "32)"] and done.stderr == ""


def test_an_iteration_left_early_ends_its_decoding_thread(client):
    import threading

    batches = iter(loader(pipeline(client, device="cpu", batched=True), num_workers=1))
    next(batches)
    batches.close()  # what leaving a for loop early does, once the iterator is dropped
    assert not [t for t in threading.enumerate() if t.name == "remote-loader-device"]
