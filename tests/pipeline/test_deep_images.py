"""Images of more than 8 bits a value (16-bit, 32-bit, float) keep their values when decoded:
8-bit RGB would clip them, silently."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from remote_loader.errors import DecodeError
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.decode import decode_sample

VALUES = (np.arange(32 * 48, dtype=np.int64).reshape(32, 48) * 40)  # up to 61,400: past 8 bits


def _deep(mode: str) -> tuple[str, bytes, np.ndarray]:
    if mode == "I;16":
        image, field = Image.fromarray(VALUES.astype(np.uint16)), "png"
    elif mode == "I;16B":
        image, field = Image.frombytes("I;16B", (48, 32), VALUES.astype(">u2").tobytes()), "tiff"
    elif mode == "I":
        image, field = Image.fromarray(VALUES.astype(np.int32)), "tiff"
    else:
        image, field = Image.fromarray(VALUES.astype(np.float32) / 7), "tiff"
    out = io.BytesIO()
    image.save(out, format=field.upper())
    assert image.mode == mode
    return field, out.getvalue(), np.asarray(image)


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I", "F"])
def test_an_input_image_of_more_than_8_bits_keeps_its_values_in_every_mode(mode: str) -> None:
    field, data, values = _deep(mode)
    sample = {"__key__": "k", "__shard__": "s.tar", field: data, "cls": b"3"}
    image = decode_sample(sample, "pil")[field]
    assert image.mode == mode and np.array_equal(np.asarray(image), values)
    array = decode_sample(sample, "rgb8")[field]
    assert array.shape == (32, 48) and np.array_equal(array, values)
    tensor = decode_sample(sample, "torchrgb")[field]
    assert tuple(tensor.shape) == (32, 48) and np.array_equal(tensor.numpy(), values)
    assert float(tensor.max()) == float(values.max()) > 255


def test_an_8_bit_grayscale_input_image_still_decodes_to_rgb() -> None:
    out = io.BytesIO()
    Image.fromarray((VALUES % 256).astype(np.uint8)).save(out, format="PNG")
    image = decode_sample({"__key__": "k", "png": out.getvalue()}, "pil")["png"]
    assert image.mode == "RGB"


@pytest.mark.parametrize("mode", ["I;16", "F"])
def test_the_fused_crop_refuses_an_image_of_more_than_8_bits_naming_the_sample(mode: str) -> None:
    field, data, _ = _deep(mode)
    with pytest.raises(DecodeError, match=rf"field '{field}' of sample 'k7' in s.tar: a {mode} image, whose values"
                                          r" 8-bit RGB would clip") as caught:
        decode_sample({"__key__": "k7", "__shard__": "s.tar", field: data}, RandomResizedCrop(16),
                      rng=np.random.default_rng(0))
    assert caught.value.key == "k7" and "\n" not in str(caught.value)
