"""A generated image dataset, for demos, tests and benchmarks: no download, fully deterministic."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from remote_loader.errors import ConfigError

_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


class SyntheticImages:
    """``n`` images in class order (like an image folder), each built from its index alone.

    Images are smooth colour fields plus grain, so they compress like photographs (about
    110 KB as JPEG at the default 500x375, quality 90).

    Args:
        n: Number of samples.
        num_classes: Labels run ``0..num_classes-1`` in contiguous blocks.
        size: ``(width, height)``; each image varies it by up to ±25%.
        formats: Encodings cycled by index (``"jpeg"``, ``"png"``, ``"webp"``).
        output: ``"bytes"`` (encoded files, stored as they are) or ``"pil"`` (in-memory images).
        seed: Changes every image.
        quality: JPEG/WebP quality of the generated files.

    Examples:
        >>> ds = SyntheticImages(100, num_classes=10)
        >>> data, label = ds[0]
        >>> data[:2] == b"\\xff\\xd8", label
        (True, 0)
    """

    def __init__(
        self,
        n: int,
        *,
        num_classes: int = 10,
        size: tuple[int, int] = (500, 375),
        formats: tuple[str, ...] = ("jpeg",),
        output: str = "bytes",
        seed: int = 0,
        quality: int = 90,
    ) -> None:
        if n < 0 or num_classes < 1:
            raise ConfigError(f"need n >= 0 and num_classes >= 1, got {n}, {num_classes}")
        if not formats or any(f not in _FORMATS for f in formats):
            raise ConfigError(f"formats must be drawn from {sorted(_FORMATS)}, got {formats!r}")
        if output not in ("bytes", "pil"):
            raise ConfigError(f"output must be 'bytes' or 'pil', got {output!r}")
        self.n, self.num_classes, self.size = n, num_classes, size
        self.formats, self.output, self.seed, self.quality = formats, output, seed, quality
        self.classes = [f"class_{i:04d}" for i in range(num_classes)]

    def __len__(self) -> int:
        return self.n

    def label(self, index: int) -> int:
        """The class of sample ``index`` (contiguous blocks, as a folder tree gives them)."""
        return index * self.num_classes // self.n

    def image(self, index: int) -> Image.Image:
        """The image of sample ``index``, as a PIL RGB image."""
        rng = np.random.default_rng([self.seed, index])
        width = int(self.size[0] * rng.uniform(0.75, 1.25))
        height = int(self.size[1] * rng.uniform(0.75, 1.25))
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
        grain = rng.normal(0, 28, size=(height, width, 1)).astype(np.int16)
        return Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8))

    def encoded(self, index: int) -> bytes:
        """The image of sample ``index`` encoded in its format."""
        out = io.BytesIO()
        self.image(index).save(out, format=_FORMATS[self.formats[index % len(self.formats)]], quality=self.quality)
        return out.getvalue()

    def __getitem__(self, index: int) -> tuple[bytes | Image.Image, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        image = self.encoded(index) if self.output == "bytes" else self.image(index)
        return image, self.label(index)
