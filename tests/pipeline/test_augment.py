"""The fused random-resized-crop decoder."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
import torch

from remote_loader.errors import DecodeError
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.decode import decode_sample
from remote_loader.pipeline.stages.prepared import prepare
from remote_loader.testing.synthetic import SyntheticImages


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


def test_a_jpeg_past_pillows_pixel_bound_is_refused_before_decoding(monkeypatch):
    """A JPEG's header says its size: one past twice Pillow's ``MAX_IMAGE_PIXELS`` is refused
    as ``decode("rgb8")`` refuses it, by the fused crop (which decoded a 14 MB JPEG of 30000 x
    30000 into 2.7 GB, 4.5 GB of peak RSS with ``reduced=False``) and by a device pipeline's
    worker, before a pixel is decoded. The bound is lowered here to this small image's size."""
    data = SyntheticImages(1)[0][0]
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    monkeypatch.setattr("PIL.Image.MAX_IMAGE_PIXELS", width * height // 2 - 1)
    with pytest.raises(DecodeError, match="DecompressionBombError"):
        decode_sample({"__key__": "a", "jpg": data}, "rgb8")
    for crop in (RandomResizedCrop(32, seed=0), RandomResizedCrop(32, seed=0, reduced=False)):
        with pytest.raises(DecodeError, match="DecompressionBombError"):
            crop.decode(data)
    with pytest.raises(DecodeError, match="past twice Pillow's MAX_IMAGE_PIXELS"):
        prepare(RandomResizedCrop(32), data, np.random.default_rng(0), "a", "memory")
    monkeypatch.setattr("PIL.Image.MAX_IMAGE_PIXELS", (width * height + 1) // 2)  # at the bound: decoded
    assert RandomResizedCrop(32, seed=0).decode(data).shape == (3, 32, 32)


def test_labels_pass_through_and_bad_bytes_raise():
    crop = RandomResizedCrop(32)
    assert crop("cls", b"3") == b"3"
    with pytest.raises(DecodeError):
        crop("jpg", b"nope")


def test_exact_path_matches_pillow_and_fast_path_stays_close():
    """reduced=False, fast=False equals Pillow's decode + bilinear resize of the same box (up to
    rounding); the default fast path stays close to it."""
    import io

    from PIL import Image

    data = [SyntheticImages(6, size=(500, 375), seed=4)[i][0] for i in range(6)]
    exact = RandomResizedCrop(96, flip=False, reduced=False, fast=False, seed=5)
    fast = RandomResizedCrop(96, flip=False, seed=5)
    boxes = RandomResizedCrop(96, seed=5)
    for d in data:
        image = Image.open(io.BytesIO(d)).convert("RGB")
        box = boxes.box(*image.size)
        pillow = torch.from_numpy(np.array(image.resize((96, 96), Image.Resampling.BILINEAR, box=box))).permute(2, 0, 1)
        ours = exact.decode(d)
        assert psnr(pillow, ours) > 40
        assert 30 < psnr(ours, fast.decode(d)) < 80  # close, and not the same code path


def test_png_and_grayscale_inputs_decode_to_rgb():
    png = SyntheticImages(1, size=(80, 60), formats=("png",))[0][0]
    crop = RandomResizedCrop(32, seed=0)
    assert crop.decode(png).shape == (3, 32, 32)
    import io

    from PIL import Image

    gray = io.BytesIO()
    Image.new("L", (64, 48), 128).save(gray, format="JPEG")
    out = crop.decode(memoryview(gray.getvalue()))
    assert out.shape == (3, 32, 32) and int(out.float().mean().round()) == 128


def test_crops_decoded_one_after_another_in_a_thread_are_their_own_and_as_a_fresh_decode_gives(monkeypatch):
    """A thread decodes each JPEG into one buffer it keeps (a fresh array per image left holes in
    a worker's heap): each crop is a tensor of its own, unchanged by the decodes after it, and
    the same as decoding into a fresh array gives, whole-image crops (nothing resized) and images
    too large for the buffer (an array of their own) included."""
    from remote_loader.pipeline.stages import augment

    data = [SyntheticImages(1, size=size, seed=seed)[0][0] for seed, size in ((1, (64, 64)), (2, (640, 480)),
                                                                             (3, (64, 64)), (4, (800, 600)))]
    whole = dict(size=64, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False, seed=0)  # the box is the image
    settings = [whole, dict(size=96, seed=7), whole, dict(size=32, seed=8)]

    def crops() -> list[torch.Tensor]:
        return [RandomResizedCrop(**kw).decode(d) for kw, d in zip(settings, data, strict=True)]

    reused = crops()
    kept = [c.clone() for c in reused]
    crops()
    assert all(torch.equal(a, b) for a, b in zip(reused, kept, strict=True))
    monkeypatch.setattr(augment, "_REUSED", 64 * 64 * 3)  # the first image fits, the others get their own
    assert all(torch.equal(a, b) for a, b in zip(crops(), kept, strict=True))
    monkeypatch.setattr(augment, "_pixel_buffer", lambda size: None)  # every image an array of its own
    assert all(torch.equal(a, b) for a, b in zip(crops(), kept, strict=True))
