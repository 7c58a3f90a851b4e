"""The augmentation every system runs in scenario B, and the helpers the loaders share.

``plain_augment`` is what a torchvision training script does per image: decode with
Pillow, ``convert("RGB")``, a random-resized-crop box (torchvision's distribution),
bilinear resize to 224, horizontal flip with probability 1/2, to a uint8 CxHxW tensor.
remote_loader's fused path (``RandomResizedCrop``) is measured against it.
"""

from __future__ import annotations

import io
import math
import random
from typing import Any

import numpy as np
import torch
from PIL import Image

SIZE = 224
BATCH = 64


def crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box: area 8-100%, aspect 3/4-4/3, ten tries then a centre crop."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


_rng = random.Random()


def plain_augment(data: Any) -> torch.Tensor:
    """Decode JPEG bytes and random-resized-crop + flip them to a 3x224x224 uint8 tensor."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    crop = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=crop_box(*image.size, _rng))
    if _rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(crop)).permute(2, 0, 1)


def count_batch(batch: list[Any]) -> tuple[int, int]:
    """Collation for bytes-only runs: the bytes stay in the worker, only (samples, bytes) travel."""
    return len(batch), sum(len(item[0]) for item in batch)


def read_batch(batch: list[Any]) -> tuple[int, int]:
    """Collation for bytes-only runs whose consumer reads what it is given, as any decoder
    must: one byte of each 4 KB page of each sample's bytes (a memory-mapped view that is
    never read costs nothing until it is: its pages are read here, as they would be)."""
    read = 0
    for item in batch:
        np.frombuffer(item[0], dtype=np.uint8)[::4096].sum()
        read += len(item[0])
    return len(batch), read


def augment_batch(batch: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collation for scenario B when samples arrive as (bytes, label): augment, then stack."""
    return torch.stack([plain_augment(data) for data, _ in batch]), torch.tensor([int(label) for _, label in batch])


def stack_batch(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collation for already-augmented (tensor, label) samples."""
    return torch.stack([image for image, _ in batch]), torch.tensor([int(label) for _, label in batch])
