"""Decoding only what a random-resized crop keeps: today's simplejpeg path against libvips
(pyvips), which decodes a JPEG row by row and stops below the crop box, with the same DCT
scaling. CPU-seconds per 1,000 images on one thread, for the same boxes, and how far each
result is from the exact crop (largest difference in any pixel, 0-255).

pyvips is not a dependency of remote_loader; this needs ``pip install pyvips pyvips-binary``
(libvips bundled). PyTurboJPEG 2.x needs TurboJPEG 3 (Debian ships 2.1) and decodes no
cropping region, only lossless crops that are then decoded again; imagecodecs' JPEG
decoder takes no region either: neither is measured.

    python benchmarks/crop_decode.py [--images 300] [--size 500x375] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import simplejpeg
import torch
from torch.nn import functional

from remote_loader import RandomResizedCrop
from remote_loader.testing.synthetic import SyntheticImages

Box = tuple[int, int, int, int]


def _resize(pixels: np.ndarray, box: Box, size: int) -> torch.Tensor:
    left, top, right, bottom = box
    region = torch.from_numpy(pixels)[top:bottom, left:right].permute(2, 0, 1).unsqueeze(0)
    return functional.interpolate(region, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


def _shrink(box: Box, size: int) -> int:
    factor, shrink = min(box[2] - box[0], box[3] - box[1]) / size, 1
    while shrink < 8 and shrink * 2 <= factor:
        shrink *= 2
    return shrink


def _scaled(box: Box, width: int, height: int, pixels: np.ndarray) -> Box:
    sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
    left, top = int(box[0] * sx), int(box[1] * sy)
    return left, top, max(left + 1, round(box[2] * sx)), max(top + 1, round(box[3] * sy))


def simplejpeg_path(reduced: bool, fast: bool) -> Callable[[bytes, Box, int], torch.Tensor]:
    def run(data: bytes, box: Box, size: int) -> torch.Tensor:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        shrink = _shrink(box, size) if reduced else 1
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fast, fastupsample=fast,
                                        min_width=math.ceil(width / shrink), min_height=math.ceil(height / shrink))
        return _resize(pixels, _scaled(box, width, height, pixels) if shrink > 1 else box, size)
    return run


def vips_path(reduced: bool) -> Callable[[bytes, Box, int], torch.Tensor]:
    import pyvips  # noqa: PLC0415 - optional, only for this comparison

    def run(data: bytes, box: Box, size: int) -> torch.Tensor:
        shrink = _shrink(box, size) if reduced else 1
        image = pyvips.Image.new_from_buffer(data, "", shrink=shrink, access="sequential")
        full = pyvips.Image.new_from_buffer(data, "") if shrink > 1 else image
        width, height = full.width, full.height
        left, top, right, bottom = box
        if shrink > 1:
            left, top, right, bottom = _scaled(box, width, height, np.empty((image.height, image.width, 3)))
        # Only rows down to the box's bottom are decoded; the box is cut out of them.
        rows = image.crop(0, 0, image.width, bottom).numpy()
        return _resize(np.ascontiguousarray(rows), (left, top, right, bottom), size)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--size", default="500x375", help="width x height of the generated JPEGs")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    width, height = (int(v) for v in args.size.split("x"))
    images = SyntheticImages(args.images, size=(width, height))
    data = [images[i][0] for i in range(args.images)]
    rrc, rng = RandomResizedCrop(args.crop, seed=0), np.random.default_rng(0)
    boxes = [rrc.box(*simplejpeg.decode_jpeg_header(d)[1::-1], rng) for d in data]
    paths = {"simplejpeg, exact (reduced=False, fast=False)": simplejpeg_path(False, False),
             "simplejpeg, default (reduced, fast)": simplejpeg_path(True, True)}
    try:
        paths["pyvips, rows to the box's bottom"] = vips_path(False)
        paths["pyvips, rows to the box's bottom, DCT-scaled"] = vips_path(True)
    except ImportError:
        print("pyvips is not installed: only simplejpeg is measured")
    exact = [
        paths["simplejpeg, exact (reduced=False, fast=False)"](d, b, args.crop)
        for d, b in zip(data, boxes, strict=False)
    ]
    base = None
    print(
        f"{args.images} JPEGs of about {args.size} ({sum(map(len, data)) / len(data) / 1e3:.0f} KB),"
        f" random-resized crop {args.crop}, one thread; CPU-seconds per 1,000 images, median of {args.repeats}"
    )
    print("| path | CPU-s per 1,000 | vs exact simplejpeg | largest pixel difference from exact |\n|---|---|---|---|")
    for name, path in paths.items():
        costs = []
        for _ in range(args.repeats):
            started = time.process_time()
            out = [path(d, b, args.crop) for d, b in zip(data, boxes, strict=False)]
            costs.append((time.process_time() - started) * 1000 / len(data))
        cost = statistics.median(costs)
        base = base or cost
        worst = max(int((a.int() - b.int()).abs().max()) for a, b in zip(out, exact, strict=False))
        print(f"| {name} | {cost:.2f} | {cost / base:.2f}x | {worst} |", flush=True)


if __name__ == "__main__":
    main()
