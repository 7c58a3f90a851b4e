"""Frames handed over as arrays or tensors (a dataset of decoded clips): their values by
default, an H.264 video with ``frames_as_video``, and back as what they were either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from remote_loader import ConfigError, LocalStore, RemoteDataset, restore, upload_cv_dataset
from remote_loader.testing.synthetic import SyntheticVideos

av = pytest.importorskip("av", reason="PyAV is not installed (the video extra)")


def _frames(count=12, height=47, width=63, seed=0):
    """Smooth frames that drift, as a camera's: ``T x H x W x 3`` uint8 (odd sides on purpose)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(40, 200, 3)
    return np.stack([np.clip(base + 30 * np.sin((x + 3 * t) / 9.0)[..., None] + 20 * np.cos(y / 7.0)[..., None],
                             0, 255).astype(np.uint8) for t in range(count)])


def _round_trip(tmp_path, items, **options):
    store = LocalStore(str(tmp_path / "store"))
    store.create_bucket("b")
    upload_cv_dataset(items, client=store, bucket="b", base_folder="d", workers=0, progress=False, shuffle=False,
                      **options)
    samples = sorted(RemoteDataset(store, "b", "d"), key=lambda s: s["__key__"])
    return samples, [restore(s) for s in samples]


def _items():
    frames = _frames()
    return [
        (frames, 3),  # a pair of frames and a label
        (torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), torch.zeros(1, 0), 1),  # VideoClips' layout
        {"clip": frames[..., :1].copy(), "label": 2},  # one channel
    ]


@pytest.mark.parametrize("mode", [None, "lossless"])
def test_frames_come_back_exactly_as_they_went_in(tmp_path, mode):
    items = _items()
    samples, back = _round_trip(tmp_path, items, **({} if mode is None else {"frames_as_video": mode}))
    stored = [name for s in samples for name in s if not name.startswith("__")]
    assert sum(name.endswith(".mp4") for name in stored) == (3 if mode else 0)
    assert isinstance(back[0][0], np.ndarray) and np.array_equal(back[0][0], items[0][0]) and back[0][1] == 3
    assert type(back[1][0]) is torch.Tensor and torch.equal(back[1][0], items[1][0])
    assert back[2]["clip"].shape == (12, 47, 63, 1) and np.array_equal(back[2]["clip"], items[2]["clip"])


def test_h264_frames_are_a_tenth_of_their_size_and_near_them(tmp_path):
    videos = SyntheticVideos(1, str(tmp_path / "files"), frames=48, size=(320, 240))
    frames = videos.frames_of(0)
    samples, back = _round_trip(tmp_path, [(frames, 0)], frames_as_video="h264")
    (member,) = [v for k, v in samples[0].items() if k.endswith(".mp4")]
    assert len(member) * 10 <= frames.nbytes
    assert back[0][0].shape == frames.shape and back[0][0].dtype == np.uint8
    assert np.abs(back[0][0].astype(int) - frames).mean() < 3


def test_torchvision_s_video_comes_back_a_video(tmp_path):
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    video = tv_tensors.Video(torch.from_numpy(_frames(count=5)).permute(0, 3, 1, 2))
    _, back = _round_trip(tmp_path, [{"video": video, "label": 0}], frames_as_video="lossless")
    assert type(back[0]["video"]) is tv_tensors.Video and torch.equal(back[0]["video"], video)


def test_what_is_not_frames_keeps_its_values(tmp_path):
    items = [{"floats": np.zeros((2, 4, 4, 3), np.float32), "five": np.zeros((2, 4, 4, 5), np.uint8),
              "image": np.zeros((4, 4, 3), np.uint8)}]
    samples, back = _round_trip(tmp_path, items, frames_as_video="h264")
    assert not any(name.endswith(".mp4") for name in samples[0])
    assert all(np.array_equal(back[0][k], v) for k, v in items[0].items())


@pytest.mark.parametrize("mode", ["H264", "lossy", True])
def test_frames_as_video_is_checked(tmp_path, mode):
    store = LocalStore(str(tmp_path))
    store.create_bucket("b")
    with pytest.raises(ConfigError, match="frames_as_video must be one of h264, lossless or None"):
        upload_cv_dataset([(_frames(), 0)], client=store, bucket="b", base_folder="d", workers=0, progress=False,
                          frames_as_video=mode)


def _sample(placeholder, member):
    import json

    return {"__key__": "000000", "__shard__": "shard", "0.json": json.dumps(placeholder).encode(), "0.mp4": member,
            "1.cls": b"0"}


def test_a_hostile_frames_record_is_refused_before_a_frame_is_decoded(tmp_path):
    from remote_loader import DecodeError
    from remote_loader.format.fields import frames_placeholder
    from remote_loader.frames import encode_frames

    big = encode_frames(np.zeros((30, 480, 640, 3), np.uint8), lossless=False)  # 27 MB of frames, a few kB of file
    small = {"layout": "THWC", "channels": 3, "shape": [1, 2, 2, 3], "of": "numpy"}
    with pytest.raises(DecodeError, match="frames of 640x480 where 2x2 were stored"):
        restore(_sample(frames_placeholder(small), big))
    fewer = {**small, "shape": [3, 480, 640, 3]}
    with pytest.raises(DecodeError, match="more than the 3 frames stored"):
        restore(_sample(frames_placeholder(fewer), big))
    for record in ({**small, "channels": 1}, {**small, "layout": "TCHW"}, {**small, "shape": [1, -2, 2, 3]}):
        with pytest.raises(DecodeError, match="frames whose record .* is not valid"):
            restore(_sample(frames_placeholder(record), big))


def test_damaged_frames_are_a_decode_error_never_pyav_s_own(tmp_path):
    from remote_loader import DecodeError
    from remote_loader.format.fields import frames_placeholder
    from remote_loader.frames import encode_frames

    frames = _frames(count=6)
    data = encode_frames(frames, lossless=True)
    record = frames_placeholder({"layout": "THWC", "channels": 3, "shape": list(frames.shape), "of": "numpy"})
    rng = np.random.default_rng(0)
    for trial in range(60):
        damaged = bytearray(data)
        if trial % 3 == 0:
            damaged = damaged[: int(rng.integers(0, len(damaged)))]
        else:
            for at in rng.integers(0, len(damaged), size=1 + trial % 7):
                damaged[at] ^= int(rng.integers(1, 256))
        try:
            restore(_sample(record, bytes(damaged)))
        except DecodeError:
            pass


def test_frames_h264_refuses_are_named_and_noise_keeps_its_values(tmp_path):
    from remote_loader import UploadError

    store = LocalStore(str(tmp_path))
    store.create_bucket("b")
    with pytest.raises(UploadError, match=r"sample 0: image: its frames \(1, 2, 20000, 3\) do not encode as H.264"):
        upload_cv_dataset([(np.zeros((1, 2, 20000, 3), np.uint8), 0)], client=store, bucket="b", base_folder="d",
                          workers=0, progress=False, frames_as_video="h264")
    noise = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    samples, back = _round_trip(tmp_path / "noise", [(noise, 0)], frames_as_video="lossless")
    assert "0.npy" in samples[0] and np.array_equal(back[0][0], noise)
