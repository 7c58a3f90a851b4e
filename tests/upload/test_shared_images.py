"""Images a dataset opened once and hands out again keep their file's bytes, decoded or not
by the time the upload reads them; an image changed in place since, or whose file changed,
does not."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from remote_loader import DatasetReader
from tests.helpers import upload


def _photo(seed: int, size: tuple[int, int] = (96, 64)) -> np.ndarray:
    """Smooth colours and some grain, as a photograph has."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    base = np.stack([x * 2 + seed * 9, y * 3, (x + y) + seed * 5], axis=-1) % 256
    return np.clip(base + rng.integers(-12, 12, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture
def files(tmp_path):
    """Ten JPEGs and ten PNGs, as a camera and an image editor write them."""
    paths = []
    for i in range(20):
        path = tmp_path / (f"{i:02d}.jpg" if i % 2 == 0 else f"{i:02d}.png")
        Image.fromarray(_photo(i)).save(path, quality=87)
        paths.append(path)
    return paths


class KeptOpen:
    """A dataset that opens each file once (``Image.open``, decoded lazily) and hands the same
    image out every time it is asked: the upload's own passes over the items (its fingerprint,
    its size estimate) decode it before the upload's tasks read it."""

    def __init__(self, images: list[Image.Image]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], index % 3


def _stored(client, bucket, folder):
    return {int(s["__key__"]): {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
            for s in DatasetReader(client, bucket, folder)}


@pytest.mark.parametrize("workers", [0, 2])
def test_images_opened_once_and_handed_out_again_are_stored_as_their_files_bytes(s3, files, workers):
    client, bucket = s3
    upload(client, bucket, f"kept{workers}", KeptOpen([Image.open(p) for p in files]), workers=workers, maxcount=8)
    stored = _stored(client, bucket, f"kept{workers}")
    assert sorted(stored) == list(range(20))
    for i, path in enumerate(files):
        field = "jpg" if path.suffix == ".jpg" else "png"
        assert stored[i][field] == path.read_bytes(), path.name  # not a second JPEG of the decoded pixels
        assert stored[i]["cls"] == str(i % 3).encode()


def test_an_image_changed_in_place_or_whose_file_changed_is_encoded_from_its_pixels(s3, files):
    client, bucket = s3
    images = [Image.open(p) for p in files[:4]]
    images[0].load()
    images[0].putpixel((0, 0), (255, 0, 0))  # decoded, then changed: its file no longer holds its pixels
    images[1].putpixel((5, 5), (0, 0, 255))  # decoded by the change itself
    images[2].load()
    Image.fromarray(_photo(99)).save(files[2], quality=87)  # the file written over since it was decoded
    pixels = [np.asarray(image).copy() for image in images]
    upload(client, bucket, "changed", KeptOpen(images), image_format="png", maxcount=8)
    stored = _stored(client, bucket, "changed")
    for i in range(3):
        assert "png" in stored[i] and stored[i]["png"] != files[i].read_bytes()
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(stored[i]["png"]))), pixels[i])  # its own pixels
    assert stored[3]["png"] == files[3].read_bytes()  # untouched: its file's bytes


def test_a_phone_cameras_jpeg_with_a_preview_frame_is_stored_as_its_files_bytes(s3, tmp_path):
    """A phone camera's JPEG holds a second, preview frame after the image (Pillow opens it as
    MPO). Opened as torchvision's classes open files (``Image.open(path).convert("RGB")``), it
    is kept as the file's bytes, which every JPEG decoder reads as its first frame."""
    client, bucket = s3
    path = tmp_path / "phone.jpg"
    Image.fromarray(_photo(1)).save(path, "MPO", save_all=True, append_images=[Image.fromarray(_photo(2, (40, 30)))])
    with Image.open(path) as opened:
        assert opened.format == "MPO" and opened.n_frames == 2

    class Opened:
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int):
            with Image.open(path) as image:  # as CocoDetection and VOCDetection open theirs
                return image.convert("RGB"), index

    upload(client, bucket, "phone", Opened(), workers=0)
    stored = _stored(client, bucket, "phone")
    assert [stored[i]["jpg"] == path.read_bytes() for i in range(2)] == [True, True]


def test_gtsrbs_ppm_files_opened_as_torchvision_opens_them_are_stored_as_their_bytes(s3, tmp_path):
    """torchvision's GTSRB opens each ``.ppm`` with ``Image.open(path).convert("RGB")``."""
    client, bucket = s3
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i:05d}_00000.ppm")
        Image.fromarray(_photo(i, (30, 32))).save(paths[-1])

    class Signs:
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, index: int):
            return Image.open(paths[index]).convert("RGB"), index

    upload(client, bucket, "signs", Signs(), workers=0)
    stored = _stored(client, bucket, "signs")
    assert [stored[i].get("ppm") == path.read_bytes() for i, path in enumerate(paths)] == [True] * 3


def test_a_phone_cameras_jpeg_moved_to_its_second_frame_is_encoded_as_that_frame(tmp_path):
    """``Image.open(path)`` then ``seek(1)``, handed over undecoded or decoded: the file's bytes
    decode to its first frame, so the frame handed over is encoded from its own pixels."""
    from remote_loader.upload.encode import EncodeOptions, encode_item
    from remote_loader.upload.originals import Originals

    path = tmp_path / "stereo.jpg"
    right = Image.new("RGB", (64, 48), (10, 10, 250))
    Image.new("RGB", (64, 48), (250, 10, 10)).save(path, "MPO", save_all=True, append_images=[right])
    png = EncodeOptions(image_format="png")
    for decoded in (False, True):
        with Image.open(path) as image:
            image.seek(1)
            if decoded:
                image.load()
            fields = encode_item((image, 0), png, 0, Originals([]))
            assert "png" in fields, decoded
            back = np.asarray(Image.open(io.BytesIO(fields["png"])))
            assert np.array_equal(back, np.asarray(image)) and abs(back[5, 5].astype(int) - [10, 10, 250]).max() < 8
    with Image.open(path) as first:
        first.seek(1)
        first.seek(0)
        assert encode_item((first, 0), png, 0, Originals([])) == {"jpg": path.read_bytes(), "cls": b"0"}
