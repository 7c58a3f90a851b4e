"""A Hugging Face dataset with a ``Video`` feature: its videos' files stored byte for byte,
never decoded (decoding needs torchcodec, and would store frames), its ClassLabel names kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_loader import LocalStore, RemoteDataset, RemoteMapDataset, UploadError, restore, upload_cv_dataset
from remote_loader.testing.synthetic import SyntheticVideos

datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed")
pytest.importorskip("av", reason="PyAV is not installed (the video extra)")


def _dataset(tmp_path, n=4):
    videos = SyntheticVideos(n, str(tmp_path / "files"))
    paths = [videos[i][0] for i in range(n)]
    features = datasets.Features({"video": datasets.Video(), "label": datasets.ClassLabel(names=["run", "jump"])})
    return datasets.Dataset.from_dict({"video": paths, "label": [i % 2 for i in range(n)]}, features=features), paths


def _store(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    store.create_bucket("b")
    return store


def test_each_video_is_stored_as_its_file_and_restored_as_its_bytes(tmp_path):
    ds, paths = _dataset(tmp_path)
    store = _store(tmp_path)
    upload_cv_dataset(ds, client=store, bucket="b", base_folder="hf", workers=0, progress=False, shuffle=False)
    samples = sorted(RemoteDataset(store, "b", "hf"), key=lambda s: s["__key__"])
    assert [sorted(k for k in s if not k.startswith("__")) for s in samples] == [["label.cls", "video.mp4"]] * 4
    for sample, path in zip(samples, paths, strict=True):
        item = restore(sample)
        assert item["video"] == Path(path).read_bytes() and item["label"] == int(sample["__key__"]) % 2
    assert RemoteMapDataset(store, "b", "hf").classes == ["run", "jump"]


def test_videos_held_as_bytes_are_stored_as_them(tmp_path):
    ds, paths = _dataset(tmp_path, n=2)
    embedded = datasets.Dataset.from_dict(
        {"video": [{"bytes": Path(p).read_bytes(), "path": None} for p in paths], "label": [0, 1]},
        features=ds.features)
    store = _store(tmp_path)
    upload_cv_dataset(embedded, client=store, bucket="b", base_folder="hf", workers=0, progress=False, shuffle=False)
    got = {s["__key__"]: restore(s)["video"] for s in RemoteDataset(store, "b", "hf")}
    assert sorted(got.values()) == sorted(Path(p).read_bytes() for p in paths)


def test_a_video_file_gone_names_its_sample_and_column(tmp_path):
    ds, paths = _dataset(tmp_path, n=3)
    Path(paths[1]).unlink()
    with pytest.raises(UploadError, match=r"sample 1: column 'video''s video .* cannot be read"):
        upload_cv_dataset(ds, client=_store(tmp_path), bucket="b", base_folder="hf", workers=0, progress=False)


def test_videos_inside_another_feature_and_files_that_are_not_videos_are_named(tmp_path):
    from remote_loader import ConfigError

    ds, paths = _dataset(tmp_path, n=2)
    listed = datasets.Dataset.from_dict({"clips": [[p] for p in paths]},
                                        features=datasets.Features({"clips": datasets.Sequence(datasets.Video())}))
    with pytest.raises(ConfigError, match="column 'clips' holds Video features inside another feature"):
        upload_cv_dataset(listed, client=_store(tmp_path), bucket="b", base_folder="l", workers=0, progress=False)
    text = tmp_path / "notes.txt"
    text.write_text("not a video")
    wrong = datasets.Dataset.from_dict({"video": [str(text)], "label": [0]}, features=ds.features)
    with pytest.raises(UploadError, match=r"sample 0: column 'video' holds .*notes.txt.*, which is not a video file"):
        upload_cv_dataset(wrong, client=_store(tmp_path), bucket="b", base_folder="w", workers=0, progress=False)
