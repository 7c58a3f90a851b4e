"""``decode(RandomResizedCrop(...))`` on structured samples crops their targets with their
images: masks by nearest neighbour with the same box and flip, declared boxes by the same
affine map (clipped, those left empty dropped with their rows), a second image of the pair
with the same box; a field the crop cannot place is refused unless named ``not_spatial``;
the GPU stage refuses structured samples."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from remote_loader import ConfigError, RandomResizedCrop, RemoteDataset, restore
from remote_loader.pipeline.device import nvimgcodec
from tests.helpers import upload_to_new_bucket

W, H, BLOCK, N = 64, 48, 8, 16


def _blocks(index: int) -> np.ndarray:
    """An ``H x W`` map of classes 0..20, constant over ``BLOCK``-pixel squares."""
    small = np.random.default_rng(index).integers(0, 21, (H // BLOCK, W // BLOCK), dtype=np.uint8)
    return np.kron(small, np.ones((BLOCK, BLOCK), np.uint8))


class Segmentation:
    """VOC-style ``(RGB image, P mask)``: the image's red channel is ten times the mask."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> Any:
        classes = _blocks(index)
        image = np.zeros((H, W, 3), np.uint8)
        image[..., 0] = classes * 10
        mask = Image.fromarray(classes).convert("P")
        mask.putpalette([v for c in range(256) for v in (c, c, c)])
        return Image.fromarray(image), mask


class Boxes:
    """WIDERFace-style ``(image, {"bbox": xywh array, "label": array})``: one white rectangle
    on black, its box, and a second box far from it, so a crop often keeps one and not the other."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> Any:
        rng = np.random.default_rng(index)
        x, y = int(rng.integers(0, W // 2)), int(rng.integers(0, H // 2))
        w, h = int(rng.integers(6, W // 2)), int(rng.integers(6, H // 2))
        image = np.zeros((H, W, 3), np.uint8)
        image[y : y + h, x : x + w] = 255
        boxes = np.array([[x, y, w, h], [W - 4, H - 4, 4, 4]], np.int64)
        return Image.fromarray(image), {"bbox": boxes, "label": np.array([7, 9])}


class Pairs:
    """Flow-style ``(img1, img2, flow)`` with ``img1 == img2``."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        image = Image.fromarray(np.random.default_rng(index).integers(0, 256, (H, W, 3), dtype=np.uint8))
        return image, image.copy(), np.zeros((2, H, W), np.float32)


@pytest.fixture(scope="module")
def client(seaweed):
    store = seaweed.client()
    upload_to_new_bucket(store, "joint-seg", "d", Segmentation(), maxcount=8, image_format="png")
    upload_to_new_bucket(store, "joint-boxes", "d", Boxes(), maxcount=8, image_format="png")
    upload_to_new_bucket(store, "joint-pairs", "d", Pairs(), maxcount=8, image_format="png")
    return store


def test_a_mask_is_cropped_with_its_image_by_nearest_neighbour(client):
    crop = RandomResizedCrop(32, scale=(0.3, 1.0))
    samples = list(RemoteDataset(client, "joint-seg", "d", seed=0).decode(crop))
    assert len(samples) == N
    for sample in samples:
        image, mask = sample["0.png"], sample["1.png"]
        assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and mask.dtype == torch.uint8
        source = set(np.unique(_blocks(int(sample["__key__"]))).tolist())
        assert set(mask.unique().tolist()) <= source  # no value invented
        # Where the mask is constant over a pixel's 5 x 5 neighbourhood, the image (blurred only
        # at block edges) is ten times it: the same box and flip.
        padded = torch.nn.functional.pad(mask[None, None].int(), (2, 2, 2, 2), mode="replicate")[0, 0]
        inside = torch.ones_like(mask, dtype=torch.bool)
        for dy in range(5):
            for dx in range(5):
                inside &= padded[dy : dy + 32, dx : dx + 32] == mask.int()
        agree = (image[0].int() - mask.int() * 10).abs() <= 2
        assert inside.sum() >= 64 and bool(agree[inside].all()), sample["__key__"]


def test_boxes_move_with_the_crop_and_those_left_empty_are_dropped_with_their_rows(client):
    crop = RandomResizedCrop(32, scale=(0.1, 0.6), boxes={"1.bbox.npy": "xywh"}, per_box=["1.label.npy"],
                             not_spatial=["1.json"])
    dropped = 0
    for epoch in range(3):
        ds = RemoteDataset(client, "joint-boxes", "d", seed=epoch).decode(crop).map(restore)
        for image, target in ds:
            boxes, labels = target["bbox"], target["label"]
            assert len(boxes) == len(labels) and set(labels.tolist()) <= {7, 9}
            dropped += 2 - len(boxes)
            white = np.argwhere(image[0].numpy() > 128)
            if 7 in labels.tolist():
                x, y, w, h = boxes[labels.tolist().index(7)]
                top, left = white.min(0)
                bottom, right = white.max(0) + 1
                assert abs(left - x) <= 1.5 and abs(top - y) <= 1.5, (boxes, white.min(0))
                assert abs(right - (x + w)) <= 1.5 and abs(bottom - (y + h)) <= 1.5, (boxes, white.max(0))
            else:  # the rectangle's box was left empty: nothing of it is in the crop
                assert (image[0] > 200).sum() <= 2
    assert dropped > 0


def test_the_images_of_a_pair_get_the_same_box_and_flip(client):
    crop = RandomResizedCrop(24, not_spatial=["2"])
    for sample in RemoteDataset(client, "joint-pairs", "d", seed=0).decode(crop):
        assert torch.equal(sample["0.png"], sample["1.png"])
        assert sample["2.npy"].shape == (2, H, W)  # named not spatial: as it was


def test_a_field_the_crop_cannot_place_is_refused_unless_named(client):
    ds = RemoteDataset(client, "joint-pairs", "d", seed=0).decode(RandomResizedCrop(24))
    with pytest.raises(ConfigError, match=r"cannot tell where field '2.npy' of sample '\d+' of \S+ lies in the image"):
        next(iter(ds))
    boxes = RemoteDataset(client, "joint-boxes", "d", seed=0).decode(RandomResizedCrop(24, not_spatial=["1.json"]))
    with pytest.raises(ConfigError, match="field '1.bbox.npy'"):
        next(iter(boxes))


def test_crop_options_are_checked_where_the_crop_is_made():
    with pytest.raises(ConfigError, match="boxes maps field names to one of xyxy, xywh, cxcywh"):
        RandomResizedCrop(24, boxes={"1.npy": "xyzw"})
    with pytest.raises(ConfigError, match="not_spatial is a list of field names"):
        RandomResizedCrop(24, not_spatial="1")


def test_the_gpu_stage_refuses_a_structured_sample(client):
    try:
        nvimgcodec()
    except ConfigError:
        pytest.skip("nvImageCodec is not installed (the gpu extra)")
    with pytest.raises(ConfigError, match="decode\\(device='cpu'\\) crops classification samples"):  # said when made
        RemoteDataset(client, "joint-seg", "d", seed=0).decode(RandomResizedCrop(24), device="cpu", batched=True)
    unknown = RemoteDataset(client, "joint-seg", "d", seed=0).map(lambda sample: sample)  # fields not known before
    ds = unknown.decode(RandomResizedCrop(24), device="cpu", batched=True).batched(4)
    with pytest.raises(ConfigError, match="decode\\(device=...\\) crops classification samples"):
        next(iter(ds))
