"""An image-folder tree listed as torchvision's ImageFolder lists it, links included, loops not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from remote_loader import ImageFolder, LocalStore, UploadError
from tests.helpers import upload


def _images(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    for i in range(count):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(folder / f"{i}.png")


def test_a_link_to_a_folder_above_is_not_walked_again_at_every_level(tmp_path):
    """A class folder holding a link to itself (``ln -s . again``) or to the tree's root was
    walked again through the link at each level until the path was too deep: every image
    listed about 40 times, the root's other classes' images under this class too (with two
    such links in one folder, 2 to the 40th paths: the listing never ended). A link to a
    folder elsewhere (a tree of links into a shared store) is still followed."""
    _images(tmp_path / "root" / "cat", 2)
    _images(tmp_path / "root" / "dog", 1)
    _images(tmp_path / "shared" / "more", 3)
    (tmp_path / "root" / "cat" / "top").symlink_to("..", target_is_directory=True)
    (tmp_path / "root" / "dog" / "again").symlink_to(".", target_is_directory=True)
    (tmp_path / "root" / "dog" / "more").symlink_to(tmp_path / "shared" / "more", target_is_directory=True)
    ds = ImageFolder(tmp_path / "root")
    listed = sorted((str(Path(path).relative_to(tmp_path / "root")), label) for path, label in ds.samples)
    assert listed == [("cat/0.png", 0), ("cat/1.png", 0), ("dog/0.png", 1), ("dog/more/0.png", 1),
                      ("dog/more/1.png", 1), ("dog/more/2.png", 1)]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this system")
def test_a_named_pipe_named_as_an_image_is_refused_not_waited_on(tmp_path):
    """A FIFO in the tree (``b.jpg``) was opened and read as an image: with no writer, the
    read never returned, in the calling process before any task or stall watch had started.
    It is refused as what it is, and skipped under ``on_error="skip"``."""
    _images(tmp_path / "root" / "cat", 2)
    os.mkfifo(tmp_path / "root" / "cat" / "b.jpg")
    store = LocalStore(tmp_path / "store")
    store.create_bucket("b")
    with pytest.raises(UploadError, match=r"sample 2: '.*b\.jpg' is a named pipe, not a file"):
        upload(store, "b", "d", ImageFolder(tmp_path / "root"))
    summary = upload(store, "b", "d", ImageFolder(tmp_path / "root"), on_error="skip")
    assert summary.samples == 2 and summary.skipped == 1
