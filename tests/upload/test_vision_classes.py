"""What torchvision's own dataset classes hand over, over files in their real on-disk format:
tv_tensors keep their type and metadata through upload and restore, the fused crop moves
``BoundingBoxes`` and ``Mask`` fields for their type, and tensors stay tensors. Skipped where
torchvision is not installed."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from remote_loader import RandomResizedCrop, RemoteDataset, UploadError, restore
from remote_loader.pipeline.stages import restore as restoring
from tests.helpers import upload, vision

W, H = 64, 48
# pycocotools' masks under NumPy 2, inside torchvision's wrapper: not this project's to change
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


@pytest.fixture(scope="module")
def coco_files(tmp_path_factory):
    """A COCO detection set as the files CocoDetection reads: JPEGs and instances.json,
    each object a rectangle polygon (so its mask fills its box)."""
    root = tmp_path_factory.mktemp("coco")
    rng = np.random.default_rng(5)
    images, annotations = [], []
    for i in range(6):
        name = f"{i:012d}.jpg"
        Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(root / name, quality=95)
        images.append({"id": i, "file_name": name, "width": W, "height": H})
        for k in range(1 + i % 3):
            x, y, w, h = 4.0 + 14 * k, 6.0 + i, 12.0, 16.0 + k
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": 1 + k, "iscrowd": 0,
                                "bbox": [x, y, w, h], "area": w * h,
                                "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]})
    (root / "instances.json").write_text(json.dumps({
        "images": images, "annotations": annotations,
        "categories": [{"id": c, "name": f"class{c}", "supercategory": "thing"} for c in (1, 2, 3)]}))
    return root


@pytest.fixture(scope="module")
def coco_v2(coco_files):
    """``wrap_dataset_for_transforms_v2(CocoDetection(...))``: PIL images, targets of
    ``BoundingBoxes``, ``Mask`` and label tensors."""
    torchvision = vision()
    pytest.importorskip("pycocotools")
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2

    return wrap_dataset_for_transforms_v2(CocoDetection(str(coco_files), str(coco_files / "instances.json")),
                                          target_keys={"boxes", "masks", "labels", "image_id"}), torchvision


@pytest.fixture(scope="module")
def uploaded(seaweed, coco_v2):
    ds, _ = coco_v2
    client = seaweed.client()
    client.create_bucket("vision-classes")
    upload(client, "vision-classes", "coco", ds, maxcount=4)
    return client


def indexed(sample):
    return int(sample["__key__"]), restore(sample)


def test_tv_tensors_come_back_of_their_type_with_their_metadata(uploaded, coco_v2):
    ds, torchvision = coco_v2
    tv = torchvision.tv_tensors
    got = dict(RemoteDataset(uploaded, "vision-classes", "coco").map(indexed))
    assert sorted(got) == list(range(len(ds)))
    for i, (_, target) in got.items():
        _, expected = ds[i]
        boxes, masks = target["boxes"], target["masks"]
        assert type(boxes) is tv.BoundingBoxes and type(masks) is tv.Mask
        assert boxes.format == expected["boxes"].format and boxes.canvas_size == expected["boxes"].canvas_size == (H, W)
        assert boxes.clamping_mode == expected["boxes"].clamping_mode
        assert torch.equal(boxes, expected["boxes"]) and torch.equal(masks, expected["masks"])
        assert torch.equal(target["labels"], expected["labels"]) and target["image_id"] == expected["image_id"]


def test_a_v2_transform_crops_the_restored_masks_and_boxes_with_the_image(uploaded, coco_v2):
    _, torchvision = coco_v2
    from torchvision.transforms import v2

    crop = v2.Compose([v2.ToImage(), v2.RandomCrop((24, 32))])
    for _, (image, target) in RemoteDataset(uploaded, "vision-classes", "coco").map(indexed):
        image, target = crop(image, target)
        assert image.shape[-2:] == target["masks"].shape[-2:] == (24, 32)
        assert target["boxes"].canvas_size == (24, 32)


def test_the_fused_crop_moves_boxes_and_masks_for_their_type_and_their_rows_go_together(uploaded, coco_v2):
    ds, torchvision = coco_v2
    tv = torchvision.tv_tensors
    crop = RandomResizedCrop(32, scale=(0.3, 1.0))
    seen, kept = 0, 0
    for image, target in RemoteDataset(uploaded, "vision-classes", "coco", seed=3).decode(crop).map(restore):
        boxes, masks, labels = target["boxes"], target["masks"], target["labels"]
        kept += len(boxes)
        assert image.shape == (3, 32, 32)
        assert type(boxes) is tv.BoundingBoxes and boxes.canvas_size == (32, 32) and boxes.format.name == "XYXY"
        assert type(masks) is tv.Mask and masks.shape[1:] == (32, 32)
        assert len(boxes) == len(masks) == len(labels)
        for box, mask in zip(boxes.tolist(), masks, strict=True):  # each object's mask lies under its moved box
            rows, cols = np.nonzero(mask.numpy())
            if len(rows):
                left, top, right, bottom = box
                assert cols.min() >= left - 1.5 and cols.max() + 1 <= right + 1.5
                assert rows.min() >= top - 1.5 and rows.max() + 1 <= bottom + 1.5
                seen += 1
    assert 0 < seen and kept < sum(len(target["boxes"]) for _, target in ds)  # some boxes left the crops


def test_a_tensor_target_of_one_value_comes_back_a_tensor(s3):
    client, bucket = s3
    items = [(Image.new("RGB", (8, 8)), torch.tensor(2880)), (Image.new("RGB", (8, 8)), torch.tensor([5])),
             (Image.new("RGB", (8, 8)), {"identity": torch.tensor(7, dtype=torch.int32)})]

    class Targets:
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return items[i]

    upload(client, bucket, "celeba", Targets())
    got = dict(RemoteDataset(client, bucket, "celeba").map(indexed))
    for i, (_, target) in got.items():
        expected = items[i][1]
        value, want = (target["identity"], expected["identity"]) if isinstance(expected, dict) else (target, expected)
        assert isinstance(value, torch.Tensor) and value.dtype == want.dtype and torch.equal(value, want)
    crop = RandomResizedCrop(4)  # one number is no position: the crop takes the sample as it is
    assert len(list(RemoteDataset(client, bucket, "celeba").decode(crop))) == len(items)


def test_without_torchvision_tv_tensors_come_back_plain_with_one_warning(uploaded, coco_v2, monkeypatch):
    monkeypatch.setattr(restoring, "tv_tensors", lambda: None)
    monkeypatch.setattr(restoring, "_warned", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(RemoteDataset(uploaded, "vision-classes", "coco").map(restore))
    assert all(type(target["boxes"]) is torch.Tensor and type(target["masks"]) is torch.Tensor
               for _, target in got)
    assert len(caught) == 1 and "torchvision cannot be imported" in str(caught[0].message)


@pytest.fixture(scope="module")
def widerface(tmp_path_factory):
    """torchvision's WIDERFace over its own layout: images under WIDER_train/images, and
    wider_face_split/wider_face_train_bbx_gt.txt (x y w h blur expression illumination
    invalid occlusion pose, one face a line)."""
    vision()
    from torchvision.datasets import WIDERFace

    root = tmp_path_factory.mktemp("wider")
    base = root / "widerface"
    for folder in ("WIDER_train/images/0--Parade", "WIDER_val", "WIDER_test", "wider_face_split"):
        (base / folder).mkdir(parents=True)
    rng, lines = np.random.default_rng(8), []
    for i in range(5):
        name = f"0--Parade/0_Parade_{i}.jpg"
        Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(base / "WIDER_train/images" / name)
        faces = [[2 + 20 * k, 4 + 3 * i, 14, 18, k % 3, 0, i % 2, 0, k % 2, 1] for k in range(1 + i % 3)]
        lines += [name, str(len(faces)), *(" ".join(map(str, face)) for face in faces)]
    (base / "wider_face_split/wider_face_train_bbx_gt.txt").write_text("\n".join(lines) + "\n")
    return WIDERFace(str(root), split="train")


def test_arrays_beside_named_boxes_with_one_row_a_box_are_per_box_without_naming_them(s3, widerface):
    client, bucket = s3
    upload(client, bucket, "faces", widerface)
    crop = RandomResizedCrop(32, scale=(0.2, 0.6), boxes={"1.bbox.npy": "xywh"})  # no per_box= for its six arrays
    counts, annotations = [], [info["annotations"] for info in widerface.img_info]  # ds[i] opens a file
    for image, target in RemoteDataset(client, bucket, "faces", seed=2).decode(crop).map(restore):
        assert image.shape == (3, 32, 32) and set(target) == set(annotations[0])
        counts.append({name: len(value) for name, value in target.items()})
    assert all(len(set(count.values())) == 1 for count in counts)  # every field lost the rows its boxes lost
    assert sum(count["bbox"] for count in counts) < sum(len(a["bbox"]) for a in annotations)


@pytest.fixture(scope="module")
def cityscapes(tmp_path_factory):
    """torchvision's Cityscapes over its own layout, with a semantic (L) and a colour (RGBA) target."""
    vision()
    from torchvision.datasets import Cityscapes

    root = tmp_path_factory.mktemp("cityscapes")
    rng = np.random.default_rng(9)
    for folder in ("leftImg8bit/train/aachen", "gtFine/train/aachen"):
        (root / folder).mkdir(parents=True)
    for i in range(4):
        stem = f"aachen_{i:06d}_000019"
        Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(
            root / f"leftImg8bit/train/aachen/{stem}_leftImg8bit.png")
        Image.fromarray(rng.integers(0, 34, (H, W), dtype=np.uint8)).save(
            root / f"gtFine/train/aachen/{stem}_gtFine_labelIds.png")
        Image.fromarray(rng.integers(0, 256, (H, W, 4), dtype=np.uint8), "RGBA").save(
            root / f"gtFine/train/aachen/{stem}_gtFine_color.png")
    return Cityscapes(str(root), split="train", mode="fine", target_type=["semantic", "color"])


def test_a_colour_target_in_rgba_is_stored_lossless_under_the_default_format(s3, cityscapes):
    client, bucket = s3
    upload(client, bucket, "city", cityscapes)  # image_format="jpeg"
    got = dict(RemoteDataset(client, bucket, "city").map(indexed))
    assert sorted(got) == list(range(len(cityscapes)))
    for i, (image, (semantic, colour)) in got.items():
        with Image.open(cityscapes.targets[i][1]) as expected_colour, Image.open(cityscapes.targets[i][0]) as labels:
            assert colour.mode == "RGBA" and np.array_equal(np.asarray(colour), np.asarray(expected_colour))
            assert semantic.mode == "L" and np.array_equal(np.asarray(semantic), np.asarray(labels))
        assert image.mode == "RGB" and image.size == (W, H)


def test_images_in_modes_the_upload_format_cannot_hold_are_stored_lossless_or_refused_naming_the_field(s3):
    client, bucket = s3
    rgb = Image.fromarray(np.random.default_rng(1).integers(0, 256, (H, W, 3), dtype=np.uint8))
    la = Image.fromarray(np.random.default_rng(2).integers(0, 256, (H, W, 2), dtype=np.uint8), "LA")
    modes = {"la": la, "cmyk": rgb.convert("CMYK"), "lab": rgb.convert("LAB"), "rgba": rgb.convert("RGBA")}

    class Modes:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"image": rgb, **modes} if i == 0 else (rgb.convert("RGBA"), i)

    for image_format in ("jpeg", "webp", "png"):
        upload(client, bucket, image_format, Modes(), image_format=image_format)
        got = dict(RemoteDataset(client, bucket, image_format).map(indexed))
        for name, image in modes.items():
            if name != "cmyk" or image_format != "jpeg":  # JPEG holds CMYK, lossy as it holds RGB
                assert got[0][name].mode == image.mode and np.array_equal(np.asarray(got[0][name]), np.asarray(image))
        assert got[1][0].mode == "RGBA" and got[1][1] == 1
        if image_format == "jpeg":
            assert np.array_equal(np.asarray(got[1][0]), np.asarray(rgb.convert("RGBA")))  # a classification image too

    class HSV(Modes):
        def __getitem__(self, i):
            return {"image": rgb, "hue": rgb.convert("HSV")}

    with pytest.raises(UploadError, match=r"sample 0: item\['hue'\] is a HSV image, which no image format stores"):
        upload(client, bucket, "hsv", HSV())


def test_batches_of_detection_samples_stack_images_and_keep_each_samples_target(uploaded, coco_v2):
    _, torchvision = coco_v2
    from torch.utils.data import DataLoader

    from remote_loader import RemoteMapDataset, collate

    crop = RandomResizedCrop(32, scale=(0.5, 1.0))
    batches = list(RemoteDataset(uploaded, "vision-classes", "coco").decode(crop).map(restore).batched(4))
    assert [len(targets) for _, targets in batches] == [4, 2]
    for images, targets in batches:
        assert images.shape == (len(targets), 3, 32, 32)
        assert all(type(t["boxes"]) is torchvision.tv_tensors.BoundingBoxes and isinstance(t["labels"], torch.Tensor)
                   for t in targets)
    from torchvision.transforms import v2

    augment = v2.Compose([v2.ToImage(), v2.RandomCrop((24, 32))])

    def transform(sample):
        return augment(restore(sample))

    loader = DataLoader(RemoteMapDataset(uploaded, "vision-classes", "coco", transform=transform), batch_size=3,
                        collate_fn=collate)
    for images, targets in loader:  # images of one size stack; each target stays its sample's
        assert images.shape == (3, 3, 24, 32) and len(targets) == 3
        assert all(t["masks"].shape[1:] == (24, 32) and len(t["boxes"]) == len(t["labels"]) for t in targets)


def test_batches_of_targets_of_different_lengths_need_no_collate_fn(s3):
    client, bucket = s3
    rng = np.random.default_rng(3)

    class Faces:  # WIDERFace-like: arrays of one row a face, 1 to 3 faces
        def __len__(self):
            return 6

        def __getitem__(self, i):
            bbox = np.array([[4, 6, 20, 24], [40, 20, 10, 12], [20, 30, 8, 8]])[:1 + i % 3]
            return Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)), {"bbox": bbox, "blur": bbox[:, 0]}

    upload(client, bucket, "faces", Faces())
    crop = RandomResizedCrop(16, boxes={"1.bbox.npy": "xywh"}, per_box=["1.blur.npy"])
    (images, targets), = list(RemoteDataset(client, bucket, "faces").decode(crop).map(restore).batched(6))
    assert images.shape == (6, 3, 16, 16) and len(targets) == 6
    assert all(isinstance(t["bbox"], torch.Tensor) and len(t["bbox"]) == len(t["blur"]) for t in targets)


def _members(client, bucket, folder):
    """Each sample's raw fields by its index in the uploaded dataset."""
    return {int(s["__key__"]): {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
            for s in RemoteDataset(client, bucket, folder)}


def test_images_the_classes_open_from_files_are_stored_as_those_files_bytes(uploaded, coco_files, s3, cityscapes,
                                                                              widerface):
    for i, fields in _members(uploaded, "vision-classes", "coco").items():  # Image.open(path).convert("RGB")
        assert fields["0.jpg"] == (coco_files / f"{i:012d}.jpg").read_bytes()
    client, bucket = s3
    upload(client, bucket, "city", cityscapes)  # PNGs: the image converted to RGB, its targets as opened
    for i, fields in _members(client, bucket, "city").items():
        with open(cityscapes.images[i], "rb") as image, open(cityscapes.targets[i][0], "rb") as semantic:
            assert fields["0.png"] == image.read() and fields["1.0.png"] == semantic.read()
        with open(cityscapes.targets[i][1], "rb") as colour:
            assert fields["1.1.png"] == colour.read()
    upload(client, bucket, "faces", widerface)  # Image.open(path), not converted
    for i, fields in _members(client, bucket, "faces").items():
        with open(widerface.img_info[i]["img_path"], "rb") as image:
            assert fields["0.jpg"] == image.read()


def test_an_image_whose_pixels_or_mode_are_not_its_files_is_encoded(s3, tmp_path):
    client, bucket = s3
    rng = np.random.default_rng(4)
    Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(tmp_path / "colour.jpg")
    Image.fromarray(rng.integers(0, 256, (H, W), dtype=np.uint8)).save(tmp_path / "grey.jpg")

    class Changed:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            if i == 0:  # flipped: the same size, other pixels
                return Image.open(tmp_path / "colour.jpg").transpose(Image.Transpose.FLIP_LEFT_RIGHT), 0
            if i == 1:  # a grey JPEG made RGB: the same pixels in another mode
                return Image.open(tmp_path / "grey.jpg").convert("RGB"), 1
            return Image.open(tmp_path / "colour.jpg").convert("RGB"), 2

    upload(client, bucket, "changed", Changed(), image_format="png")
    members = _members(client, bucket, "changed")
    assert members[2]["jpg"] == (tmp_path / "colour.jpg").read_bytes()  # a JPEG stays that JPEG, under png too
    for i in (0, 1):
        image = Image.open(io.BytesIO(members[i]["png"]))
        assert np.array_equal(np.asarray(image), np.asarray(Changed()[i][0]))  # its own pixels, lossless
