"""Encoding one (image, target) item: accepted types, kept bytes, and errors naming the sample."""

from __future__ import annotations

import enum
import io
import json
import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from remote_loader.errors import ConfigError, UploadError
from remote_loader.upload.encode import EncodeOptions, encode_item

PNG = EncodeOptions(image_format="png")


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def test_encoded_bytes_and_files_keep_their_bytes(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (1, 2, 3)).save(buf, format="PNG")
    data = buf.getvalue()
    path = tmp_path / "x.png"
    path.write_bytes(data)
    assert encode_item((data, 3), EncodeOptions(), 0) == {"png": data, "cls": b"3"}
    assert encode_item((str(path), 3), EncodeOptions(), 0)["png"] == data
    assert encode_item((path, 3), EncodeOptions(), 0)["png"] == data


def test_in_memory_images_are_encoded_losslessly_with_png():
    rgb = np.random.default_rng(0).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    assert np.array_equal(pixels(encode_item((rgb, 0), PNG, 0)["png"]), rgb)
    assert np.array_equal(pixels(encode_item((Image.fromarray(rgb), 0), PNG, 0)["png"]), rgb)
    chw = torch.from_numpy(rgb).permute(2, 0, 1)
    assert np.array_equal(pixels(encode_item((chw, 0), PNG, 0)["png"]), rgb)
    gray = rgb[:, :, 0]
    assert np.array_equal(pixels(encode_item((gray, 0), PNG, 0)["png"]), gray)


@pytest.mark.parametrize(
    "fmt, field, magic", [("jpeg", "jpg", b"\xff\xd8"), ("webp", "webp", b"RIFF"), ("png", "png", b"\x89PNG")]
)
def test_image_format_and_quality(fmt, field, magic):
    image = Image.new("RGB", (32, 32), (200, 10, 10))
    fields = encode_item((image, 1), EncodeOptions(image_format=fmt, quality=80), 0)
    assert fields[field].startswith(magic)


@pytest.mark.parametrize(
    "target, expected",
    [
        (7, {"cls": b"7"}),
        (np.int64(12), {"cls": b"12"}),
        ("a cat", {"txt": b"a cat"}),
        (None, {}),
    ],
)
def test_targets(target, expected):
    image = Image.new("L", (4, 4))
    fields = encode_item((image, target), PNG, 0)
    fields.pop("png")
    assert fields == expected


class Label(enum.IntEnum):
    CAT = 0
    DOG = 1
    __str__ = enum.Enum.__str__  # str() of an IntEnum member on Python 3.10: 'Label.DOG'


class Shown(int):
    def __str__(self) -> str:
        return f"class {int(self)}"


@pytest.mark.parametrize("target", [Label.DOG, Shown(1)])
def test_an_int_subclass_label_is_stored_as_its_digits_whatever_its_str(target):
    """``cls`` holds ASCII digits, which every read decodes: never the label's own text."""
    fields = encode_item((Image.new("L", (4, 4)), target), PNG, 0)
    assert fields["cls"] == b"1"
    fields = encode_item((Image.new("L", (4, 4)), {"label": target}), PNG, 0)
    assert fields["json"] == b'{"label": 1}'


def test_a_bool_target_is_no_class_index_but_json():
    """FORMAT.md: ``cls`` holds an int, not a bool; a bool goes by the field rule, as JSON."""
    fields = encode_item((Image.new("L", (4, 4)), True), PNG, 0)
    assert sorted(fields) == ["0.png", "1.json"] and fields["1.json"] == b"true"


def test_a_tensor_target_is_stored_as_a_tensor_even_of_one_value():
    fields = encode_item((Image.new("L", (4, 4)), torch.tensor([5])), PNG, 0)
    assert sorted(fields) == ["0.png", "1.json", "1.npy"] and fields["1.json"] == b'"torch"'
    assert np.load(io.BytesIO(fields["1.npy"])).tolist() == [5]


def test_dict_target_is_json():
    fields = encode_item((Image.new("L", (4, 4)), {"label": 3, "score": 0.5, "name": "x"}), PNG, 0)
    assert json.loads(fields["json"]) == {"label": 3, "score": 0.5, "name": "x"}


@pytest.mark.parametrize(
    "item, message",
    [
        ((b"not an image", 1), "sample 5: image bytes is not an image"),
        (("/no/such/file.jpg", 1), "sample 5: cannot read '/no/such/file.jpg'"),
        ((np.zeros((4, 4, 2), np.uint8), 1), "sample 5: image array has shape"),
        ((3.5, 1), "sample 5: image is a float"),
        ((Image.new("L", (4, 4)), {"a": float("nan")}), "sample 5: target['a'] is nan: JSON holds finite numbers"),
        ((Image.new("L", (4, 4)), {1: 2}), "sample 5: target has the key 1"),
        (Image.new("L", (4, 4)), "expected an (image, target) pair"),
        ((Image.new("HSV", (4, 4)), 1), "sample 5: image is a HSV image, which no image format stores"),
    ],
)
def test_bad_items_name_the_sample(item, message):
    options = EncodeOptions() if "RGBA" in message else PNG
    with pytest.raises(UploadError, match=re.escape(message)) as info:
        encode_item(item, options, 5)
    assert info.value.index == 5 and "\n" not in str(info.value)


def test_floats_in_the_images_place_are_stored_as_their_values_not_as_pixels():
    """``ToTensor``'s output (float CHW in [0, 1]) or a float array: no image format holds it,
    and 8-bit pixels would alter it; it goes by the field rule, as the array it is."""
    values = np.linspace(0, 1, 48, dtype=np.float32).reshape(3, 4, 4)
    fields = encode_item((torch.from_numpy(values), 2), PNG, 0)
    assert sorted(fields) == ["0.json", "0.npy", "1.cls"] and fields["0.json"] == b'"torch"'
    assert np.array_equal(np.load(io.BytesIO(fields["0.npy"])), values)
    fields = encode_item((values.transpose(1, 2, 0), "a"), PNG, 0)
    assert sorted(fields) == ["0.npy", "1.txt"]
    assert np.array_equal(np.load(io.BytesIO(fields["0.npy"])), values.transpose(1, 2, 0))


def test_bad_options():
    with pytest.raises(ConfigError):
        EncodeOptions(image_format="gif")
    with pytest.raises(ConfigError):
        EncodeOptions(quality=0)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (its data is not that image's)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_an_image_past_pillows_pixel_limit_names_the_sample():
    """A scan or panorama past twice Pillow's ``MAX_IMAGE_PIXELS``: Pillow refuses to open it
    (``DecompressionBombError``); the upload names the sample (``on_error="skip"`` skips it)."""
    with pytest.raises(UploadError, match=re.escape("sample 5: image bytes is larger than Pillow's MAX_IMAGE_PIXELS"
                                                    " allows")) as info:
        encode_item((_png_header(20000, 10000), 1), PNG, 5)
    assert info.value.index == 5 and "\n" not in str(info.value)


def test_text_that_is_not_utf8_names_the_sample():
    """A file name ``os.listdir`` decoded with surrogateescape (a Latin-1 name) as a target."""
    name = b"caf\xe9.jpg".decode("utf-8", "surrogateescape")
    for target in (name, {"file": name}, [name]):
        with pytest.raises(UploadError, match=r"^sample 5: a str of ds\[5\] is not UTF-8 text") as info:
            encode_item((Image.new("L", (4, 4)), target), PNG, 5)
        assert info.value.index == 5 and "\n" not in str(info.value)


@pytest.mark.parametrize("mode, field", [("RGB", "ppm"), ("L", "ppm")])
def test_netpbm_files_keep_their_bytes(tmp_path, mode, field):
    """GTSRB's images are ``.ppm`` files (``.pgm`` for grey ones): kept as they are, as
    ``ImageFolder`` lists them and ``decode`` reads them."""
    path = tmp_path / ("x.ppm" if mode == "RGB" else "x.pgm")
    Image.new(mode, (8, 6), 7).save(path)
    assert encode_item((str(path), 3), PNG, 0) == {field: path.read_bytes(), "cls": b"3"}


def _jpeg(progressive: bool = False) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(
        buffer, "JPEG", progressive=progressive)
    return buffer.getvalue()


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("data", [_jpeg()[:-200], _jpeg(progressive=True)[:-300], _jpeg()[:-2], _png()[:-400],
                                  _png()[:-40]], ids=["jpeg", "progressive", "jpeg-no-eoi", "png", "png-data-end"])
def test_a_truncated_file_is_refused_naming_the_sample(tmp_path, data):
    """A file cut short by a failed copy: torchvision's ``ds[i]`` raises on it; the upload, which
    reads files itself, names it (``on_error="skip"`` skips it) rather than store what every
    epoch would then fail to decode."""
    path = tmp_path / "cut"
    path.write_bytes(data)
    for item in ((data, 1), (str(path), 1), {"image": data, "label": 3}, (data, [1, 2]), (1, data)):
        with pytest.raises(UploadError, match=r"^sample 5: .* is not a whole (JPEG|PNG): it (ends|has no)") as info:
            encode_item(item, PNG, 5)
        assert info.value.index == 5 and "\n" not in str(info.value)
    with pytest.raises(OSError):
        Image.open(io.BytesIO(data)).load()  # what a decoder makes of it


@pytest.mark.parametrize("data", [_jpeg(), _jpeg(progressive=True), _jpeg() + b"\0" * 64, _jpeg() + b"\xff\xda\x01",
                                  _png(), _png() + b"pad", _png()[:-12], _png()[:-14]],
                         ids=["jpeg", "progressive", "jpeg-padded", "jpeg-trailer-with-markers", "png", "png-padded",
                              "png-no-iend", "png-short-crc"])
def test_whole_files_are_kept_padding_and_all(data):
    """What decoders read whole is kept: a PNG without its IEND chunk or with its last crc cut
    short too, which Pillow reads."""
    Image.open(io.BytesIO(data)).load()
    field = "png" if data.startswith(b"\x89PNG") else "jpg"
    assert encode_item((data, 1), PNG, 0) == {field: data, "cls": b"1"}
    assert encode_item({"image": data, "blob": b"\0\1"}, PNG, 0) == {f"image.{field}": data, "blob.bin": b"\0\1"}


def test_a_tv_tensor_image_in_a_pair_comes_back_as_itself():
    """``v2.ToImage()`` hands over a ``tv_tensors.Image``: in an (image, label) pair as in a
    longer tuple it is stored as its values, and comes back as that tv_tensor, unchanged (not
    a JPEG of it, which would come back a PIL image with other values)."""
    from remote_loader import restore
    from tests.helpers import vision

    vision()
    from torchvision import tv_tensors

    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 24, 32), dtype=np.uint8))
    for item in ((tv_tensors.Image(pixels), 4), (tv_tensors.Image(pixels), 4, "a caption")):
        back = restore({**encode_item(item, EncodeOptions(), 0), "__key__": "0"})
        assert type(back[0]) is tv_tensors.Image and torch.equal(back[0], pixels) and back[1] == 4


@pytest.mark.parametrize("value, where, kind", [
    (np.ma.array([1.5, -9999.0, 3.0], mask=[False, True, False]), "target['depth']", "MaskedArray"),
    (np.ma.array(np.zeros((4, 4, 3), np.uint8), mask=True), "image", "MaskedArray"),
    (np.ma.array(np.zeros((4, 4, 3), np.float32)), "image", "MaskedArray"),
    ("matrix", "target['depth']", "matrix"),
    (np.zeros(3).view(np.recarray), "target['depth']", "recarray"),
])
def test_an_array_subclass_that_would_come_back_a_plain_array_is_refused_naming_the_sample_and_field(value, where,
                                                                                                      kind):
    """A masked array's mask, a matrix's class: a shard stores an array's dtype, shape and
    values, so these would come back plain arrays, silently other than they went in."""
    if isinstance(value, str):  # made here: numpy warns of a matrix made, and warnings are errors
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            value = np.asmatrix(np.eye(2))
    item = (value, 1) if where == "image" else (Image.new("L", (4, 4)), {"depth": value})
    with pytest.raises(UploadError, match=rf"^sample 5: {re.escape(where)} is a numpy {kind}") as info:
        encode_item(item, PNG, 5)
    assert info.value.index == 5 and "\n" not in str(info.value)
    frames = np.ma.array(np.zeros((2, 16, 16, 3), np.uint8))
    with pytest.raises(UploadError, match=r"^sample 5: target\['clip'\] is a numpy MaskedArray"):
        encode_item((Image.new("L", (4, 4)), {"clip": frames}), EncodeOptions(frames_as_video="lossless"), 5)


def test_a_memory_mapped_array_is_stored_as_its_values(tmp_path):
    """``np.load(mmap_mode="r")`` hands over ``np.memmap``: a file's values, all of them kept."""
    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float32))
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
    fields = encode_item((Image.new("L", (4, 4)), {"depth": mapped}), PNG, 5)
    assert np.array_equal(np.load(io.BytesIO(fields["1.depth.npy"])), mapped)


@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp"])
@pytest.mark.parametrize("size, mode", [((0, 0), "RGB"), ((0, 5), "RGB"), ((4, 0), "L"), ((0, 0), "RGBA")])
def test_an_empty_image_is_refused_naming_the_sample_and_field_in_every_format(fmt, size, mode):
    """A crop of nothing: WebP's encoder raised a bare MemoryError that named no sample, and
    that ``on_error="skip"`` let through."""
    options = EncodeOptions(image_format=fmt)
    for item, where in (((Image.new(mode, size), 1), "image"), ({"mask": Image.new(mode, size)}, "item['mask']")):
        with pytest.raises(UploadError, match=rf"^sample 5: {re.escape(where)} is an empty image \({size[0]} x"
                                              rf" {size[1]}\): no image format stores one") as info:
            encode_item(item, options, 5)
        assert info.value.index == 5 and "\n" not in str(info.value)


def test_an_empty_image_is_skipped_under_skip(tmp_path):
    from remote_loader import LocalStore
    from tests.helpers import upload

    class Cropped:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int):
            return Image.new("RGB", (0, 0) if index == 1 else (8, 8)), index

    store = LocalStore(str(tmp_path))
    store.create_bucket("b")
    summary = upload(store, "b", "d", Cropped(), image_format="webp", on_error="skip")
    assert summary.samples == 2 and summary.skipped == 1
    assert summary.skip_reasons[0].startswith("sample 1: image is an empty image (0 x 0)")
