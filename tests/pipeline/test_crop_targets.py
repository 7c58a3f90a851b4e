"""The fused crop on structured targets, compared with what torchvision's own v2 transforms
(``resized_crop`` then ``horizontal_flip``) do to the same tv_tensors with the same box and
flip: each box field keeps the rows its own boxes keep, ``KeyPoints`` move by their type,
plain keypoints are moved only where named, ``not_spatial`` fields are left as they are, a
string equal to a placeholder stays a string, and boxes keep their dtype. Skipped where
torchvision is not installed."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from remote_loader import ConfigError, RandomResizedCrop, RemoteDataset, restore
from remote_loader.pipeline.stages.chain import decode_sample
from remote_loader.pipeline.stages.joint import crop_together
from remote_loader.upload.encode import EncodeOptions, encode_item
from tests.helpers import upload_to_new_bucket, vision

W, H, SIZE = 64, 48, 32
SEEDS = range(40)


@pytest.fixture(scope="module")
def tv():
    torchvision = vision()
    from torchvision.transforms.v2 import functional

    return torchvision.tv_tensors, functional


def _image() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8))


def cropped(item: Any, crop: RandomResizedCrop, seed: int) -> tuple[Any, tuple[int, int, int, int], bool]:
    """``item`` uploaded as one sample, cropped by ``crop`` with the generator of ``seed``, and
    restored; with the box and flip the crop drew (the same generator, drawn again)."""
    sample = {**encode_item(item, EncodeOptions(image_format="png"), 0), "__key__": "0", "__shard__": "s"}
    out = crop_together(crop, sample, np.random.default_rng(seed), partial(decode_sample, mode="raw"))
    rng = np.random.default_rng(seed)
    box = crop.box(W, H, rng)
    flip = crop.flip and bool(rng.random() < 0.5)
    return restore(out), box, flip


def expected(tv_value: Any, box: tuple[int, int, int, int], flip: bool, functional: Any) -> Any:
    """What torchvision's v2 does to ``tv_value`` with the crop's box and flip."""
    left, top, right, bottom = box
    moved = functional.resized_crop(tv_value, top, left, bottom - top, right - left, [SIZE, SIZE])
    return functional.horizontal_flip(moved) if flip else moved


def kept(boxes: torch.Tensor, tv: Any) -> torch.Tensor:
    """Which of torchvision's moved boxes are not empty (the rows the crop keeps)."""
    xyxy = tv[1].convert_bounding_box_format(boxes, new_format="XYXY")
    return (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])


def assert_boxes_as_torchvision(got: Any, source: Any, box: Any, flip: bool, tv: Any, atol: float = 1e-4) -> None:
    want = expected(source, box, flip, tv[1])
    want = want[kept(want, tv)]
    assert type(got) is type(source) and got.dtype == source.dtype, (type(got), got.dtype)
    assert got.format == source.format and got.canvas_size == (SIZE, SIZE)
    assert got.shape == want.shape and torch.allclose(got.double(), want.double(), atol=atol), (got, want)


@pytest.mark.parametrize("label", [torch.tensor, int], ids=["tensor", "int"])
def test_each_object_of_a_list_keeps_its_own_box_and_label(tv, label):
    tv_tensors, _ = tv
    objects = [{"box": tv_tensors.BoundingBoxes([[1.0, 1.0, 9.0, 9.0]], format="XYXY", canvas_size=(H, W)),
                "label": label([1]) if label is torch.tensor else 1},
               {"box": tv_tensors.BoundingBoxes([[20.0, 14.0, 44.0, 34.0]], format="XYXY", canvas_size=(H, W)),
                "label": label([2]) if label is torch.tensor else 2}]
    one_left = 0
    for seed in SEEDS:  # an int label beside its object's box is no position: nothing to name
        (_, target), box, flip = cropped((_image(), {"objects": objects}), RandomResizedCrop(SIZE), seed)
        for got, source in zip(target["objects"], objects, strict=True):
            assert_boxes_as_torchvision(got["box"], source["box"], box, flip, tv)
            if label is int:
                assert got["label"] == source["label"]
            else:
                assert got["label"].tolist() == source["label"].tolist()[: len(got["box"])]
        one_left += len(target["objects"][0]["box"]) == 0 and len(target["objects"][1]["box"]) == 1
    assert one_left > 0  # object 0 left the crop while object 1 stayed, and kept its box


def test_numbers_that_may_be_positions_are_still_refused(tv):
    tv_tensors, _ = tv
    boxes = tv_tensors.BoundingBoxes([[1.0, 1.0, 9.0, 9.0]], format="XYXY", canvas_size=(H, W))
    for target, field in (({"boxes": boxes, "polygon": [[3, 4], [9, 4], [9, 9]]}, "1.json"),
                          ({"boxes": boxes, "meta": {"center": {"x": 5, "y": 5}}}, "1.json")):
        with pytest.raises(ConfigError, match=f"cannot tell where field '{field}'"):
            cropped((_image(), target), RandomResizedCrop(SIZE), 0)


def test_a_list_of_box_fields_moves_each_by_itself(tv):
    tv_tensors, _ = tv
    boxes = [tv_tensors.BoundingBoxes([[1.0, 1.0, 9.0, 9.0], [2.0, 30.0, 12.0, 46.0]], format="XYWH",
                                      canvas_size=(H, W)),
             tv_tensors.BoundingBoxes([[32.0, 24.0, 10.0, 10.0]], format="CXCYWH", canvas_size=(H, W))]
    for seed in SEEDS:
        (_, target), box, flip = cropped((_image(), {"boxes": boxes}), RandomResizedCrop(SIZE), seed)
        for got, source in zip(target["boxes"], boxes, strict=True):
            assert_boxes_as_torchvision(got, source, box, flip, tv)


def test_arrays_beside_several_box_fields_are_refused_at_once_each_paired_with_a_box_field_of_its_rows(tv):
    """Every 1-D array beside several box fields is named in one refusal (it named one a run),
    each with a box field of as many rows: the suggestion works (it suggested the first box
    field, of another count, which then failed)."""
    tv_tensors, _ = tv
    target = {"boxes": tv_tensors.BoundingBoxes([[2, 2, 20, 20], [30, 10, 60, 40]], format="XYXY",
                                                canvas_size=(H, W), dtype=torch.float32),
              "crowd": tv_tensors.BoundingBoxes([[0, 0, 10, 10]], format="XYXY", canvas_size=(H, W)),
              "labels": torch.tensor([1, 2]), "image_id": torch.tensor([7])}
    with pytest.raises(ConfigError) as caught:
        cropped((_image(), target), RandomResizedCrop(SIZE), 0)
    said = str(caught.value)
    assert "fields '1.labels.npy', '1.image_id.npy' of sample" in said and "are beside the box fields 1.boxes.npy," \
        " 1.crowd.npy: say whose rows each keeps in per_box={'1.labels.npy': '1.boxes.npy', '1.image_id.npy':" \
        " '1.crowd.npy'}, or name them in not_spatial=" in said
    crop = RandomResizedCrop(SIZE, per_box={"1.labels": "1.boxes", "1.image_id": "1.crowd"})
    for seed in SEEDS:
        (_, got), box, flip = cropped((_image(), target), crop, seed)
        assert len(got["labels"]) == len(got["boxes"]) and len(got["image_id"]) == len(got["crowd"])


def test_box_fields_of_different_counts_are_each_moved_and_labels_follow_theirs(tv):
    tv_tensors, _ = tv
    target = {"boxes": tv_tensors.BoundingBoxes([[2, 2, 20, 20], [30, 10, 60, 40], [5, 30, 25, 46]],
                                                format="XYXY", canvas_size=(H, W), dtype=torch.float32),
              "ignore": tv_tensors.BoundingBoxes([[0, 0, 10, 10], [40, 30, 64, 48]], format="XYXY",
                                                 canvas_size=(H, W), dtype=torch.float32),
              "labels": torch.tensor([1, 2, 3])}
    with pytest.raises(ConfigError, match=r"field '1\.labels\.npy' .* beside the box fields 1\.boxes\.npy, 1\.ignore"
                       r"\.npy: say whose rows it keeps in per_box=\{'1\.labels\.npy': '1\.boxes\.npy'\}"):
        cropped((_image(), target), RandomResizedCrop(SIZE), 0)
    crop = RandomResizedCrop(SIZE, per_box={"1.labels": "1.boxes"})
    for seed in SEEDS:
        (_, got), box, flip = cropped((_image(), target), crop, seed)
        for name in ("boxes", "ignore"):
            assert_boxes_as_torchvision(got[name], target[name], box, flip, tv)
        rows = kept(expected(target["boxes"], box, flip, tv[1]), tv)
        assert got["labels"].tolist() == target["labels"][rows].tolist()


def test_keypoints_move_by_their_type_as_torchvision_moves_them(tv):
    tv_tensors, _ = tv
    points = torch.tensor([[[4.0, 5.0], [8.0, 9.0], [15.0, 3.0]], [[40.0, 30.0], [50.0, 40.0], [62.0, 47.0]]])
    target = {"boxes": tv_tensors.BoundingBoxes([[2, 2, 18, 12], [38, 28, 63, 47]], format="XYXY",
                                                canvas_size=(H, W), dtype=torch.float32),
              "labels": torch.tensor([1, 2]),
              "keypoints": tv_tensors.KeyPoints(points, canvas_size=(H, W)),
              "landmarks": tv_tensors.KeyPoints([[10.0, 10.0], [60.0, 2.0]], canvas_size=(H, W))}
    for seed in SEEDS:
        (_, got), box, flip = cropped((_image(), target), RandomResizedCrop(SIZE), seed)
        rows = kept(expected(target["boxes"], box, flip, tv[1]), tv)
        for name, want in (("keypoints", expected(target["keypoints"], box, flip, tv[1])[rows]),
                           ("landmarks", expected(target["landmarks"], box, flip, tv[1]))):  # no box beside: all kept
            assert type(got[name]) is tv_tensors.KeyPoints and got[name].canvas_size == (SIZE, SIZE)
            assert got[name].shape == want.shape and torch.allclose(got[name], want, atol=1e-4), (name, got[name], want)


def keypoint_rcnn(tv_tensors: Any) -> tuple[Image.Image, dict[str, Any]]:
    """Keypoint R-CNN's target: boxes, labels, and plain ``N x K x 3`` keypoints (x, y, visibility)."""
    points = torch.tensor([[[4.0, 5.0, 2.0], [8.0, 9.0, 1.0], [15.0, 3.0, 0.0]],
                           [[40.0, 30.0, 2.0], [50.0, 40.0, 2.0], [62.0, 47.0, 1.0]]])
    return _image(), {"boxes": tv_tensors.BoundingBoxes([[2, 2, 18, 12], [38, 28, 63, 47]], format="XYXY",
                                                        canvas_size=(H, W), dtype=torch.float32),
                      "labels": torch.tensor([1, 1]), "keypoints": points}


def test_plain_keypoints_are_refused_unless_named_and_then_moved_with_points_outside_marked(tv):
    tv_tensors, _ = tv
    item = keypoint_rcnn(tv_tensors)
    with pytest.raises(ConfigError, match=r"field '1\.keypoints\.npy' .*keypoints="):
        cropped(item, RandomResizedCrop(SIZE), 0)
    outside = 0
    for seed in SEEDS:
        (_, got), box, flip = cropped(item, RandomResizedCrop(SIZE, keypoints=["1.keypoints"]), seed)
        rows = kept(expected(item[1]["boxes"], box, flip, tv[1]), tv)
        source = item[1]["keypoints"]
        want = expected(tv_tensors.KeyPoints(source[..., :2], canvas_size=(H, W)), box, flip, tv[1])[rows]
        points = got["keypoints"]
        assert type(points) is torch.Tensor and points.shape == (int(rows.sum()), 3, 3)
        assert torch.allclose(points[..., :2], want, atol=1e-4)
        inside = (want[..., 0] >= 0) & (want[..., 0] < SIZE) & (want[..., 1] >= 0) & (want[..., 1] < SIZE)
        assert torch.equal(points[..., 2], torch.where(inside, source[rows][..., 2], 0.0))
        outside += int((~inside & (source[rows][..., 2] > 0)).sum())
    assert outside > 0


def test_rotated_boxes_are_refused_and_named_in_not_spatial_left_as_they_are(tv):
    tv_tensors, _ = tv
    rotated = tv_tensors.BoundingBoxes([[10.0, 10.0, 20.0, 8.0, 30.0]], format="XYWHR", canvas_size=(H, W))
    item = (_image(), {"boxes": rotated, "labels": torch.tensor([4])})
    with pytest.raises(ConfigError, match=r"field '1\.boxes\.npy' .* XYWHR boxes.*not_spatial"):
        cropped(item, RandomResizedCrop(SIZE), 0)
    for named in (["1.boxes.npy"], ["1.boxes"], ["1"]):
        (_, got), _, _ = cropped(item, RandomResizedCrop(SIZE, not_spatial=named), 0)
        assert torch.equal(got["boxes"], rotated) and got["boxes"].format == rotated.format
        assert got["boxes"].canvas_size == (H, W) and got["labels"].tolist() == [4]  # left, canvas and all


def test_fields_named_not_spatial_are_not_cut_as_rows_of_the_boxes(tv):
    tv_tensors, _ = tv
    for boxes in ([[1.0, 1.0, 6.0, 6.0]], [[1.0, 1.0, 6.0, 6.0], [50.0, 36.0, 60.0, 44.0]]):
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(H, W)),
                  "labels": torch.arange(len(boxes)), "image_id": torch.tensor([7]),
                  "orig_size": torch.tensor([H, W])}
        crop = RandomResizedCrop(SIZE, not_spatial=["1.image_id", "1.orig_size.npy"])
        dropped = 0
        for seed in SEEDS:
            (_, got), _, _ = cropped((_image(), target), crop, seed)
            assert got["image_id"].tolist() == [7] and got["orig_size"].tolist() == [H, W]
            assert len(got["labels"]) == len(got["boxes"])
            dropped += len(got["boxes"]) < len(boxes)
        assert dropped > 0


def test_a_caption_equal_to_a_placeholder_stays_a_caption(tv):
    tv_tensors, _ = tv
    target = {"boxes": tv_tensors.BoundingBoxes([[2.0, 2.0, 40.0, 40.0]], format="XYXY", canvas_size=(H, W)),
              "labels": torch.tensor([1]), "notes": ["tv_tensors.Mask", "numpy", "a cat"]}
    (_, got), _, _ = cropped((_image(), target), RandomResizedCrop(SIZE), 0)
    assert got["notes"] == ["tv_tensors.Mask", "numpy", "a cat"]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.float64])
def test_boxes_keep_their_dtype(tv, dtype):
    tv_tensors, _ = tv
    source = tv_tensors.BoundingBoxes([[2, 3, 40, 30], [10, 20, 60, 47]], format="XYXY", canvas_size=(H, W),
                                      dtype=dtype)
    for seed in SEEDS:
        (_, got), box, flip = cropped((_image(), {"boxes": source}), RandomResizedCrop(SIZE), seed)
        assert_boxes_as_torchvision(got["boxes"], source, box, flip, tv, atol=1.0 if dtype == torch.int64 else 0.05)


class Structured:
    """One of each target above, through a real pipeline."""

    def __init__(self, tv_tensors: Any) -> None:
        self.tv = tv_tensors

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> Any:
        image, target = keypoint_rcnn(self.tv)
        target["ignore"] = self.tv.BoundingBoxes([[0, 0, 10, 10]] * (1 + index % 3), format="XYXY",
                                                 canvas_size=(H, W), dtype=torch.float32)
        target["notes"] = ["tv_tensors.Mask", str(index)]
        return image, target


def test_a_pipeline_crops_each_target_without_a_raw_error(seaweed, tv):
    tv_tensors, _ = tv
    client = seaweed.client()
    upload_to_new_bucket(client, "crop-targets", "d", Structured(tv_tensors), maxcount=4, image_format="png")
    crop = RandomResizedCrop(SIZE, keypoints=["1.keypoints.npy"],
                             per_box={"1.labels.npy": "1.boxes.npy", "1.keypoints": "1.boxes"})
    seen = []
    for image, target in RemoteDataset(client, "crop-targets", "d", seed=3).decode(crop).map(restore):
        assert image.shape == (3, SIZE, SIZE)
        assert len(target["boxes"]) == len(target["labels"]) == len(target["keypoints"])
        assert target["ignore"].canvas_size == (SIZE, SIZE) and len(target["ignore"]) <= 3
        seen.append(target["notes"][1])
    assert sorted(seen) == [str(i) for i in range(6)]


def test_a_mask_or_boxes_that_are_a_samples_own_field_are_cropped_with_its_image(tv):
    """What ``wrap_dataset_for_transforms_v2(VOCSegmentation)`` gives, ``(image, Mask)``, and a
    dict sample whose ``boxes`` field is itself a ``BoundingBoxes``: each tv_tensor moves with
    the image as torchvision moves it, with no ``boxes=`` to write."""
    tv_tensors, functional = tv
    mask = torch.zeros(1, H, W, dtype=torch.uint8)
    mask[0, 10:30, 5:40] = 1
    for seed in SEEDS[:8]:
        (image, got), box, flip = cropped((_image(), tv_tensors.Mask(mask)), RandomResizedCrop(SIZE), seed)
        want = expected(tv_tensors.Mask(mask), box, flip, functional)
        assert type(got) is tv_tensors.Mask and got.shape == want.shape and got.dtype == torch.uint8, seed
        assert set(got.unique().tolist()) <= {0, 1} and got.sum() > 0
        assert (got == want).float().mean() >= 0.9, seed  # nearest neighbour: they differ at the edges only
    boxes = tv_tensors.BoundingBoxes([[4.0, 6.0, 40.0, 30.0]], format="XYXY", canvas_size=(H, W))
    for seed in SEEDS[:8]:
        out, box, flip = cropped({"image": _image(), "boxes": boxes, "labels": torch.tensor([1])},
                                 RandomResizedCrop(SIZE), seed)
        assert_boxes_as_torchvision(out["boxes"], boxes, box, flip, tv)
