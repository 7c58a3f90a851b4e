"""Clips decoded by DALI in the training process (``VideoClip(device=...)``), tested on DALI's
CPU backend (VP8, VP9 and MJPEG: its CPU decoder has no H.264), the path a GPU runs with
NVDEC: the same frames, boxes and flips as the CPU path's, every clip once."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from remote_loader import (
    ConfigError,
    DecodeError,
    LocalStore,
    RandomResizedCrop,
    RemoteDataset,
    VideoClip,
    loader,
    upload_cv_dataset,
)
from remote_loader.testing.synthetic import SyntheticVideos
from tests.helpers import vp9_bytes

av = pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (the gpu extra)")

FRAMES = (30, 30, 30, 30, 30, 6, 30)  # video 5 is shorter than a clip


@pytest.fixture(scope="module")
def webms(tmp_path_factory):
    root = tmp_path_factory.mktemp("webm")
    made = SyntheticVideos(len(FRAMES), str(root / "unused"), frames=max(FRAMES), size=(64, 48))
    items = [(vp9_bytes(made.frames_of(k)[:n]), k) for k, n in enumerate(FRAMES)]
    store = LocalStore(str(root / "store"))
    store.create_bucket("v")
    upload_cv_dataset(items, client=store, bucket="v", base_folder="webm", maxcount=3, workers=0, progress=False)
    return store


def _pipeline(store, device=None, **clip):
    video = VideoClip(frames=4, step=2, crop=RandomResizedCrop(32), device=device, **clip)
    return RemoteDataset(store, "v", "webm", seed=7).decode(video=video).to_tuple("__key__", "webm", "cls")


def test_dali_s_clips_are_the_cpu_path_s_frames_boxes_and_flips(webms):
    on_cpu = {key: clip for key, clip, _ in _pipeline(webms)}
    got = loader(_pipeline(webms, device="cpu").batched(3), num_workers=0)
    assert got.decoded_on == "CPU (DALI)"
    seen = {}
    for keys, clips, labels in got:
        assert clips.dtype == torch.uint8 and clips.shape[1:] == (4, 3, 32, 32)
        assert labels.tolist() == [int(key) for key in keys]  # each clip beside its own label
        seen.update(zip(keys, clips, strict=True))
    assert seen.keys() == on_cpu.keys()
    for key, clip in seen.items():
        difference = (clip.float() - on_cpu[key].float()).abs()
        assert difference.mean() < 3 and difference.max() < 48, f"{key}: {difference.mean():.2f}"


def test_every_clip_once_with_workers_and_the_layout_asked_for(webms):
    ds = _pipeline(webms, device="cpu", layout="THWC").batched(2)
    keys, shapes = Counter(), set()
    for batch_keys, clips, _ in loader(ds, num_workers=2):
        keys.update(batch_keys)
        shapes.add(tuple(clips.shape[1:]))
    assert keys == Counter(f"{k:06d}" for k in range(len(FRAMES))) and shapes == {(4, 32, 32, 3)}


def test_an_h264_video_is_named_on_dali_s_cpu_and_skip_leaves_it_out(tmp_path, webms):
    files = SyntheticVideos(2, str(tmp_path / "files"))
    store = LocalStore(str(tmp_path / "store"))
    store.create_bucket("v")
    upload_cv_dataset(files, client=store, bucket="v", base_folder="h264", workers=0, progress=False)
    clip = VideoClip(frames=2, crop=RandomResizedCrop(16), device="cpu")
    ds = RemoteDataset(store, "v", "h264").decode(video=clip).to_tuple("mp4", "cls").batched(2)
    with pytest.raises(DecodeError, match="is not a video DALI decodes on the CPU"):
        list(loader(ds, num_workers=0))
    skipping = RemoteDataset(store, "v", "h264", on_error="skip").decode(video=clip).to_tuple("mp4", "cls").batched(2)
    assert list(loader(skipping, num_workers=0)) == []
    assert skipping.metrics.skipped == 2


def test_a_device_clip_needs_a_crop_and_dali(webms):
    with pytest.raises(ConfigError, match="VideoClip\\(device=...\\) needs a crop"):
        VideoClip(frames=4, device="cpu")
    with pytest.raises(ConfigError, match="clips decoded on a device are decoded by DALI"):
        loader(_pipeline(webms, device="cpu").batched(2), num_workers=0, decoding="process")
