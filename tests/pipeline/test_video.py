"""Videos: their files' own bytes in the shards, and clips decoded from them in the workers
(``decode(video=VideoClip(...))``)."""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import (
    ConfigError,
    DecodeError,
    LocalStore,
    RandomResizedCrop,
    RemoteDataset,
    VideoClip,
    restore,
    upload_cv_dataset,
)
from remote_loader.format.video import video_extension
from remote_loader.testing.synthetic import SyntheticVideos
from tests.helpers import vp9_bytes

av = pytest.importorskip("av", reason="PyAV is not installed (the video extra)")

FRAMES = 40


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Six lossless videos of 40 frames (a key frame every 8) uploaded in shards of 3."""
    root = tmp_path_factory.mktemp("videos")
    ds = SyntheticVideos(6, str(root / "files"), frames=FRAMES, gop=8, lossless=True)
    store = LocalStore(str(root / "store"))
    store.create_bucket("videos")
    upload_cv_dataset(ds, client=store, bucket="videos", base_folder="v", maxcount=3, workers=0, progress=False)
    return ds, store


def _index(sample):
    return int(sample["__key__"])


def _start(clip, source, step):
    """Where in ``source`` (T x H x W x 3) the TCHW ``clip`` starts, every ``step`` frames."""
    frames = clip.permute(0, 2, 3, 1).numpy()
    starts = [s for s in range(len(source)) if np.array_equal(source[s : s + step * len(frames) : step], frames)]
    assert len(starts) == 1, "the clip is not a run of the video's own frames"
    return starts[0]


def test_a_video_file_is_stored_as_its_own_bytes_and_restored_as_them(videos):
    ds, store = videos
    for sample in RemoteDataset(store, "videos", "v", seed=0):
        i = _index(sample)
        with open(ds.path(i), "rb") as file:
            assert sample["mp4"] == file.read()  # byte for byte, not decoded frames
        assert restore(sample) == (sample["mp4"], ds.label(i))


def test_each_container_is_named_by_its_first_bytes(tmp_path):
    made = {}
    for ext, fmt, codec in (("mp4", "mp4", "libx264"), ("mov", "mov", "libx264"), ("mkv", "matroska", "libx264"),
                            ("webm", "webm", "libvpx-vp9"), ("avi", "avi", "mpeg4")):
        out = io.BytesIO()
        with av.open(out, mode="w", format=fmt) as container:
            stream = container.add_stream(codec, rate=8)
            stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
            for t in range(4):
                frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), t * 40, np.uint8), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        made[ext] = out.getvalue()
        assert video_extension(made[ext]) == ext
    assert video_extension(b"\xff\xd8\xff\xe0") is None and video_extension(b"") is None
    store = LocalStore(str(tmp_path))
    store.create_bucket("b")
    items = [(data, k) for k, data in enumerate(made.values())]
    upload_cv_dataset(items, client=store, bucket="b", base_folder="c", workers=0, progress=False)
    back = {_index(s): s for s in RemoteDataset(store, "b", "c", seed=0)}
    for k, (ext, data) in enumerate(made.items()):
        assert back[k][ext] == data
        clip = VideoClip(frames=2)("f", data, np.random.default_rng(0))  # each decodes
        assert clip.shape == (2, 3, 32, 32)


def test_a_clip_is_a_run_of_the_video_s_frames_drawn_from_seed_epoch_and_key(videos):
    ds, store = videos
    pipeline = RemoteDataset(store, "videos", "v", seed=3).decode(video=VideoClip(frames=8, step=2))
    starts = {}
    for epoch in (0, 1):
        pipeline.set_epoch(epoch)
        alone = {_index(s): s["mp4"] for s in pipeline}
        workers = {_index(s): s["mp4"] for s in DataLoader(pipeline, batch_size=None, num_workers=2)}
        assert sorted(alone) == list(range(6))
        for i, clip in alone.items():
            assert clip.shape == (8, 3, 48, 64) and clip.dtype == torch.uint8
            assert torch.equal(clip, workers[i])  # the same clip whatever the workers
            starts[epoch, i] = _start(clip, ds.frames_of(i), 2)
            assert 0 <= starts[epoch, i] <= FRAMES - 15
    assert any(starts[0, i] != starts[1, i] for i in range(6))  # another clip the next epoch


def test_a_seek_gives_the_frames_a_whole_decode_gives(tmp_path):
    ds = SyntheticVideos(1, str(tmp_path), frames=60, gop=10, size=(96, 64))  # lossy H.264, 4:2:0
    with av.open(ds.path(0)) as container:
        every = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    data = Path(ds.path(0)).read_bytes()
    for seed in range(6):
        clip = VideoClip(frames=5, step=3, layout="THWC")("mp4", data, np.random.default_rng(seed)).numpy()
        start = next(s for s in range(60) if np.array_equal(every[s], clip[0]))
        assert np.array_equal(np.stack(every[start : start + 15 : 3]), clip)


def test_a_video_shorter_than_the_clip_repeats_its_last_frame(videos):
    ds, _ = videos
    data = Path(ds.path(0)).read_bytes()
    clip = VideoClip(frames=FRAMES + 5)("mp4", data, np.random.default_rng(0))
    source = torch.from_numpy(ds.frames_of(0)).permute(0, 3, 1, 2)
    assert torch.equal(clip[:FRAMES], source)
    assert all(torch.equal(frame, source[-1]) for frame in clip[FRAMES:])


def test_one_box_crops_the_whole_clip(videos):
    ds, _ = videos
    data = Path(ds.path(1)).read_bytes()
    whole = RandomResizedCrop(24, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), flip=False)
    clip = VideoClip(frames=4, crop=whole)("mp4", data, np.random.default_rng(5))
    frames = VideoClip(frames=4)("mp4", data, np.random.default_rng(5))  # the same start: drawn first
    expected = torch.nn.functional.interpolate(frames.float(), size=(24, 24), mode="bilinear", antialias=True,
                                               align_corners=False).round().clamp(0, 255).to(torch.uint8)
    assert torch.equal(clip, expected)
    normalised = RandomResizedCrop(24, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), flip=False, mean=(0.5, 0.5, 0.5),
                                   std=(0.25, 0.25, 0.25))
    floats = VideoClip(frames=4, crop=normalised, layout="THWC")("mp4", data, np.random.default_rng(5))
    assert floats.dtype == torch.float32 and floats.shape == (4, 24, 24, 3)


def test_a_damaged_video_names_its_sample_and_skip_leaves_it_out(tmp_path, videos):
    ds, _ = videos
    good = Path(ds.path(0)).read_bytes()
    damaged = good[:40] + bytes(len(good) - 40)  # its container's header, then zeros
    store = LocalStore(str(tmp_path))
    store.create_bucket("b")
    upload_cv_dataset([(good, 0), (damaged, 1), (good, 2)], client=store, bucket="b", base_folder="d", workers=0,
                      progress=False)
    with pytest.raises(DecodeError, match=r"sample '000001'.*not a decodable video"):
        list(RemoteDataset(store, "b", "d", seed=0).decode(video=VideoClip(4)))
    skipping = RemoteDataset(store, "b", "d", seed=0, on_error="skip").decode(video=VideoClip(4))
    assert sorted(s["cls"] for s in skipping) == [0, 2] and skipping.metrics.skipped == 1


def test_a_resumed_epoch_gives_the_rest_of_the_same_clips_once(videos):
    _, store = videos

    def pipeline():
        return RemoteDataset(store, "videos", "v", seed=4).decode(video=VideoClip(frames=6, step=3))

    first = pipeline()
    first.set_epoch(2)
    full = list(first)
    resumed = pipeline()
    resumed.load_state_dict(first.state_dict(consumed=2))
    rest = list(resumed)
    assert Counter(_index(s) for s in full[:2] + rest) == Counter(range(6))
    by_key = {_index(s): s["mp4"] for s in full}
    assert all(torch.equal(s["mp4"], by_key[_index(s)]) for s in rest)  # the clips of the same epoch


@pytest.mark.parametrize("arguments, message", [
    ({"frames": 0}, "frames must be a positive integer"),
    ({"step": 1.5}, "step must be a positive integer"),
    ({"crop": 112}, "crop must be a RandomResizedCrop"),
    ({"layout": "CTHW"}, "layout must be one of TCHW, THWC"),
])
def test_a_clip_s_arguments_are_checked(arguments, message):
    with pytest.raises(ConfigError, match=message):
        VideoClip(**arguments)


def test_decode_takes_a_video_clip_only(videos):
    _, store = videos
    with pytest.raises(ConfigError, match="decode's video must be a VideoClip, got int"):
        RemoteDataset(store, "videos", "v").decode(video=16)


def test_the_files_a_synthetic_dataset_writes_are_there_once(tmp_path):
    ds = SyntheticVideos(2, str(tmp_path))
    first = ds.path(1)
    assert ds.path(1) == first and sorted(os.listdir(tmp_path)) == ["video_00001.mp4"]


def test_info_lists_video_fields_as_video():
    from remote_loader.format.fields import describe

    assert [describe(f) for f in ("mp4", "webm", "0.mkv", "clip.avi")] == ["video", "video", "video", "video"]


def test_a_clip_late_in_a_video_is_decoded_from_the_key_frame_before_it(tmp_path):
    from remote_loader.frames import frames_at

    ds = SyntheticVideos(1, str(tmp_path), frames=60, gop=10, lossless=True)

    class Counting:  # the container, counting the frames it decodes
        def __init__(self, container):
            self.container, self.decoded = container, 0

        def seek(self, *args, **kwargs):
            return self.container.seek(*args, **kwargs)

        def decode(self, stream):
            for frame in self.container.decode(stream):
                self.decoded += 1
                yield frame

    with av.open(ds.path(0)) as container:
        counting = Counting(container)
        got = frames_at(counting, container.streams.video[0], 24.0, [43, 45])
    assert np.array_equal(np.stack(got), ds.frames_of(0)[[43, 45]])
    assert counting.decoded <= 6  # from frame 40, the key frame before 43: not the 46 frames from the start


def test_frames_over_pillow_s_pixel_bound_and_a_file_without_video_are_decode_errors(videos, monkeypatch):
    ds, _ = videos
    data = Path(ds.path(0)).read_bytes()
    monkeypatch.setattr("PIL.Image.MAX_IMAGE_PIXELS", 64 * 48 - 1)
    with pytest.raises(DecodeError, match=r"frames of 64x48 pixels, more than Pillow's bound of 3071"):
        VideoClip(4)("mp4", data, np.random.default_rng(0))
    monkeypatch.undo()
    sound = io.BytesIO()
    with av.open(sound, mode="w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    assert video_extension(sound.getvalue()) == "mkv"
    with pytest.raises(DecodeError, match="without a video stream"):
        VideoClip(4)("mkv", sound.getvalue(), np.random.default_rng(0))


def test_a_header_that_claims_too_many_frames_gives_the_clip_from_the_start(videos, monkeypatch):
    import remote_loader.pipeline.stages.video as video

    ds, _ = videos
    data = Path(ds.path(2)).read_bytes()
    monkeypatch.setattr(video, "frame_count", lambda container, stream, rate: 10 * FRAMES)  # it has 40
    seed = next(s for s in range(100) if np.random.default_rng(s).integers(0, 10 * FRAMES - 7) > FRAMES)
    clip = VideoClip(frames=4, step=2)("mp4", data, np.random.default_rng(seed))
    assert torch.equal(clip, torch.from_numpy(ds.frames_of(2)[0:8:2]).permute(0, 3, 1, 2))


@pytest.fixture(scope="module")
def sounding(tmp_path_factory):
    """Three AVIs with sound (8,000 samples a second, 10 frames a second) and one silent,
    uploaded as (path, label) pairs, and as a (path, bytes, label) tuple."""
    from remote_loader.testing.synthetic import write_avi

    root = tmp_path_factory.mktemp("sounding")
    paths = []
    for k in range(4):
        paths.append(str(root / f"v{k}.avi"))
        write_avi(paths[-1], 30, seed=k, fps=10, audio_rate=None if k == 3 else 8000)
    store = LocalStore(str(root / "store"))
    store.create_bucket("v")
    upload_cv_dataset([(p, k) for k, p in enumerate(paths)], client=store, bucket="v", base_folder="pairs",
                      workers=0, progress=False, shuffle=False)
    upload_cv_dataset([(paths[0], Path(paths[3]).read_bytes(), 0)], client=store, bucket="v", base_folder="tuples",
                      workers=0, progress=False)
    return paths, store


def _whole(path):
    with av.open(path) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(path) as container:
        sound = [f.to_ndarray() for f in container.decode(audio=0)] if container.streams.audio else []
    return frames, (np.concatenate(sound, axis=1).astype(np.float32) / 32768 if sound else None)


def test_a_clip_s_sound_is_the_sound_played_through_it(sounding):
    paths, store = sounding
    clip = VideoClip(frames=4, step=2, layout="THWC", audio=8000)
    got = list(RemoteDataset(store, "v", "pairs", seed=3).decode(video=clip))
    assert len(got) == 4
    for sample in got:
        frames, sound = _whole(paths[int(sample["cls"])])
        start = next(s for s in range(len(frames)) if np.array_equal(frames[s : s + 8 : 2], sample["avi"].numpy()))
        assert sample["audio"].shape == (1, 7 * 800) and sample["audio"].dtype == torch.float32
        expected = np.zeros((1, 7 * 800), np.float32) if sound is None else sound[:, start * 800 : (start + 7) * 800]
        assert np.allclose(sample["audio"].numpy(), expected, atol=1e-6), f"video {sample['cls']}"


def test_sound_at_another_rate_batches_and_each_video_field_has_its_own(sounding):
    _, store = sounding
    clip = VideoClip(frames=4, step=2, audio=16000)
    (videos, sounds, labels), = list(RemoteDataset(store, "v", "pairs", seed=3).decode(video=clip)
                                     .to_tuple("avi", "audio", "cls").batched(4))
    assert videos.shape == (4, 4, 3, 48, 64) and sounds.shape == (4, 1, 7 * 1600)
    loud = {int(label): float(sound.abs().mean()) for sound, label in zip(sounds, labels, strict=True)}
    assert loud[3] == 0 and all(0.05 < loud[k] < 0.3 for k in range(3))  # a tone of amplitude 8000/32768
    (sample,) = list(RemoteDataset(store, "v", "tuples").decode(video=clip))
    assert {"0.avi", "0.audio", "1.avi", "1.audio"} <= set(sample)
    assert float(sample["0.audio"].abs().mean()) > 0.05 and float(sample["1.audio"].abs().max()) == 0


@pytest.mark.parametrize("audio", [0, 999, 16000.0, True, "16k"])
def test_a_clip_s_audio_rate_is_checked(audio):
    with pytest.raises(ConfigError, match="VideoClip's audio must be a sample rate"):
        VideoClip(audio=audio)


def _with_sound(path, codec, container_format, sound_starts=0.0, rate=16000, channels=1):
    """Two seconds of video (10 frames a second) and a rising ramp of sound from
    ``sound_starts`` seconds to the end, in ``codec``; returns the sound as made (all
    channels the same), one sample for each 1/rate s from the file's start."""
    total = int(2 * rate)
    ramp = np.zeros(total, np.float32)
    first = int(sound_starts * rate)
    ramp[first:] = np.linspace(-0.5, 0.5, total - first, dtype=np.float32)
    with av.open(str(path), "w", format=container_format) as container:
        video = container.add_stream("libx264", rate=10)
        video.width, video.height, video.pix_fmt = 32, 24, "yuv420p"
        sound = container.add_stream(codec, rate=rate, layout="mono" if channels == 1 else "stereo")
        for t in range(20):
            for packet in video.encode(av.VideoFrame.from_ndarray(np.full((24, 32, 3), 9 * t, np.uint8), "rgb24")):
                container.mux(packet)
            lo, hi = max(first, t * rate // 10), (t + 1) * rate // 10
            if hi > lo:
                chunk = np.repeat(ramp[None, lo:hi], channels, axis=0)
                if not sound.format.is_planar:  # 16-bit samples, the channels interleaved
                    chunk = np.round(chunk * 32767).astype(np.int16).T.reshape(1, -1).copy()
                frame = av.AudioFrame.from_ndarray(chunk, format=sound.format.name, layout=sound.layout.name)
                frame.sample_rate, frame.pts = rate, lo
                for packet in sound.encode(frame):
                    container.mux(packet)
        for stream in (video, sound):
            for packet in stream.encode():
                container.mux(packet)
    return ramp


@pytest.mark.parametrize("codec,container_format,sound_starts,channels,tolerance", [
    ("pcm_s16le", "mov", 0.5, 1, 1e-3),  # sound that starts after the video: timed from the video's start
    ("aac", "mp4", 0.0, 1, 0.02),  # AAC after a seek: its first frame is not yet the sound
    ("pcm_s16le", "mov", 0.0, 2, 1e-3),  # stereo to mono: the channels' mean, at the same level
])
def test_a_clip_s_sound_is_timed_from_the_video_s_start(tmp_path, codec, container_format, sound_starts, channels,
                                                       tolerance):
    path = tmp_path / f"v.{container_format}"
    ramp = _with_sound(path, codec, container_format, sound_starts, channels=channels)
    data = path.read_bytes()
    with av.open(str(path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    clip = VideoClip(frames=3, step=2, audio=16000)
    checked = 0
    for seed in range(12):
        out = clip.fields("mp4", data, np.random.default_rng(seed))
        start = next(s for s in range(len(frames)) if np.array_equal(frames[s : s + 6 : 2], out["mp4"].permute(
            0, 2, 3, 1).numpy()))
        expected = ramp[start * 1600 : (start + 5) * 1600]
        got = out["audio"][0].numpy()
        body = slice(200, len(expected) - 200) if codec == "aac" else slice(None)  # AAC's own filter edges
        assert np.abs(got[body] - expected[body]).max() < tolerance, f"a clip from frame {start}"
        checked += start > 0
    assert checked >= 6


def test_restore_leaves_a_clip_s_sound_out_of_the_item(sounding):
    _, store = sounding
    clip = VideoClip(frames=2, layout="THWC", audio=8000)
    (sample,) = [s for s in RemoteDataset(store, "v", "tuples").decode(video=clip)]
    first, second, label = restore(sample)
    assert first.shape == second.shape == (2, 48, 64, 3) and label == 0 and "0.audio" in sample


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_stateful_loader_resumed_gives_the_rest_of_the_clips_once(videos, tmp_path, device):
    pytest.importorskip("torchdata")
    if device is not None:
        pytest.importorskip("nvidia.dali")
    from remote_loader import loader

    ds, store = videos
    if device is not None:  # DALI's CPU decoder takes VP9, not H.264: the same videos as VP9
        store = LocalStore(str(tmp_path / "vp9"))
        store.create_bucket("videos")
        upload_cv_dataset([(vp9_bytes(ds.frames_of(k)), k) for k in range(len(ds))], client=store, bucket="videos",
                          base_folder="v", maxcount=3, workers=0, progress=False)

    def pipeline():
        clip = VideoClip(frames=4, step=2, crop=RandomResizedCrop(16), device=device)
        return (RemoteDataset(store, "videos", "v", seed=4).decode(video=clip)
                .to_tuple("__key__", "webm" if device else "mp4").batched(2))

    whole = {key: clip for keys, clips in loader(pipeline(), num_workers=2, stateful=True)
             for key, clip in zip(keys, clips, strict=True)}
    first = loader(pipeline(), num_workers=2, stateful=True)
    stream = iter(first)
    keys, clips = next(stream)
    state = first.state_dict()
    del stream
    resumed = loader(pipeline(), num_workers=2, stateful=True)
    resumed.load_state_dict(state)
    rest = [(key, clip) for keys_, clips_ in resumed for key, clip in zip(keys_, clips_, strict=True)]
    assert Counter(list(keys) + [key for key, _ in rest]) == Counter(list(whole))  # each clip once
    assert all(torch.equal(clip, whole[key]) for key, clip in rest)  # the same clips as the whole pass
