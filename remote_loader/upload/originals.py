"""The image files a dataset decoded to build an item, and the original bytes of its images.

torchvision's classes hand over ``Image.open(path).convert("RGB")``: a PIL image, no path.
Encoding it again would turn a JPEG into another JPEG (a second loss) and a PNG into a JPEG.
While ``ds[i]`` runs on an upload's thread, every image file Pillow decodes is noted with a
copy of the pixels it decoded (Pillow's ``ImageFile.load``, wrapped once per process; other
threads and other times pass straight through). An image of the item is stored as that
file's own bytes when it is exactly those pixels, in the same mode and size, with the same
palette and transparency, and the file still opens to that format, mode and size; else it is
encoded as before. Copying and comparing the pixels costs a fraction of the encode it saves;
no file is decoded twice.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageChops, ImageFile, UnidentifiedImageError

_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff",
            "PPM": "ppm"}

_recording = threading.local()
_wrapped: list[Any] = []
_wrap_lock = threading.Lock()


@dataclass(frozen=True)
class Decoded:
    """A file Pillow decoded while an item was read, and a copy of the pixels it gave."""

    path: str
    format: str
    pixels: Image.Image


def _wrap_load() -> None:
    """Wrap ``ImageFile.load`` to note what it decodes while this thread records."""
    original = ImageFile.ImageFile.load

    def load(self: ImageFile.ImageFile) -> Any:
        result = original(self)
        noted = getattr(_recording, "decoded", None)
        path = getattr(self, "filename", None)
        if noted is not None and id(self) not in noted and isinstance(path, str) and path \
                and self.format in _FORMATS and _first_frame(self):
            noted[id(self)] = None  # before the copy, which loads again
            noted[id(self)] = Decoded(path, self.format, self.copy())
        return result

    load.__wrapped__ = original  # type: ignore[attr-defined]
    ImageFile.ImageFile.load = load  # type: ignore[method-assign]
    _wrapped.append(original)


def read_watching(read: Any, index: int) -> tuple[Any, Originals]:
    """``read(index)``, and the image files Pillow decoded for it, on this thread."""
    if not _wrapped:
        with _wrap_lock:
            if not _wrapped:
                _wrap_load()
    _recording.decoded = {}
    try:
        item = read(index)
    finally:
        noted, _recording.decoded = _recording.decoded, None
    return item, Originals([d for d in noted.values() if d is not None])


class Originals:
    """The image files one item was decoded from, matched against its images."""

    def __init__(self, decoded: list[Decoded]) -> None:
        self.decoded = decoded
        self._matched: dict[int, tuple[Image.Image, tuple[str, bytes] | None]] = {}

    def match(self, image: Image.Image) -> tuple[str, bytes] | None:
        """``(field extension, the file's bytes)`` of the file ``image`` is exactly, or None;
        asked again of the same image (the item's digest, then its encoding), the same answer
        without reading the file again."""
        known = self._matched.get(id(image))
        if known is None or known[0] is not image:
            known = self._matched[id(image)] = (image, self._match(image))
        return known[1]

    def _match(self, image: Image.Image) -> tuple[str, bytes] | None:
        """An image opened from a file and not decoded yet (``Image.open(path)`` handed over as
        it is, at its first frame) is that file; one decoded while the item was read, where its pixels are those
        that decode gave; one decoded earlier (a dataset that keeps the images it opened),
        where its file decoded again gives its pixels: never by the file's name alone, as the
        image may have been changed in place since, or the file written over."""
        path = getattr(image, "filename", None) if isinstance(image, ImageFile.ImageFile) else None
        if not _first_frame(image):  # an MPO moved to its second frame: the file decodes to its first
            return None
        if path and isinstance(path, str) and getattr(image, "tile", None):
            kept = _file(path, image.format or "", image)
            if kept is not None and getattr(image, "_exclusive_fp", False):
                image.close()  # the file Image.open(path) holds: decoding would have closed it, now nothing will
            return kept
        for found in self.decoded:
            if _same(found.pixels, image):
                kept = _file(found.path, found.format, image)
                if kept is not None:
                    return kept
        if path and isinstance(path, str) and all(found.path != path for found in self.decoded):
            return _file(path, image.format or "", image, compare=True)
        return None


def _file(path: str, fmt: str, image: Image.Image, compare: bool = False) -> tuple[str, bytes] | None:
    """The bytes of ``path`` where it opens, now, to ``image``'s format, mode and size, one
    frame and no orientation to apply (not drafted, not replaced since it was decoded); with
    ``compare``, only where it decodes to ``image``'s pixels too."""
    if fmt not in _FORMATS:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as now:
            if (now.format, now.mode, now.size) != (fmt, image.mode, image.size) or not _first_frame(now):
                return None
            if now.getexif().get(0x0112, 1) != 1:  # an orientation decoders apply and the pixels did not
                return None
            if compare and not _same(now, image):
                return None
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError):
        return None
    return _FORMATS[fmt], data


def _same(decoded: Image.Image, image: Image.Image) -> bool:
    """Whether two images are the same pixels, in the same mode, with the same palette and transparency."""
    if decoded.mode != image.mode or decoded.size != image.size:
        return False
    if image.mode in ("P", "PA") and decoded.getpalette() != image.getpalette():
        return False
    if decoded.info.get("transparency") != image.info.get("transparency"):
        return False
    if image.mode in ("RGB", "L"):  # compared in C, without copying either out
        return ImageChops.difference(decoded, image).getbbox() is None
    return decoded.tobytes() == image.tobytes()


def _first_frame(image: Image.Image) -> bool:
    """One frame; or an MPO (a phone camera's JPEG) at its first frame, the image every JPEG decoder reads."""
    return getattr(image, "n_frames", 1) == 1 or (image.format == "MPO" and image.tell() == 0)
