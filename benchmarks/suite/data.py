"""The benchmark dataset: ImageNet-like JPEGs made from the photographs shipped in scikit-image.

Each image is a random crop of one photograph, rescaled so its shorter side is 300-500 px,
colour-jittered (brightness, contrast, saturation), given sensor grain and saved as JPEG: mean file size near
110 KB, as in ImageNet's training set. Labels are integers drawn from 0-999. The set is
cached on disk as numbered ``.jpg`` files plus ``labels.json``, the same bytes for every
system.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "camera", "coins", "moon", "grass", "gravel", "brick", "clock", "cell")


PHOTO_FOLDER = "REMOTE_LOADER_BENCH_PHOTOS"
"""An environment variable naming a folder of the photographs as ``<name>.webp`` (lossless):
the node benchmark's bundle carries them so, where scikit-image is not installed."""


def photographs() -> list[Image.Image]:
    folder = os.environ.get(PHOTO_FOLDER)
    if folder:
        return [Image.open(Path(folder) / f"{name}.webp").convert("RGB") for name in PHOTOS]
    import skimage.data

    out = []
    for name in PHOTOS:
        array = getattr(skimage.data, name)()
        image = Image.fromarray(array)
        out.append(image.convert("RGB"))
    return out


SHORTER = (300, 500)
"""The range of an image's shorter side, in pixels (ImageNet-like)."""


def make_image(photo: Image.Image, rng: np.random.Generator, quality: int, shorter: tuple[int, int] = SHORTER) -> bytes:
    width, height = photo.size
    fraction = rng.uniform(0.5, 1.0)
    w, h = max(64, int(width * fraction)), max(64, int(height * fraction * rng.uniform(0.8, 1.2)))
    w, h = min(w, width), min(h, height)
    left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
    scale = int(rng.integers(shorter[0], shorter[1] + 1)) / min(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    image = photo.resize(size, Image.Resampling.BICUBIC, box=(left, top, left + w, top + h))
    image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.7, 1.3))
    image = ImageEnhance.Contrast(image).enhance(rng.uniform(0.7, 1.3))
    image = ImageEnhance.Color(image).enhance(rng.uniform(0.5, 1.5))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # Sensor grain: upscaled crops of small photographs are smoother than camera images.
    array = np.asarray(image, dtype=np.int16)
    grain = rng.normal(0, rng.uniform(6, 12), size=array.shape[:2] + (1,)).astype(np.int16)
    image = Image.fromarray(np.clip(array + grain, 0, 255).astype(np.uint8))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def build(folder: Path, images: int, *, seed: int = 0, quality: int = 95,
          shorter: tuple[int, int] = SHORTER) -> list[tuple[Path, int]]:
    """Write (or reuse) ``images`` JPEGs in ``folder``, each's shorter side in ``shorter``
    (pixels: ``(32, 32)`` for CIFAR-sized samples); return ``(path, label)`` pairs."""
    folder.mkdir(parents=True, exist_ok=True)
    labels_file = folder / "labels.json"
    made = {"images": images, "seed": seed, "quality": quality}
    if shorter != SHORTER:
        made["shorter"] = list(shorter)
    if labels_file.exists():
        stored = json.loads(labels_file.read_text())
        if {k: stored.get(k) for k in (*made, "shorter")} == {"shorter": None, **made}:
            return [(folder / f"{i:07d}.jpg", label) for i, label in enumerate(stored["labels"])]
    rng = np.random.default_rng(seed)
    photos = photographs()
    labels = [int(x) for x in rng.integers(0, 1000, size=images)]
    for i in range(images):
        photo = photos[int(rng.integers(0, len(photos)))]
        (folder / f"{i:07d}.jpg").write_bytes(make_image(photo, rng, quality, shorter))
    labels_file.write_text(json.dumps({**made, "labels": labels}))
    return [(folder / f"{i:07d}.jpg", label) for i, label in enumerate(labels)]


class Files:
    """``(path, label)`` pairs as a dataset of ``(JPEG bytes, label)``: what the benchmarks upload."""

    def __init__(self, items: list[tuple[Path, int]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        return Path(self.items[i][0]).read_bytes(), self.items[i][1]


def _make_range(args: tuple[str, int, int, int, int]) -> list[int]:
    folder, first, stop, seed, quality = args
    photos = photographs()
    labels = []
    for i in range(first, stop):
        rng = np.random.default_rng([seed, i])
        labels.append(int(rng.integers(0, 1000)))
        photo = photos[int(rng.integers(0, len(photos)))]
        (Path(folder) / f"{i:07d}.jpg").write_bytes(make_image(photo, rng, quality))
    return labels


def build_parallel(folder: Path, images: int, processes: int, *, seed: int = 0,
                   quality: int = 95) -> list[tuple[Path, int]]:
    """``build`` on ``processes`` processes: the same generator, each image drawn from a
    generator of its own (seed, index), so any number of processes makes the same files."""
    folder.mkdir(parents=True, exist_ok=True)
    labels_file = folder / "labels.json"
    if labels_file.exists():
        stored = json.loads(labels_file.read_text())
        if stored == {**stored, "images": images, "seed": seed, "quality": quality, "per_image": True}:
            return [(folder / f"{i:07d}.jpg", label) for i, label in enumerate(stored["labels"])]
    from multiprocessing import get_context

    step = max(1, -(-images // (processes * 4)))
    chunks = [(str(folder), a, min(a + step, images), seed, quality) for a in range(0, images, step)]
    with get_context("spawn").Pool(processes) as pool:
        labels = [label for chunk in pool.map(_make_range, chunks) for label in chunk]
    labels_file.write_text(json.dumps({"images": images, "seed": seed, "quality": quality, "per_image": True,
                                       "labels": labels}))
    return [(folder / f"{i:07d}.jpg", label) for i, label in enumerate(labels)]
