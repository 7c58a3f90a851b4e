"""Random-resized-crop for JPEG bytes, fused with reduced-size decoding.

``RandomResizedCrop(224)`` picks the crop box on the image's full-size coordinates (read
from the header alone), then lets libjpeg decode at the smallest 1/2, 1/4 or 1/8 scale
at which the box still covers ``size`` pixels on both sides, and resizes only the box.
The result differs from a full-size decode followed by the same crop by the DCT scaling
(slightly softer detail); pass ``reduced=False`` for the plain path.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import torch
from PIL import Image

from remote_loader.errors import DecodeError
from remote_loader.pipeline.decode import IMAGE_FIELDS


class RandomResizedCrop:
    """Decode an image field straight to a ``size`` x ``size`` random crop (a uint8 CxHxW tensor).

    Use it as a decoder: ``RemoteDataset(...).decode(RandomResizedCrop(224))``; labels are
    decoded as usual. Same box distribution as torchvision's RandomResizedCrop.

    Args:
        size: Output side in pixels.
        scale: Range of the box's area as a fraction of the image.
        ratio: Range of the box's aspect ratio.
        flip: Flip horizontally with probability 1/2.
        reduced: Decode JPEGs at a reduced scale when the box allows it.
        seed: Seed of the boxes (None: fresh randomness in each process).
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        *,
        flip: bool = True,
        reduced: bool = True,
        seed: int | None = None,
    ) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio
        self.flip, self.reduced, self.seed = flip, reduced, seed
        self._rng: np.random.Generator | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rng": None}  # each worker process draws its own boxes

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """Draw a crop box ``(left, top, right, bottom)`` for an image of this size."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        rng, area = self._rng, width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
                return left, top, left + w, top + h
        w, h = min(width, height), min(width, height)  # fallback: a centred square
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def decode(self, data: Any) -> torch.Tensor:
        """Decode image bytes to a random crop."""
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            left, top, right, bottom = self.box(width, height)
            if self.reduced and image.format == "JPEG":
                factor = min((right - left) / self.size, (bottom - top) / self.size)
                if factor >= 2:
                    image.draft("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
            sx, sy = image.size[0] / width, image.size[1] / height
            crop = image.convert("RGB").resize(
                (self.size, self.size), Image.Resampling.BILINEAR, box=(left * sx, top * sy, right * sx, bottom * sy)
            )
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise DecodeError(f"not a decodable image ({type(exc).__name__})") from None
        if self.flip and self._rng is not None and self._rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(crop).copy()).permute(2, 0, 1)

    def __call__(self, field: str, data: Any) -> Any:
        """Decoder protocol of ``RemoteDataset.decode``: called for image fields."""
        if field.rsplit(".", 1)[-1] in IMAGE_FIELDS:
            return self.decode(data)
        return data
