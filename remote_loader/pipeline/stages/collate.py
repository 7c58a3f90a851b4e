"""``collate``: batches of any samples, detection and segmentation targets included.

torch's ``default_collate`` stacks every value of a batch, and fails on what does not stack:
a detection target's boxes, one row per object, differ in length from sample to sample. Here
a sample's own fields (its tuple's positions, its dict's keys) are stacked as
``default_collate`` stacks them (images and masks of one size, labels), and a field that is
a dict or a list (a target) is kept per sample, a list as long as the batch, as torchvision's
detection references and models take targets; NumPy arrays come as tensors either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

_PER_SAMPLE_TV_TENSORS = ("BoundingBoxes", "Mask", "KeyPoints")
"""tv_tensors whose metadata (a canvas size, a box format) is each sample's: never stacked."""


def collate(batch: Sequence[Any]) -> Any:
    """A batch of samples: a tuple's positions (as a list, as ``default_collate`` gives them)
    or a dict's keys each collated across the batch. A field of tensors, arrays or numbers is
    stacked as ``default_collate`` stacks it, or kept per sample where shapes differ; a field
    that is a dict or a list (a detection target, COCO's annotations), torchvision
    ``BoundingBoxes``, ``Mask`` or ``KeyPoints`` (whose metadata is each sample's), or a member
    read as a memoryview (``views=True``: ``default_collate`` would take it for a sequence of
    its bytes) is kept per sample: a list as long as the batch, NumPy arrays in it as tensors."""
    batch = list(batch)
    first = batch[0]
    if isinstance(first, Mapping) and all(isinstance(b, Mapping) and b.keys() == first.keys() for b in batch):
        return {key: _field([b[key] for b in batch]) for key in first}
    if isinstance(first, tuple) and all(isinstance(b, tuple) and len(b) == len(first) for b in batch):
        return [_field(list(values)) for values in zip(*batch, strict=True)]
    return _field(batch)


def _field(values: list[Any]) -> Any:
    """One field's values across a batch: stacked where they are tensors, arrays or numbers of
    one shape, else one per sample."""
    if any(isinstance(v, (Mapping, list, tuple, memoryview)) or _per_sample(v) for v in values):
        return [_tensors(v) for v in values]
    try:
        return default_collate(values)
    except (RuntimeError, TypeError):  # shapes that differ: one value per sample
        return [_tensors(v) for v in values]


def _per_sample(value: Any) -> bool:
    return type(value).__name__ in _PER_SAMPLE_TV_TENSORS and type(value).__module__.startswith("torchvision")


def _tensors(value: Any) -> Any:
    """``value`` with its numeric NumPy arrays (inside dicts and lists too) as tensors."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(value)
    if isinstance(value, Mapping):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors(v) for v in value]
    return value
