"""Samples of any structure torchvision's image datasets return (detection, segmentation,
attributes, captions, several targets, flow and stereo, depth, Hugging Face dicts) are
uploaded to a real S3 server and come back equal, through ``RemoteDataset`` and
``RemoteMapDataset`` alike, with ``restore``. Each dataset below returns ``ds[i]`` shaped as
the torchvision class it is named after documents it; images are stored as PNG so that every
value comes back exactly."""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from remote_loader import RemoteDataset, RemoteMapDataset, UploadError, restore
from remote_loader.format import INDEX_MEMBER, ShardIndex, ShardView, ShardWriter
from remote_loader.format import fields as rule
from remote_loader.storage import LocalStore
from remote_loader.testing.synthetic import SyntheticImages
from remote_loader.upload.encode import EncodeOptions, encode_item
from tests.helpers import upload, upload_to_new_bucket
from tests.upload.structures import H, N, Segmentation, Structured, W, _image, _palette_mask, _rng, voc_segmentation


def coco_detection(i: int) -> Any:  # CocoDetection: (PIL, list of the image's annotation dicts)
    return _image(i), [{"segmentation": [[1.5, 2.0, 10.0, 2.0, 10.0, 8.25]], "area": 30.5, "iscrowd": 0,
                        "image_id": i, "bbox": [1.5, 2.0, 8.5, 6.25], "category_id": 3 + k, "id": 100 * i + k}
                       for k in range(i % 3)]


def kitti(i: int) -> Any:  # Kitti: (PIL, list of dicts with type, truncated, ..., bbox, dimensions, location)
    return _image(i), [{"type": "Car", "truncated": 0.0, "occluded": 1, "alpha": -1.57,
                        "bbox": [1.0, 2.0, 20.0, 14.5], "dimensions": [1.5, 1.6, 3.9],
                        "location": [-3.2, 1.7, 12.0], "rotation_y": -1.55}]


def cityscapes_semantic(i: int) -> Any:  # Cityscapes target_type="semantic": (PIL, PIL mask in mode L)
    return _image(i), Image.fromarray(_rng(i).integers(0, 34, (H, W), dtype=np.uint8), mode="L")


def celeba(i: int) -> Any:  # CelebA target_type="attr": (PIL, tensor of 40 attributes)
    return _image(i), torch.from_numpy(_rng(i).integers(0, 2, 40))


def coco_captions(i: int) -> Any:  # CocoCaptions, Flickr30k: (PIL, list of captions)
    return _image(i), [f"a cat on a mat, number {i}", "ünïcode ✓", ""]


def voc_detection(i: int) -> Any:  # VOCDetection: (PIL, the XML as nested dicts of strs)
    return _image(i), {"annotation": {"folder": "VOC2012", "filename": f"{i}.jpg",
                                      "size": {"width": str(W), "height": str(H), "depth": "3"},
                                      "object": [{"name": "dog", "pose": "Left", "truncated": "0",
                                                  "bndbox": {"xmin": "1", "ymin": "2", "xmax": "9", "ymax": "7"}}]}}


def oxford_pet(i: int) -> Any:  # OxfordIIITPet target_types=("category", "segmentation"): (PIL, (int, PIL L))
    return _image(i), (i % 37, Image.fromarray(_rng(i).integers(1, 4, (H, W), dtype=np.uint8), mode="L"))


def widerface(i: int) -> Any:  # WIDERFace: (PIL, dict of tensors, one row per face)
    faces = 1 + i % 3
    return _image(i), {"bbox": torch.from_numpy(_rng(i).integers(0, 10, (faces, 4))),
                       "blur": torch.zeros(faces, dtype=torch.int64), "invalid": torch.ones(faces, dtype=torch.int64)}


def flying_chairs(i: int) -> Any:  # FlyingChairs, Sintel: (img1, img2, flow float32 2xHxW, valid or None)
    valid = _rng(i).random((H, W)) > 0.3 if i % 2 else None
    return _image(i), _image(i + 1), _rng(i).standard_normal((2, H, W)).astype(np.float32), valid


def stereo(i: int) -> Any:  # Kitti2015Stereo: ((left, right), disparity 1xHxW float32, valid mask HxW bool)
    return (_image(i), _image(i + 50)), _rng(i).random((1, H, W)).astype(np.float32), _rng(i).random((H, W)) > 0.5


def depth_png(i: int) -> Any:  # a depth dataset's 16-bit PNG depth map
    return _image(i), Image.fromarray(_rng(i).integers(0, 65536, (H, W)).astype(np.uint16))


def depth_float(i: int) -> Any:  # float depth and a float regression target
    return _image(i), Image.fromarray(_rng(i).random((H, W)).astype(np.float32), mode="F"), 0.25 * i


def hugging_face(i: int) -> Any:  # a datasets split: a dict of named fields
    return {"image": _image(i), "label": i % 10, "objects": {"bbox": [[1.0, 2.0, 3.0, 4.0]], "category": [i]},
            "caption": f"sample {i}", "score": None}


STRUCTURES = {f.__name__: f for f in (coco_detection, kitti, voc_segmentation, cityscapes_semantic, celeba,
                                       coco_captions, voc_detection, oxford_pet, widerface, flying_chairs, stereo,
                                       depth_png, depth_float, hugging_face)}


def lists(value: Any) -> Any:
    """``value`` as it comes back: tuples inside a sample's values are lists."""
    if isinstance(value, (list, tuple)):
        return [lists(v) for v in value]
    if isinstance(value, dict):
        return {k: lists(v) for k, v in value.items()}
    return value


def same(expected: Any, got: Any, where: str = "sample") -> None:
    """Equal values of equal types: images in mode, palette and pixels, arrays and tensors in
    dtype, shape and values."""
    if isinstance(expected, Image.Image):
        assert isinstance(got, Image.Image), where
        assert (got.mode, got.size, got.getpalette()) == (expected.mode, expected.size, expected.getpalette()), where
        assert got.info.get("transparency") == expected.info.get("transparency"), where
        assert np.array_equal(np.asarray(got), np.asarray(expected)), where
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype, where
        assert np.array_equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for k in expected:
            same(expected[k], got[k], f"{where}[{k!r}]")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), where
        for k, (e, g) in enumerate(zip(expected, got, strict=True)):
            same(e, g, f"{where}[{k}]")
    else:
        assert type(got) is type(expected) and got == expected, where


def expected_item(item: Any) -> Any:
    """``ds[i]`` as ``restore`` gives it back: the top-level tuple stays, nested tuples are lists."""
    if isinstance(item, dict):
        return {k: lists(v) for k, v in item.items()}
    return tuple(lists(v) for v in item)


def same_item(expected: Any, got: Any) -> None:
    assert type(got) is type(expected_item(expected))
    if isinstance(expected, dict):
        same(expected_item(expected), got)
    else:
        same(list(expected_item(expected)), list(got))


@pytest.fixture(scope="module")
def uploaded(seaweed):
    client = seaweed.client()
    client.create_bucket("structured")
    for name, make in STRUCTURES.items():
        upload(client, "structured", name, Structured(make), maxcount=4, image_format="png")
    return client


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_each_structure_streams_back_equal(uploaded, name):
    ds = Structured(STRUCTURES[name])
    got = {s[0]: s[1] for s in RemoteDataset(uploaded, "structured", name, seed=1).map(
        lambda sample: (int(sample["__key__"]), restore(sample)))}
    assert sorted(got) == list(range(N))
    for i in range(N):
        same_item(ds[i], got[i])


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_each_structure_is_read_back_equal_by_random_access(uploaded, name):
    ds = Structured(STRUCTURES[name])
    reader = RemoteMapDataset(uploaded, "structured", name, transform=lambda s: (int(s["__key__"]), restore(s)))
    got = dict(reader[j] for j in range(len(reader)))
    for i in range(N):
        same_item(ds[i], got[i])


def test_decode_keeps_masks_in_their_mode_and_names_every_field(uploaded):
    ds = RemoteDataset(uploaded, "structured", "voc_segmentation", seed=0).decode("pil").to_tuple("0.png", "1.png")
    for image, mask in ds:
        assert image.mode == "RGB" and mask.mode == "P" and mask.getpalette() == _palette_mask(0).getpalette()
    arrays = RemoteDataset(uploaded, "structured", "depth_png", seed=0).decode("torchrgb").to_tuple("1.png")
    for (depth,) in arrays:
        assert depth.dtype == torch.int32 and depth.shape == (H, W) and int(depth.max()) > 255


def test_a_restored_sample_after_decode_keeps_what_decode_made(uploaded):
    ds = RemoteDataset(uploaded, "structured", "flying_chairs", seed=0).decode("torchrgb").map(restore)
    for first, second, flow, valid in ds:
        assert first.shape == second.shape == (3, H, W) and flow.dtype == np.float32 and flow.shape == (2, H, W)
        assert valid is None or valid.dtype == np.bool_


def test_field_names_follow_the_documented_rule():
    fields = encode_item(widerface(1), EncodeOptions(image_format="png"), 1)
    assert sorted(fields) == ["0.png", "1.bbox.npy", "1.blur.npy", "1.invalid.npy", "1.json"]
    assert fields["1.json"] == b'{"bbox": "torch", "blur": "torch", "invalid": "torch"}'
    assert np.load(io.BytesIO(fields["1.bbox.npy"])).shape == (2, 4)
    assert sorted(encode_item(hugging_face(0), EncodeOptions(), 0)) == [
        "caption.txt", "image.jpg", "label.cls", "objects.json", "score.json"]
    assert rule.kind(["0.jpg", "1.json", "1.0.npy"]) == "tuple" and rule.kind(["image.jpg", "label.cls"]) == "dict"


class Classic:
    """Classification pairs of every target kind a pair had before structured samples."""

    def __init__(self) -> None:
        self.images = SyntheticImages(12, size=(20, 12))

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> Any:
        image, label = self.images[index]
        targets = (label, f"class {label}", {"label": label, "score": 0.5, "name": "ü"}, None,
                   np.int64(label), np.int32(label))  # (a tensor is stored as one: test_vision_classes.py)
        return image if index % 3 else Image.open(io.BytesIO(image)), targets[index % len(targets)]


def test_a_classification_shard_is_byte_identical_to_before_structured_samples(tmp_path):
    """The digest of this upload's shard at 5b7dc74, before structured samples existed, once the
    one thing added since is taken out: each sample's digest in the index (its members, their
    order and the rest of the index are as they were)."""
    store = LocalStore(tmp_path)
    upload_to_new_bucket(store, "b", "d", Classic(), maxcount=100, seed=3)
    (shard,) = sorted(p for p in (tmp_path / "b" / "d").iterdir() if p.suffix == ".tar")
    view = ShardView(shard.read_bytes(), _own_index(shard.read_bytes()), name=shard.name)
    assert view.index.digests is not None and len(view.index.digests) == 8 * len(view)
    again = io.BytesIO()
    writer = ShardWriter(again.write)
    for sample in view:
        writer.add(str(sample["__key__"]), {k: bytes(v) for k, v in sample.items() if not k.startswith("__")})
    writer.close()
    assert hashlib.sha256(again.getvalue()).hexdigest()[:16] == CLASSIC_DIGEST


def _own_index(data: bytes) -> ShardIndex:
    """A shard's index, from its last member (found by tarfile, as any tool would)."""
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.getmember(INDEX_MEMBER)
        return ShardIndex.decode(data[member.offset_data : member.offset_data + member.size],
                                 data_end=member.offset)


CLASSIC_DIGEST = "8532df156bd5bf7d"


@pytest.mark.parametrize("target, message", [
    ([{"bbox": {1, 2}}], "sample 3: target[0]['bbox'] is of type set"),
    ([{"bbox": [1, complex(1, 2)]}], "sample 3: target[0]['bbox'][1] is of type complex"),
    ({"mask": torch.zeros(2, dtype=torch.complex64)}, "sample 3: target['mask'] is a torch.complex64 tensor"),
    ({"depth": torch.zeros(2, dtype=torch.bfloat16)}, "sample 3: target['depth'] is a torch.bfloat16 tensor, which"
                                                      " NumPy does not hold: convert it to float32 (.float())"),
    # The hint was bfloat16's whatever the dtype: "convert it (bfloat16 to float32)" for a float8 tensor too.
    ({"depth": torch.zeros(2, dtype=torch.float8_e4m3fn)},
     "sample 3: target['depth'] is a torch.float8_e4m3fn tensor, which NumPy does not hold: convert it to float32"),
    ([1.0, float("inf")], "sample 3: target[1] is inf: JSON holds finite numbers"),
    ((object(),), "sample 3: target[0] is of type object"),
    ({"a": np.array(["x"])}, "sample 3: target['a'] is an array of <U1"),
    ({"a": np.zeros(2, dtype=object)}, "sample 3: target['a'] is an array of object"),
    ({"a b": np.zeros(2)}, "sample 3: target['a b'] lies under the key 'a b'"),
    ({2: [1]}, "sample 3: target has the key 2, a int"),
])
def test_a_value_no_field_stores_is_refused_naming_the_sample_path_and_type(s3, target, message):
    client, bucket = s3

    class Bad(Structured):
        def __getitem__(self, index: int) -> Any:
            return (_image(index), target) if index == 3 else coco_detection(index)

    with pytest.raises(UploadError) as info:
        upload(client, bucket, "bad", Bad(None), maxcount=2)
    assert str(info.value).startswith(message) and "\n" not in str(info.value) and info.value.index == 3
    assert not client.exists(bucket, "bad/manifest.msgpack")  # no dataset to read: the upload is unfinished


def test_a_dict_sample_with_a_key_a_reader_cannot_tell_from_a_position_is_refused():
    for key in ("0", "a.b", "__key__", "a/b"):
        with pytest.raises(UploadError, match=f"sample 2: field name {key!r} of a dict sample is refused"):
            encode_item({"image": _image(0), key: 1}, EncodeOptions(), 2)


@pytest.mark.parametrize("sample, message", [
    ({"k" * 70: 1}, r"sample 3: field 'kkkkkkkkkkkkkkkkkkkkkkkk'\.\.\. is 74 characters long, more than a shard's 64"),
    ({}, "sample 3: ds\\[3\\] is an empty dict: a sample has at least one field"),
])
def test_a_sample_a_shard_cannot_hold_is_refused_under_raise_and_counted_under_skip(s3, sample, message):
    client, bucket = s3

    class Bad(Structured):
        def __getitem__(self, index: int) -> Any:
            return sample if index == 3 else {"image": _image(index), "label": index}

    with pytest.raises(UploadError, match=message):
        upload(client, bucket, "bad", Bad(None), maxcount=2)
    summary = upload(client, bucket, "skipped", Bad(None), maxcount=2, on_error="skip")
    assert summary.skipped == 1 and summary.samples == N - 1
    assert sorted(int(s["__key__"]) for s in RemoteDataset(client, bucket, "skipped")) == [0, 1, 2, 4, 5]


def widerface_dataset() -> Structured:
    """``remote-loader upload tests.upload.test_structured:widerface_dataset ...``'s source."""
    return Structured(widerface)


def _cli(seaweed, s3, folder: str) -> tuple[Any, str]:
    """``run(*arguments)`` of the ``remote-loader`` command against this server, and the URL of ``folder``."""
    from tests.cli.test_cli import run

    env = {**os.environ, **seaweed.env()}
    return (lambda *arguments, check=True: run(env, *arguments, check=check)), f"s3://{s3[1]}/{folder}"


def test_the_cli_uploads_a_structured_dataset_and_info_shows_its_fields_and_types(seaweed, s3):
    cli, url = _cli(seaweed, s3, "cli-widerface")
    up = json.loads(cli("upload", "tests.upload.test_structured:widerface_dataset", url, "--json").stdout)
    assert up["samples"] == N
    info = json.loads(cli("info", url, "--json").stdout)
    assert info["field_types"] == {"0.jpg": "image", "1.bbox.npy": "array in 1", "1.blur.npy": "array in 1",
                                   "1.invalid.npy": "array in 1", "1.json": "JSON"}
    assert "1.bbox.npy (array in 1)" in cli("info", url).stdout


def test_info_shows_masks_as_masks_and_the_datasets_class_names(seaweed, s3):
    cli, url = _cli(seaweed, s3, "cli-voc")
    cli("upload", "--quiet", "tests.upload.structures:segmentation_dataset", url)
    info = json.loads(cli("info", url, "--json").stdout)
    assert info["field_types"] == {"0.jpg": "image", "1.png": "mask (P)"}
    text = cli("info", url).stdout
    assert "1.png (mask (P))" in text and "3 (background, aeroplane, bicycle)" in text and "items=" not in text
    bench = json.loads(cli("bench", url, "--decode", "pil", "--workers", "0", "--json").stdout)
    assert [r["samples"] for r in bench["runs"]] == [N, N]  # bytes only, then every field decoded
    refused = cli("bench", url, "--decode", "rrc", "--workers", "0", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert "holds tuple samples (fields 0.jpg, 1.png): bench it with --decode pil or none" in refused.stderr


def test_class_names_are_found_through_torchvisions_wrappers_and_hugging_face_class_labels():
    from remote_loader.upload.uploader import _class_names

    class ClassLabel:
        def __init__(self, names):
            self.names = names

    class HuggingFace:
        features = {"image": object(), "label": ClassLabel(["cat", "dog"])}

    class Wrapper:  # wrap_dataset_for_transforms_v2 keeps the dataset as _dataset
        _dataset = Segmentation(voc_segmentation)

    assert _class_names(HuggingFace()) == ["cat", "dog"]
    assert _class_names(Wrapper()) == ["background", "aeroplane", "bicycle"]
    assert _class_names(torch.utils.data.Subset(Wrapper(), [0])) == ["background", "aeroplane", "bicycle"]


def test_a_target_that_holds_itself_is_refused_not_a_recursion_traceback():
    looped: list[Any] = [1]
    looped.append(looped)
    with pytest.raises(UploadError, match=r"^sample 4: ds\[4\] is nested too deep to store \(or holds itself\)"):
        encode_item((_image(0), looped), EncodeOptions(), 4)


def test_more_fields_than_a_shard_holds_are_refused_naming_the_sample(s3):
    client, bucket = s3
    many = Structured(lambda i: (_image(i), [np.zeros(1)] * 70))
    with pytest.raises(UploadError, match=r"^sample \d has 72 fields; a shard holds at most 64"):
        upload(client, bucket, "many", many)


def test_samples_whose_fields_together_exceed_a_shards_start_a_new_shard_and_read_back(s3):
    client, bucket = s3
    ds = Structured(lambda i: (_image(i), {f"k{i}_{j}": np.full(2, j) for j in range(40)}))
    upload(client, bucket, "wide", ds, maxcount=100, image_format="png")
    got = dict(RemoteMapDataset(client, bucket, "wide", transform=lambda s: (int(s["__key__"]), restore(s))))
    for i in range(N):
        same_item(ds[i], got[i])


def _bilevel(index: int) -> Image.Image:
    return Image.fromarray(_rng(index).integers(0, 2, (H, W), dtype=np.uint8) * 255).convert("1")


def _palette(index: int) -> Image.Image:
    image = Image.fromarray(_rng(index).integers(0, 4, (H, W), dtype=np.uint8), "P")
    image.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    return image


LOSSLESS_UNDER_JPEG = {
    "bilevel_pair": lambda i: (_bilevel(i), i),                # a pair's image in mode 1: JPEG gave it back as L
    "palette_pair": lambda i: (_palette(i), i),                # mode P: JPEG gave it back as RGB, palette lost
    "ycbcr_pair": lambda i: (_image(i, "YCbCr"), i),           # JPEG gave it back as RGB
    "bilevel_mask": lambda i: (_image(i), _bilevel(i)),        # a segmentation's mask in mode 1
    "bilevel_image": lambda i: (_bilevel(i), _palette(i)),     # a segmentation's image in mode 1
}


@pytest.mark.parametrize("name", sorted(LOSSLESS_UNDER_JPEG))
def test_an_image_in_a_mode_jpeg_does_not_hold_comes_back_in_its_mode_with_its_pixels(s3, name):
    client, bucket = s3
    ds = Structured(LOSSLESS_UNDER_JPEG[name])
    upload(client, bucket, name, ds, maxcount=4, image_format="jpeg")
    reader = RemoteMapDataset(client, bucket, name, transform=lambda s: (int(s["__key__"]), restore(s)))
    read = dict(reader[j] for j in range(len(reader)))
    streamed = dict(RemoteDataset(client, bucket, name, seed=1).map(lambda s: (int(s["__key__"]), restore(s))))
    for got in (read, streamed):
        assert sorted(got) == list(range(N))
        for i in range(N):
            assert type(got[i]) is tuple and len(got[i]) == 2
            for expected, value in zip(ds[i], got[i], strict=True):
                if isinstance(expected, Image.Image) and expected.mode == "RGB":  # JPEG: close, not equal
                    assert (value.mode, value.size) == ("RGB", expected.size)
                else:
                    same(expected, value, f"ds[{i}]")
