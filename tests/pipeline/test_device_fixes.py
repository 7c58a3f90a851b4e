"""The device stage's fixes, through nvImageCodec's CPU backend (the GPU's code path): JPEGs
with an EXIF orientation, normalised images that are not JPEG, the default (reduced, fast)
crop, pipelines without ``batched``, a StatefulDataLoader of your own resumed, a process
that exits with a decode under way, an epoch left early on persistent workers; and the
pure helpers (``chunks``, ``indexed``, ``structure_problem``)."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import types
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from remote_loader import ConfigError, DecodeError, RandomResizedCrop, RemoteDataset, decode_batches, loader
from remote_loader.format.images import structure_problem
from remote_loader.pipeline.device import Encoded, EncodedBatch
from remote_loader.pipeline.device.codec import HARDWARE, NvImageCodec
from remote_loader.pipeline.device.place import indexed
from remote_loader.pipeline.device.resize import chunks
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import Undecodable, require_nvimagecodec, upload_to_new_bucket

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
WIDTH, HEIGHT = 160, 120
PLAIN, ROTATED, MIXED, LARGE = 64, 24, 32, 32  # samples in each bucket


BROKEN_OF, BROKEN = 12, 5


class Rotated(SyntheticImages):
    """``WIDTH x HEIGHT`` JPEGs stored unrotated, with EXIF orientation 6 (shown turned 90°)."""

    def __getitem__(self, index: int):  # type: ignore[override]
        exif = Image.Exif()
        exif[0x0112] = 6
        out = io.BytesIO()
        self.image(index).resize((WIDTH, HEIGHT)).save(out, "JPEG", quality=90, exif=exif.tobytes())
        return out.getvalue(), self.label(index)




@pytest.fixture(scope="module")
def client(seaweed):
    require_nvimagecodec()
    store = seaweed.client()
    upload_to_new_bucket(store, "fixes-plain", "d", SyntheticImages(PLAIN, size=(WIDTH, HEIGHT)), maxcount=16)
    upload_to_new_bucket(store, "fixes-rotated", "d", Rotated(ROTATED), maxcount=12)
    mixed = SyntheticImages(MIXED, size=(WIDTH, HEIGHT), formats=("jpeg", "png"))  # odd indexes are PNG
    upload_to_new_bucket(store, "fixes-mixed", "d", mixed, maxcount=16)
    upload_to_new_bucket(store, "fixes-large", "d", SyntheticImages(LARGE, size=(400, 300)), maxcount=16)
    upload_to_new_bucket(store, "fixes-broken", "d", Undecodable(BROKEN_OF, size=(64, 48), broken=BROKEN), maxcount=8)
    yield store
    store.close()


def crops(client, bucket, crop, field="jpg", **decode):
    """Every sample's crop by key, through ``loader`` in this process."""
    ds = RemoteDataset(client, bucket, "d", seed=7).decode(crop, **decode).to_tuple(field, "__key__").batched(8)
    return {key: image for images, keys in loader(ds, num_workers=0) for image, key in zip(images, keys, strict=True)}


def both_paths(client, bucket, crop, field="jpg"):
    """The CPU path's crops and the device path's (on nvImageCodec's CPU backend), by key."""
    cpu = crops(client, bucket, crop, field)
    device = crops(client, bucket, crop, field, device="cpu", batched=True)
    assert device.keys() == cpu.keys() and len(cpu) > 0
    return cpu, device


def pipeline(client, bucket="fixes-plain", batch=16, fn=None):
    crop = RandomResizedCrop(48, reduced=False, fast=False)
    samples = RemoteDataset(client, bucket, "d", seed=7).shuffle(30).decode(crop, device="cpu", batched=True)
    samples = samples.to_tuple("jpg", "cls", "__key__")
    return (samples if fn is None else samples.map(fn)).batched(batch)


def keys_of(batches):
    return [key for *_, keys in batches for key in keys]


def level_gap(a, b):
    return (a.int() - b.int()).abs().max().item()


# ---------------------------------------------------------------- decoding, against the CPU path


def test_a_jpeg_with_an_exif_orientation_is_cropped_as_the_cpu_path_crops_it(client):
    data, _ = Rotated(1)[0]
    with Image.open(io.BytesIO(data)) as stored:
        assert stored.getexif()[0x0112] == 6 and stored.size == (WIDTH, HEIGHT)  # stored unrotated
    cpu, device = both_paths(client, "fixes-rotated", RandomResizedCrop(48, reduced=False, fast=False))
    assert len(device) == ROTATED
    for key, image in device.items():
        assert image.shape == (3, 48, 48) and level_gap(image, cpu[key]) <= 1, key
    whole = RandomResizedCrop(48, scale=(1.0, 1.0), ratio=(WIDTH / HEIGHT, WIDTH / HEIGHT), reduced=False, fast=False)
    assert whole.box(WIDTH, HEIGHT) == (0, 0, WIDTH, HEIGHT)  # the box is the whole, unrotated image
    cpu, device = both_paths(client, "fixes-rotated", whole)  # no DecodeError: the box fits the decoded image
    assert all(level_gap(image, cpu[key]) <= 1 for key, image in device.items())


def test_normalised_images_that_are_not_jpeg_are_normalised_once(client):
    crop = RandomResizedCrop(48, reduced=False, fast=False, mean=MEAN, std=STD)
    cpu, device = both_paths(client, "fixes-mixed", crop, field="jpg;png")
    pngs = {f"{i:06d}" for i in range(1, MIXED, 2)}  # formats cycle: odd indexes are PNG
    assert pngs < device.keys()
    tolerance = 1 / (255 * min(STD)) + 1e-4
    for key, image in device.items():
        assert image.dtype == torch.float32 and image.shape == (3, 48, 48)
        assert (image - cpu[key]).abs().max().item() <= tolerance, (key, key in pngs)
    spread = torch.stack([device[k] for k in sorted(pngs)])
    assert spread.min() < -1.8 and spread.max() > 0  # not squeezed into [-2.12, -1.75] by a second pass


def test_the_default_crop_is_close_to_the_cpu_paths_reduced_and_fast_decode(client):
    # A small crop of a large image: the CPU path decodes at 1/4 or 1/8 scale, where its box's
    # edges move to the reduced image's pixels; the device path takes the same edges (4.3 levels
    # apart on average, 7.6 at worst, while it took the box as drawn; 1.3 and 5.7 now).
    crop = RandomResizedCrop(24)
    assert crop.reduced and crop.fast
    probe = RandomResizedCrop(24, seed=0)
    boxes = [probe.box(400, 300) for _ in range(20)]
    assert any(probe.source_box(400, 300, box) != tuple(map(float, box)) for box in boxes)  # reduced decoding on
    cpu, device = both_paths(client, "fixes-large", crop)
    assert len(device) == LARGE
    gaps = {key: (image.float() - cpu[key].float()).abs().mean().item() for key, image in device.items()}
    assert sum(gaps.values()) / len(gaps) <= 2, gaps
    assert max(gaps.values()) <= 8, gaps


# ---------------------------------------------------------------- pure helpers


def check_chunks(windows, budget):
    runs = chunks(windows, budget)
    assert [i for run in runs for i in run] == list(range(len(windows)))  # consecutive, each index once
    assert all(len(run) > 0 and run.step == 1 for run in runs)
    for k, run in enumerate(runs):
        tall, wide = max(windows[i][0] for i in run), max(windows[i][1] for i in run)
        if len(run) > 1:
            assert len(run) * tall * wide <= budget, (run, windows, budget)
        if k + 1 < len(runs):  # a run ends only where the next window would break the budget
            nxt = windows[runs[k + 1][0]]
            assert (len(run) + 1) * max(tall, nxt[0]) * max(wide, nxt[1]) > budget
    for i, (h, w) in enumerate(windows):
        if h * w > budget:
            assert range(i, i + 1) in runs  # a window larger than the budget is alone
    return runs


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), max_size=40), st.integers(1, 20_000))
def test_chunks_keep_each_padded_run_within_the_budget(windows, budget):
    check_chunks(windows, budget)


def test_chunks_in_a_few_cases():
    assert check_chunks([], 100) == []
    assert check_chunks([(10, 10)] * 5, 250) == [range(0, 2), range(2, 4), range(4, 5)]
    assert check_chunks([(5, 5), (100, 100), (5, 5)], 300) == [range(0, 1), range(1, 2), range(2, 3)]
    assert check_chunks([(4, 2), (2, 4)], 32) == [range(0, 2)]  # 2 x 4 x 4: the padded box, not the sum
    assert check_chunks([(4, 2), (2, 4)], 31) == [range(0, 1), range(1, 2)]


def test_cuda_without_an_index_is_the_current_device_and_an_index_stays():
    assert indexed(torch.device("cuda"), lambda: 3) == torch.device("cuda", 3)
    calls = []

    def current():
        calls.append(None)
        return 3

    assert indexed(torch.device("cuda:1"), current) == torch.device("cuda", 1)
    assert calls == []


def test_structure_problem_tells_a_whole_jpeg_from_a_broken_one():
    data = SyntheticImages(1, size=(32, 24)).encoded(0)
    assert data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9"
    assert structure_problem(data) is None
    assert structure_problem(data + bytes(64)) is None  # zero padding after the end marker
    assert structure_problem(memoryview(data + bytes(3))) is None
    cut = data[: len(data) // 2]
    assert cut[-2:] != b"\xff\xd9"
    assert "end" in (structure_problem(cut) or "")
    scan = data.find(b"\xff\xda")
    no_scan = data[:scan] + b"\xff\xd9"
    assert "scan" in (structure_problem(no_scan) or "")
    assert structure_problem(b"") is not None and structure_problem(bytes(16)) is not None
    for trailer in (b"\n", b"\xff", b"\xff\xff", b"a camera's trailer"):  # bytes after the end marker: whole
        assert structure_problem(data + trailer) is None, trailer


def test_a_jpeg_cut_short_after_an_exif_thumbnail_is_caught():
    # The thumbnail inside APP1 has a scan and an end marker of its own, before the image's scan.
    thumbnail = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(thumbnail, "JPEG")
    exif = Image.Exif()
    exif[0x0112] = 1
    tags = exif.tobytes() + thumbnail.getvalue()
    out = io.BytesIO()
    SyntheticImages(1, size=(64, 48)).image(0).save(out, "JPEG", exif=tags)
    data = out.getvalue()
    first_scan, first_end = data.find(b"\xff\xda"), data.find(b"\xff\xd9")
    assert first_scan < first_end < data.rfind(b"\xff\xda")  # the thumbnail's scan and end, then the image's scan
    assert structure_problem(data) is None
    assert "end" in (structure_problem(data[:-40]) or "")


# ---------------------------------------------------------------- loaders


def test_a_device_stage_is_checked_for_its_decoder_before_its_device(client):
    base = RemoteDataset(client, "fixes-plain", "d")
    for device in ("cuda", "cpu"):  # not "needs CUDA" first, on a machine without a GPU
        with pytest.raises(ConfigError, match=r"decoding on a device \('(cuda|cpu)'\) is for RandomResizedCrop"):
            base.decode("pil", device=device, batched=True)


class BrokenPng(SyntheticImages):
    """JPEGs, and one PNG (``broken``) whose image data is damaged inside whole chunks: it opens,
    the upload takes it, and it fails only once decoded, in the worker (not a JPEG)."""

    def __init__(self, *args, broken: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.broken = broken

    def __getitem__(self, index: int):  # type: ignore[override]
        if index != self.broken:
            return super().__getitem__(index)
        out = io.BytesIO()
        self.image(index).save(out, "PNG")
        data = bytearray(out.getvalue())
        at = data.find(b"IDAT") + 40
        data[at : at + 8] = bytes(8)
        return bytes(data), self.label(index)


def test_an_image_that_fails_in_the_worker_is_skipped_and_counted_on_the_device_path_too(seaweed):
    """What fails in a worker on the device path (an image of another format that does not
    decode, a JPEG header that does not parse) is left out and counted under ``skip``, as on
    the CPU path; under ``raise`` it names the sample."""
    require_nvimagecodec()
    store = seaweed.client()
    upload_to_new_bucket(store, "fixes-broken-png", "d", BrokenPng(12, size=(64, 48), broken=7), maxcount=6)
    for on_error in ("skip", "raise"):
        ds = (RemoteDataset(store, "fixes-broken-png", "d", on_error=on_error)
              .decode(RandomResizedCrop(16), device="cpu", batched=True).to_tuple("__key__", "cls").batched(4))
        if on_error == "raise":
            with pytest.raises(DecodeError, match=r"field 'png' of sample '000007' in \S+: not a decodable image"):
                list(loader(ds, num_workers=0))
            continue
        got = sorted(key for keys, _ in loader(ds, num_workers=0) for key in keys)
        assert got == [f"{i:06d}" for i in range(12) if i != 7] and ds.metrics.skipped == 1
    store.close()


def test_structured_samples_are_refused_by_decode_on_a_device_when_it_is_called(seaweed):
    """Detection samples (``0.jpg``, ``1.boxes.npy``): decoding on a device crops
    classification samples only; the manifest says which these are, so ``decode`` says so
    in one line, not a DataLoader worker at the first sample."""
    store = seaweed.client()
    boxes = [(Image.new("RGB", (32, 24)), {"boxes": np.zeros((1, 4), np.float32)}) for _ in range(4)]
    upload_to_new_bucket(store, "fixes-structured", "d", boxes, maxcount=4)
    with pytest.raises(ConfigError, match=r"^decode\(device='cpu'\) crops classification samples .* the fields"
                                          r" 0\.jpg, 1\.boxes\.npy, 1\.json: decode them") as info:
        RemoteDataset(store, "fixes-structured", "d").decode(RandomResizedCrop(16), device="cpu", batched=True)
    assert "\n" not in str(info.value)
    RemoteDataset(store, "fixes-structured", "d").decode(RandomResizedCrop(16))  # the CPU path crops them
    store.close()


def test_a_batch_whose_every_jpeg_is_left_out_is_not_handed_out(client):
    ds = (
        RemoteDataset(client, "fixes-broken", "d", seed=7, on_error="skip")
        .decode(RandomResizedCrop(48), device="cpu", batched=True)
        .to_tuple("jpg", "__key__")
        .batched(1)
    )
    batches = list(loader(ds, num_workers=0))
    assert sorted(k for _, keys in batches for k in keys) == [f"{i:06d}" for i in range(BROKEN_OF) if i != BROKEN]
    assert all(len(images) == len(keys) == 1 for images, keys in batches)
    assert ds.metrics.skipped == 1


def test_images_that_are_not_jpeg_go_through_the_device_batch_too(client):
    # A batch of PNGs alone must reach the device like a batch of JPEGs (it stayed on the CPU).
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, Place, collate, prepare

    crop = RandomResizedCrop(16, seed=0)
    pngs = []
    for i in range(3):
        out = io.BytesIO()
        SyntheticImages(3, size=(40, 30)).image(i).save(out, "PNG")
        pngs.append(prepare(crop, out.getvalue(), None, str(i), "memory"))
    batch = collate([(p, i) for i, p in enumerate(pngs)])
    assert isinstance(batch[0], EncodedBatch) and len(batch[0]) == 3
    images, kept = DeviceDecoder(crop, Place(torch.device("cpu"))).decode(batch[0])
    assert images.shape == (3, 3, 16, 16) and kept == [0, 1, 2]


def test_where_jpegs_are_decoded_is_said_once_past_the_silenced_stderr(seaweed):
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from remote_loader.pipeline.device import open_codec
        import torch
        open_codec(torch.device("cpu"))
        open_codec(torch.device("cpu"))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("remote_loader decodes JPEGs on cpu: CPU") == 1, done.stderr[-2000:]


def test_a_device_pipeline_without_batched_is_decoded_by_the_loaders_batches_or_one_by_one(client):
    def unbatched():
        crop = RandomResizedCrop(48, reduced=False, fast=False)
        return (
            RemoteDataset(client, "fixes-plain", "d", seed=7)
            .decode(crop, device="cpu", batched=True)
            .to_tuple("jpg", "cls", "__key__")
        )

    cpu = crops(client, "fixes-plain", RandomResizedCrop(48, reduced=False, fast=False))
    batches = list(loader(unbatched(), num_workers=0, batch_size=4))
    assert len(batches) == PLAIN // 4
    for images, labels, keys in batches:
        assert isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.shape == (4, 3, 48, 48)
        assert isinstance(labels, torch.Tensor) and labels.shape == (4,) and len(keys) == 4
        assert all(level_gap(image, cpu[key]) <= 1 for image, key in zip(images, keys, strict=True))
    assert sorted(keys_of(batches)) == sorted(cpu)
    samples = list(loader(unbatched(), num_workers=0))
    assert len(samples) == PLAIN
    for image, label, key in samples:
        assert not isinstance(image, Encoded | EncodedBatch)
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.shape == (3, 48, 48)
        assert isinstance(label, int) and level_gap(image, cpu[key]) <= 1
    assert sorted(key for _, _, key in samples) == sorted(cpu)


def test_decode_batches_state_resumes_a_stateful_dataloader_of_your_own(client):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    whole = keys_of(loader(pipeline(client), num_workers=1))
    assert sorted(whole) == sorted(set(whole)) and len(whole) == PLAIN
    ds = pipeline(client)
    batches = decode_batches(stateful.StatefulDataLoader(ds, batch_size=None, num_workers=1), ds)
    epoch = iter(batches)
    first = list(itertools.islice(epoch, 2))
    state = batches.state_dict()
    epoch.close()
    again = pipeline(client)
    resumed = stateful.StatefulDataLoader(again, batch_size=None, num_workers=1)
    resumed.load_state_dict(state)
    rest = list(decode_batches(resumed, again))
    assert len(first) == 2 and all(images.shape == (16, 3, 48, 48) for images, _, _ in first + rest)
    done = keys_of(first) + keys_of(rest)
    assert sorted(done) == sorted(whole)  # none missing, none twice


class _Boom(Exception):
    pass


def _fails_on(key):
    def fn(sample):
        if sample[2] == key:
            raise _Boom(f"a user map failed on {key}")
        return sample
    return fn


@pytest.mark.parametrize("decoding", ["thread", "dali"])
def test_a_pass_that_fails_before_its_first_batch_is_handed_out_loses_no_batch_on_resume(client, decoding):
    """The in-process decodings draw a batch ahead of the one handed out: a pass that failed in
    its second batch, checkpointed then, had a state from the inner loader that counted the
    first, never handed out (8 of 240 lost on resume)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    if decoding == "dali":
        pytest.importorskip("nvidia.dali")
    whole = keys_of(loader(pipeline(client), num_workers=2, decoding=decoding, stateful=True))
    failing = loader(pipeline(client, fn=_fails_on(whole[16 + 3])), num_workers=2, decoding=decoding, stateful=True)
    with pytest.raises(_Boom):
        for _ in failing:
            pass
    state = failing.state_dict()
    resumed = loader(pipeline(client), num_workers=2, decoding=decoding, stateful=True)
    resumed.load_state_dict(state)
    assert keys_of(resumed) == whole  # the failed pass handed out nothing: the whole epoch comes again


EXIT_SCRIPTS = {
    "dropped": "images, labels = next(iter(decode_batches(DataLoader(ds, batch_size=None), ds)))",
    "held": "batches = iter(decode_batches(DataLoader(ds, batch_size=None), ds))\nimages, labels = next(batches)",
}


EXIT_RUNS = 2  # "held" aborted 12 runs of 12 before the fix: two say it, without loading the suite's other tests


@pytest.mark.parametrize("iterator", sorted(EXIT_SCRIPTS))
def test_processes_that_take_one_batch_exit_cleanly(client, seaweed, iterator):
    # "held": the iterator is alive as the script ends, its thread decoding the batches after
    code = (
        textwrap.dedent(f"""
        from torch.utils.data import DataLoader
        from remote_loader import RandomResizedCrop, RemoteDataset, decode_batches, make_client
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        ds = RemoteDataset(client, "fixes-plain", "d").decode(RandomResizedCrop(32), device="cpu", batched=True)
        ds = ds.to_tuple("jpg", "cls").batched(8)
    """)
        + EXIT_SCRIPTS[iterator]
        + "\nprint(tuple(images.shape))\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(EXIT_RUNS)
    ]
    results = []
    try:
        for run in runs:
            out, err = run.communicate(timeout=300)
            results.append((run.returncode, out, err))
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    assert [(rc, err) for rc, _, err in results] == [(0, "")] * EXIT_RUNS
    assert all(out.split() == ["(8,", "3,", "32,", "32)"] for _, out, _ in results)


def test_an_epoch_left_early_on_persistent_workers_leaves_a_whole_next_epoch_and_no_threads(client):
    before = set(threading.enumerate())  # another test's thread left in user code is not this one's
    batches = loader(pipeline(client), num_workers=1, persistent_workers=True)
    for images, _, keys in batches:
        assert images.shape == (16, 3, 48, 48) and len(keys) == 16
        break
    second = keys_of(batches)
    assert len(second) == PLAIN and sorted(second) == sorted(f"{i:06d}" for i in range(PLAIN))
    left = [t for t in threading.enumerate() if t.name.startswith("remote-loader-stage") and t not in before]
    for thread in left:
        thread.join(timeout=10)
    assert not [t.name for t in left if t.is_alive()]


def test_a_batch_mixing_images_with_something_else_is_refused_not_shortened():
    from remote_loader.pipeline.device import collate
    from remote_loader.pipeline.stages.prepared import Ready

    with pytest.raises(ConfigError, match="mixes images with a NoneType"):
        collate([Ready(torch.zeros(3, 4, 4, dtype=torch.uint8)), None])


class _Recorded:
    """A stand-in for nvImageCodec's module that records each decoder it makes and what
    that decoder decoded (every backend decodes into the GPU's memory)."""

    class BackendKind:
        HW_GPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU, CPU_ONLY = "hw", "gpu", "hybrid", "cpu"

    class ImageBufferKind:
        STRIDED_DEVICE = "device"

    class SampleFormat:
        P_RGB = "rgb"

    def __init__(self, refused: tuple[str, ...] = ()) -> None:
        self.decoders: list[Any] = []
        recorded = self

        class Decoder:
            def __init__(self, device_id: int, max_num_cpu_threads: int, backends: list[str]) -> None:
                if any(kind in refused for kind in backends):
                    raise RuntimeError("Could not create decoder")
                self.backends, self.decoded = backends, 0
                recorded.decoders.append(self)

            def decode(self, stream: Any, **_: Any) -> Any:
                self.decoded += 1
                return types.SimpleNamespace(buffer_kind="device")

        self.Decoder = Decoder
        self.Backend = lambda kind: kind
        self.CodeStream = lambda data: data
        self.DecodeParams = lambda **_: None


def test_the_gpu_decoder_handed_batches_has_decoded_no_probe_first():
    # On an H100 a decoder that had decoded the probe's one JPEG sent its batches to the
    # hybrid backend: 8 cores busy at half the rate (benchmarks/results/node-backends-*.json).
    module = _Recorded()
    codec = NvImageCodec(module, torch.device("cuda", 0), cpu_fallback=False)
    assert codec.decoded_on == HARDWARE
    assert codec._decoder.backends == ["hw", "hybrid"]
    assert codec._decoder.decoded == 0
    assert [d.decoded for d in module.decoders] == [1, 0]  # the hardware decoder's probe, then the one used


def test_a_hardware_decoder_whose_hybrid_partner_cannot_be_made_decodes_alone():
    module = _Recorded(refused=("hybrid",))
    codec = NvImageCodec(module, torch.device("cuda", 0), cpu_fallback=False)
    assert codec.decoded_on == HARDWARE and codec._decoder.backends == ["hw"]
    assert [d.decoded for d in module.decoders] == [1, 0]
