"""A Hugging Face dataset with an ``Image`` feature (every dataset pulled from the Hub as
Parquet holds its images as bytes): each image stored as its own bytes, not encoded again,
and read back as the image ``ds[i]`` gives."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from remote_loader import LocalStore, RemoteDataset, RemoteMapDataset, UploadError, restore, upload_cv_dataset

datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed")


def _encoded(seed: int, fmt: str, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, fmt)
    return buffer.getvalue()


def _hf(blobs: list[bytes], image: object = None):
    features = datasets.Features({"image": image or datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    return datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in blobs],
                                       "label": [i % 2 for i in range(len(blobs))]}, features=features)


def _upload(tmp_path, ds, **options):
    store = LocalStore(str(tmp_path / "store"))
    store.create_bucket("b")
    upload_cv_dataset(ds, client=store, bucket="b", base_folder="hf", workers=0, progress=False, shuffle=False,
                      **options)
    return sorted(RemoteDataset(store, "b", "hf"), key=lambda s: s["__key__"]), store


def test_each_image_is_stored_as_its_own_bytes_and_read_back_as_ds_i_gives_it(tmp_path):
    blobs = [_encoded(0, "JPEG"), _encoded(1, "PNG"), _encoded(2, "PNG", "L"), _encoded(3, "JPEG")]
    ds = _hf(blobs)
    samples, store = _upload(tmp_path, ds)
    assert [sorted(k for k in s if not k.startswith("__")) for s in samples] == [
        ["image.jpg", "label.cls"], ["image.png", "label.cls"], ["image.png", "label.cls"], ["image.jpg", "label.cls"]]
    for i, sample in enumerate(samples):
        assert bytes(sample["image.jpg" if i in (0, 3) else "image.png"]) == blobs[i]  # not a JPEG of its pixels
        item, original = restore(sample), ds[i]
        assert item["image"].mode == original["image"].mode and item["label"] == original["label"]
        assert np.array_equal(np.asarray(item["image"]), np.asarray(original["image"]))
    assert RemoteMapDataset(store, "b", "hf").classes == ["a", "b"]


def test_an_image_column_that_converts_its_images_is_stored_as_ds_i_gives_them(tmp_path):
    """``Image(mode="RGB")`` hands out a grey PNG converted: what is stored is what ``ds[i]``
    gave, not the file."""
    blobs = [_encoded(0, "PNG", "L"), _encoded(1, "PNG", "L")]
    samples, _ = _upload(tmp_path, _hf(blobs, datasets.Image(mode="RGB")), image_format="png")
    for sample, blob in zip(samples, blobs, strict=True):
        assert bytes(sample["image.png"]) != blob and restore(sample)["image"].mode == "RGB"


def test_a_truncated_image_names_its_sample_and_column(tmp_path):
    blobs = [_encoded(0, "JPEG"), _encoded(1, "JPEG")[:-300]]
    with pytest.raises(UploadError, match=r"^sample 1: column 'image''s image is not a whole JPEG: it ends before"):
        _upload(tmp_path, _hf(blobs))
    samples, _ = _upload(tmp_path, _hf(blobs), on_error="skip", overwrite=True)
    assert [s["__key__"] for s in samples] == ["000000"]
