"""The fused random-resized-crop decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from remote_loader.errors import DecodeError
from remote_loader.pipeline.augment import RandomResizedCrop
from remote_loader.synthetic import SyntheticImages


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return 10 * np.log10(255**2 / max(mse, 1e-12))


def test_output_shape_dtype_and_box_bounds():
    crop = RandomResizedCrop(64, seed=0)
    for _ in range(200):
        left, top, right, bottom = crop.box(500, 375)
        assert 0 <= left < right <= 500 and 0 <= top < bottom <= 375
    out = crop.decode(SyntheticImages(1)[0][0])
    assert out.shape == (3, 64, 64) and out.dtype == torch.uint8


def test_reduced_decoding_stays_close_to_the_plain_path():
    data = [SyntheticImages(8, size=(800, 600))[i][0] for i in range(8)]
    plain = RandomResizedCrop(64, scale=(0.5, 1.0), flip=False, reduced=False, seed=3)
    fast = RandomResizedCrop(64, scale=(0.5, 1.0), flip=False, reduced=True, seed=3)  # same boxes
    values = [psnr(plain.decode(d), fast.decode(d)) for d in data]
    assert min(values) > 25  # close, not identical: DCT scaling instead of a full decode
    assert max(values) < 80  # the reduced path really ran


def test_labels_pass_through_and_bad_bytes_raise():
    crop = RandomResizedCrop(32)
    assert crop("cls", b"3") == b"3"
    with pytest.raises(DecodeError):
        crop("jpg", b"nope")
