"""torchvision's video classes (UCF101 here, over files in its own layout): their videos'
files stored once each with the clip index, and ``RemoteVideoClips`` handing clip ``i`` over
as the class's ``ds[i]`` does (the class's own ``video_clips.clips`` say which frames)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from remote_loader import (
    ConfigError,
    DecodeError,
    FormatError,
    LocalStore,
    RemoteDataset,
    RemoteMapDataset,
    RemoteVideoClips,
    VideoClip,
    upload_cv_dataset,
)
from remote_loader.format.clip_index import ClipIndex
from remote_loader.testing.synthetic import ucf101_tree, write_avi

av = pytest.importorskip("av", reason="PyAV is not installed (the video extra)")
datasets = pytest.importorskip("torchvision.datasets", reason="torchvision is not installed")
video_utils = pytest.importorskip("torchvision.datasets.video_utils")

pytestmark = pytest.mark.filterwarnings("ignore:There aren't enough frames:UserWarning")  # the class skips a video
FPS, RATE = 10, 8000
LENGTHS = {"ApplyEyeMakeup": [30, 23], "Basketball": [41, 12, 27]}  # frames of each class's videos


@pytest.fixture(scope="module")
def ucf_files(tmp_path_factory):
    """UCF101's layout: ``root/<class>/v_<class>_g<group>_c01.avi`` and the folds' lists."""
    root = tmp_path_factory.mktemp("ucf101")
    videos, annotations = root / "UCF-101", root / "splits"
    annotations.mkdir()
    train, test = [], []
    for c, (name, lengths) in enumerate(sorted(LENGTHS.items())):
        (videos / name).mkdir(parents=True)
        for g, frames in enumerate(lengths):
            file = f"v_{name}_g{g + 1:02d}_c01.avi"
            write_avi(str(videos / name / file), frames, seed=10 * c + g, fps=FPS, audio_rate=RATE if g != 1 else None)
            (test if g == 1 else train).append(f"{name}/{file}")
    (annotations / "trainlist01.txt").write_text("".join(f"{line} 1\n" for line in train))
    (annotations / "testlist01.txt").write_text("".join(f"{line}\n" for line in test))
    return videos, annotations


def _metadata(videos: Path) -> dict:
    """What VideoClips would compute with torchcodec (not loadable beside CPU torch here):
    each video's frame numbers and rate, counted with PyAV, in the class's order."""
    classes, class_to_idx = datasets.folder.find_classes(str(videos))
    paths = [p for p, _ in datasets.folder.make_dataset(str(videos), class_to_idx, ("avi",))]
    counts = []
    for path in paths:
        with av.open(path) as container:
            counts.append(sum(1 for _ in container.decode(video=0)))
    pts = [torch.arange(n) for n in counts]
    return {"video_paths": paths, "video_pts": pts, "video_fps": [float(FPS)] * len(paths)}


def _ucf(files, **options):
    videos, annotations = files
    return datasets.UCF101(str(videos), str(annotations), _precomputed_metadata=_metadata(videos), num_workers=0,
                           **{"frames_per_clip": 8, "step_between_clips": 5, **options})


def _uploaded(tmp_path, ds, prefix="ucf"):
    store = LocalStore(str(tmp_path / "store"))
    store.create_bucket("videos")
    upload_cv_dataset(ds, client=store, bucket="videos", base_folder=prefix, workers=0, progress=False)
    return store


def _decoded(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Every frame of the file (``T x H x W x 3``) and all its sound, decoded whole."""
    with av.open(path) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(path) as container:
        if not container.streams.audio:
            return frames, None
        sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    return frames, sound.astype(np.float32) / 32768


def test_each_video_file_is_stored_once_as_its_own_bytes(tmp_path, ucf_files):
    ucf = _ucf(ucf_files)
    store = _uploaded(tmp_path, ucf)
    videos = RemoteMapDataset(store, "videos", "ucf")
    assert len(videos) == len(ucf.indices) == 3 < len(ucf)  # one sample a video, not a clip
    for v, path in enumerate(ucf.video_clips.video_paths):
        sample = videos.by_source_index(v)
        assert sample["avi"] == Path(path).read_bytes() and int(sample["cls"]) == ucf.samples[ucf.indices[v]][1]
    stored = sum(o.size for o in store.list("videos", "ucf/") if "manifest" not in o.key)
    files = sum(os.path.getsize(p) for p in ucf.video_clips.video_paths)
    assert files <= stored < files + 4096 * len(ucf.video_clips.video_paths)  # headers and an index, no frames


@pytest.mark.parametrize("options", [{}, {"output_format": "TCHW"}, {"frame_rate": 5}, {"frame_rate": 4},
                                     {"frame_rate": 15, "step_between_clips": 3}, {"train": False}])
def test_clip_i_is_the_class_s_clip_i_with_its_sound_and_label(tmp_path, ucf_files, options):
    ucf = _ucf(ucf_files, **options)
    clips = RemoteVideoClips(_uploaded(tmp_path, ucf), "videos", "ucf")
    assert len(clips) == len(ucf) and clips.classes == ucf.classes
    for i in range(len(ucf)):
        v, j = ucf.video_clips.get_clip_location(i)
        numbers = ucf.video_clips.clips[v][j].numpy()
        if options.get("frame_rate"):  # the class's own step through its decoded span
            span = ucf.video_clips.resampling_idxs[v][j]
            offsets = np.arange(numbers[-1] - numbers[0] + 1)[span] if isinstance(span, slice) else \
                (span - span[0]).numpy()
            numbers = numbers[0] + offsets
        frames, sound = _decoded(ucf.video_clips.video_paths[v])
        video, audio, label = clips[i]
        expected = torch.from_numpy(frames[numbers])
        if options.get("output_format") == "TCHW":
            expected = expected.permute(0, 3, 1, 2)
        assert video.dtype == torch.uint8 and torch.equal(video, expected), f"clip {i}"
        assert label == ucf.samples[ucf.indices[v]][1]
        if sound is None:
            assert audio.shape == (1, 0)
        else:
            start, stop = numbers[0] * RATE // FPS, (numbers[-1] + 1) * RATE // FPS
            assert torch.allclose(audio, torch.from_numpy(sound[:, start:stop]), atol=1e-6), f"clip {i}'s sound"


def test_audio_false_and_a_transform_as_the_class_applies_it(tmp_path, ucf_files):
    ucf = _ucf(ucf_files)
    clips = RemoteVideoClips(_uploaded(tmp_path, ucf), "videos", "ucf", audio=False,
                             transform=lambda video: video.float().mean())
    mean, audio, _ = clips[0]
    assert audio.shape == (1, 0) and mean.ndim == 0
    for bad in (True, 1.0, 1.5, "1", None, slice(0, 2), torch.tensor([1])):  # clips[True] gave clip 1
        with pytest.raises(TypeError, match="a clip index is an int, got "):
            clips[bad]
    assert clips[np.int64(0)][0] == clips[torch.tensor(0)][0] == mean


@pytest.mark.parametrize("frames", [0, 5, 16, 17, 40, 101])
@pytest.mark.parametrize("fps,rate", [(10.0, None), (30.0, 15), (29.97, 12), (10.0, 25), (None, None)])
@pytest.mark.parametrize("length,step", [(8, 5), (16, 1), (4, 7)])
def test_the_clip_index_is_torchvision_s(frames, fps, rate, length, step):
    ours = ClipIndex(length, step, rate, "THWC", (frames,), (fps,))
    theirs, _ = video_utils.VideoClips.compute_clips_for_video(torch.arange(frames), length, step, fps, rate)
    assert np.array_equal(ours.clips_of(0), theirs.numpy().reshape(-1, length))
    assert len(ours) == len(theirs)


def test_a_class_with_a_transform_or_resized_decode_is_refused(tmp_path, ucf_files):
    with pytest.raises(ConfigError, match="UCF101 has a transform: upload it with transform=None"):
        _uploaded(tmp_path, _ucf(ucf_files, transform=lambda video: video))
    with pytest.raises(ConfigError, match="video_width=32"):
        _uploaded(tmp_path, _ucf(ucf_files, _video_width=32))


def test_a_dataset_without_a_clip_index_and_a_hostile_one_are_named(tmp_path, ucf_files):
    ucf = _ucf(ucf_files)
    store = _uploaded(tmp_path, ucf)
    store.create_bucket("other")
    upload_cv_dataset([(p, 0) for p in ucf.video_clips.video_paths], client=store, bucket="other",
                      base_folder="files", workers=0, progress=False)
    with pytest.raises(ConfigError, match="not uploaded from a torchvision video class"):
        RemoteVideoClips(store, "other", "files")
    good = ClipIndex.of_params(RemoteMapDataset(store, "videos", "ucf").reader.manifest.params["upload"]["video_clips"],
                               "x").as_params()
    videos = len(good["video_frames"])
    for field, value in (("step", 0), ("video_frames", [3, -1, 2]), ("video_fps", [1.0]), ("output_format", "HWC"),
                         ("frame_rate", "fast"), ("frame_rate", float("inf")), ("video_fps", [float("nan")] * videos),
                         ("video_frames", [10**12] * videos)):  # a record that would not fit in memory
        with pytest.raises(FormatError, match=f"the clip index's {field} is not valid"):
            ClipIndex.of_params({**good, field: value}, "s3://videos/ucf")


def test_a_damaged_video_names_the_clip_and_its_sample(tmp_path, ucf_files):
    ucf = _ucf(ucf_files)
    clips = RemoteVideoClips(_uploaded(tmp_path, ucf), "videos", "ucf")
    clips.videos.transform = lambda sample: {**sample, "avi": sample["avi"][:600]}  # a truncated file
    with pytest.raises(DecodeError, match=r"clip 0 \(frames 0-7 of sample '0+'\)"):
        clips[0]


def test_the_videos_stream_and_their_clips_decode_in_the_pipeline(tmp_path, ucf_files):
    ucf = _ucf(ucf_files)
    store = _uploaded(tmp_path, ucf)
    ds = RemoteDataset(store, "videos", "ucf", seed=1).decode(video=VideoClip(frames=4, layout="THWC")).to_tuple(
        "avi", "cls")
    got = list(ds)
    assert sorted(label for _, label in got) == sorted(ucf.samples[i][1] for i in ucf.indices)
    assert all(video.shape == (4, 48, 64, 3) for video, _ in got)


def test_a_source_spec_of_a_video_class_uploads_its_files(tmp_path, ucf_files, monkeypatch):
    """A cluster's workers build the dataset from its spec: they too store files, not clips."""
    from remote_loader.upload.sources import load_source
    from remote_loader.upload.video_classes import ClassVideos

    module = tmp_path / "ucf_source.py"
    metadata = tmp_path / "metadata.pt"
    torch.save(_metadata(ucf_files[0]), metadata)
    module.write_text("import torch, torchvision\n"
                      "def build():\n"
                      f"    return torchvision.datasets.UCF101({str(ucf_files[0])!r}, {str(ucf_files[1])!r}, 8,"
                      f" 5, num_workers=0, _precomputed_metadata=torch.load({str(metadata)!r}))\n")
    monkeypatch.chdir(tmp_path)
    ds = load_source("ucf_source:build")
    assert isinstance(ds, ClassVideos) and ds[0] == (ds.items[0][0], ds.items[0][1]) and len(ds) == 3


def test_the_synthetic_ucf101_tree_is_ucf101_s_layout(tmp_path):
    videos, splits, metadata = ucf101_tree(str(tmp_path), classes=2, per_class=3, frames=20)
    counted = _metadata(Path(videos))
    assert metadata["video_paths"] == counted["video_paths"]
    assert [len(p) for p in metadata["video_pts"]] == [len(p) for p in counted["video_pts"]] == [20] * 6
    for train, videos_in in ((True, 4), (False, 2)):
        ucf = datasets.UCF101(videos, splits, 8, 4, train=train, num_workers=0, _precomputed_metadata=metadata)
        assert len(ucf.indices) == videos_in and len(ucf) == videos_in * 4


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    videos, splits, _ = ucf101_tree(str(root), classes=2, per_class=3, frames=26)
    return Path(videos), Path(splits)


def _hmdb51(videos: Path, splits: Path):
    """HMDB51 over the same files: its folds' ``<class>_test_split<fold>.txt`` (1 train, 2 test)."""
    notes = splits.parent / "hmdb_splits"
    notes.mkdir(exist_ok=True)
    for folder in sorted(videos.iterdir()):
        files = sorted(p.name for p in folder.iterdir())
        (notes / f"{folder.name}_test_split1.txt").write_text(
            "".join(f"{name} {2 if k == 0 else 1}\n" for k, name in enumerate(files)))
    return datasets.HMDB51(str(videos), str(notes), 6, 7, num_workers=0, _precomputed_metadata=_metadata(videos))


def _kinetics(videos: Path, splits: Path):
    """Kinetics over the same files, in its layout (``root/train/<class>/<video>``)."""
    root = splits.parent / "kinetics"
    if not root.exists():
        root.mkdir()
        (root / "train").symlink_to(videos, target_is_directory=True)
    return datasets.Kinetics(str(root), 6, num_classes="400", split="train", step_between_clips=7, num_workers=0,
                             _precomputed_metadata=_metadata(root / "train"))


@pytest.mark.parametrize("make", [_hmdb51, _kinetics])
def test_hmdb51_and_kinetics_come_back_clip_by_clip(tmp_path, tree, make):
    ds = make(*tree)
    clips = RemoteVideoClips(_uploaded(tmp_path, ds), "videos", "ucf", audio=False)
    labels = dict(ds.samples)
    assert len(clips) == len(ds) > 0
    for i in range(len(ds)):
        v, j = ds.video_clips.get_clip_location(i)
        frames, _ = _decoded(ds.video_clips.video_paths[v])
        video, _, label = clips[i]
        expected = torch.from_numpy(frames[ds.video_clips.clips[v][j].numpy()])
        if ds.video_clips.output_format == "TCHW":  # Kinetics' default
            expected = expected.permute(0, 3, 1, 2)
        assert torch.equal(video, expected), f"clip {i}"
        assert label == labels[ds.video_clips.video_paths[v]]


def test_a_dataloader_s_workers_give_every_clip_once_after_the_parent_read_one(tmp_path, ucf_files):
    from torch.utils.data import DataLoader

    ucf = _ucf(ucf_files)
    clips = RemoteVideoClips(_uploaded(tmp_path, ucf), "videos", "ucf", audio=False)
    first = clips[0]  # the parent's reader in use before the fork
    got = list(DataLoader(clips, batch_size=None, num_workers=2, shuffle=True,
                          generator=torch.Generator().manual_seed(0)))
    assert len(got) == len(ucf)
    expected = sorted((clips[i][0].sum().item(), clips[i][2]) for i in range(len(ucf)))
    assert sorted((video.sum().item(), label) for video, _, label in got) == expected
    assert torch.equal(first[0], clips[0][0])


@pytest.fixture(scope="module")
def long_videos(tmp_path_factory):
    """Two classes of two videos of 600 frames (a minute at 10 a second): one of each to train."""
    root = tmp_path_factory.mktemp("long")
    videos, splits, metadata = ucf101_tree(str(root), classes=2, per_class=2, frames=600, fps=FPS)
    store = LocalStore(str(root / "store"))
    store.create_bucket("videos")
    ucf = datasets.UCF101(videos, splits, 8, 50, num_workers=0, _precomputed_metadata=metadata)
    upload_cv_dataset(ucf, client=store, bucket="videos", base_folder="long", workers=0, progress=False)
    return ucf, store


def test_a_long_video_is_read_in_the_parts_a_clip_needs(long_videos):
    ucf, store = long_videos
    whole = RemoteVideoClips(store, "videos", "long", ranges_over=None)
    parts = RemoteVideoClips(store, "videos", "long", ranges_over=0)
    parts.part = 8 << 10
    for i in (0, 5, len(ucf) - 1):
        v, j = ucf.video_clips.get_clip_location(i)
        size = os.path.getsize(ucf.video_clips.video_paths[v])
        before, before_whole = parts.videos.metrics.bytes, whole.videos.metrics.bytes
        got, expected = parts[i], whole[i]
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]
        assert whole.videos.metrics.bytes - before_whole >= size
        read = parts.videos.metrics.bytes - before
        if i == len(ucf) - 1:  # the index at the file's end, the clip's key frame and the clip: no more
            assert read < size / 4, f"read {read} of {size} bytes for clip {i}"


def test_ranges_over_is_checked(long_videos):
    _, store = long_videos
    for value in (-1, 1.5, True, "1M"):
        with pytest.raises(ConfigError, match="ranges_over must be a number of bytes >= 0 or None"):
            RemoteVideoClips(store, "videos", "long", ranges_over=value)
