"""The structures a CLI test uploads from its own process (``tests.upload.structures:segmentation_dataset``).

Kept apart from test_structured.py: the CLI imports the source's module in its own process
and in each upload worker, and the test module imports pytest and torch, about 3 s each time."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

N = 6
W, H = 24, 16


def _rng(index: int) -> np.random.Generator:
    return np.random.default_rng(1000 + index)


def _image(index: int, mode: str = "RGB") -> Image.Image:
    pixels = _rng(index).integers(0, 256, (H, W, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _palette_mask(index: int) -> Image.Image:
    mask = Image.fromarray(_rng(index).integers(0, 21, (H, W), dtype=np.uint8)).convert("P")
    mask.putpalette([v for c in range(256) for v in (c, 255 - c, (c * 7) % 256)])
    mask.info["transparency"] = 255  # VOC's border value
    return mask


class Structured:
    """``ds[i]`` made by ``make(i)``."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> Any:
        return self.make(index)


def voc_segmentation(i: int) -> Any:  # VOCSegmentation, SBDataset: (PIL, PIL mask in mode P)
    return _image(i), _palette_mask(i)


class Segmentation(Structured):
    """VOC-like (image, P mask) with the class names a dataset names in ``classes``."""

    classes = ["background", "aeroplane", "bicycle"]


def segmentation_dataset() -> Structured:
    return Segmentation(voc_segmentation)
