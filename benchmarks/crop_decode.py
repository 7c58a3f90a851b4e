"""Decoding only what a random-resized crop keeps: today's simplejpeg path against
libjpeg-turbo's own region decode (``jpeg_skip_scanlines`` above the box,
``jpeg_crop_scanline`` to its columns, nothing below it: what TurboJPEG 3's
``tj3SetCroppingRegion`` does), and against libvips (pyvips), which decodes row by row and
stops below the box; each with the same DCT scaling. CPU-seconds per 1,000 images on one
thread, for the same boxes, and how far each result is from the exact crop (largest
difference in any pixel, 0-255).

The region decode is ``benchmarks/crop_region/crop_region.c``, compiled here with ``cc``
against the system's libjpeg-turbo (Debian: ``apt install gcc libjpeg62-turbo-dev``); it
is also measured decoding whole images, so that the gain is the region's and not a
different libjpeg-turbo build's. Without a compiler or the headers it is left out.

pyvips is not a dependency of remote_loader; this needs ``pip install pyvips pyvips-binary``
(libvips bundled). PyTurboJPEG 2.x needs TurboJPEG 3 (Debian ships 2.1) and decodes no
cropping region, only lossless crops that are then decoded again; imagecodecs' JPEG
decoder takes no region either: neither is measured.

    python benchmarks/crop_decode.py [--images 300] [--size 500x375] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from torch.nn import functional
from torch.utils.data import DataLoader

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


_LIBRARY: ctypes.CDLL | None = None


def region_library() -> ctypes.CDLL:
    """Compile crop_region.c against the system's libjpeg-turbo and load it (once a process)."""
    global _LIBRARY  # noqa: PLW0603 - one build per process, also in DataLoader workers
    if _LIBRARY is not None:
        return _LIBRARY
    source = Path(__file__).parent / "crop_region" / "crop_region.c"
    built = Path(tempfile.mkdtemp(prefix="crop-region-")) / "crop_region.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(built), str(source), "-ljpeg"], check=True,
                   capture_output=True)
    library = ctypes.CDLL(str(built))
    library.decode_region.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    _LIBRARY = library
    return library


def region_decode(data: bytes, box: Box, shrink: int, fast: bool, whole: bool = False) -> tuple[np.ndarray, Box]:
    """Decode ``box`` (full-size coordinates) at 1/``shrink`` scale: the pixels, and the box in them.

    ``whole`` decodes every pixel with the same library and settings, for comparison.
    """
    library = region_library()
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    scaled_width, scaled_height = math.ceil(width / shrink), math.ceil(height / shrink)  # libjpeg's rounding
    wanted = _scaled(box, width, height, np.empty((scaled_height, scaled_width, 0))) if shrink > 1 else box
    # One pixel more on each side: the box's edge pixels are then upsampled from their real
    # neighbours, as in a whole decode, not from a replicated edge.
    left, top, right, bottom = ((0, 0, scaled_width, scaled_height) if whole else
                                (max(0, wanted[0] - 1), max(0, wanted[1] - 1),
                                 min(scaled_width, wanted[2] + 1), min(scaled_height, wanted[3] + 1)))
    pixels = np.empty((bottom - top, scaled_width, 3), np.uint8)
    first, decoded = ctypes.c_int(), ctypes.c_int()
    failed = library.decode_region(data, len(data), shrink, int(fast), left, top, right, bottom,
                                   pixels.ctypes.data, scaled_width * 3, ctypes.byref(first), ctypes.byref(decoded))
    if failed:
        raise ValueError(f"region decode failed ({failed})")
    # Row 0 is the region's top, column 0 its first decoded column (an iMCU boundary).
    x = first.value
    return pixels[:, : decoded.value], (wanted[0] - x, wanted[1] - top, wanted[2] - x, wanted[3] - top)


def region_path(reduced: bool, fast: bool, whole: bool) -> Callable[[bytes, Box, int], torch.Tensor]:
    def run(data: bytes, box: Box, size: int) -> torch.Tensor:
        shrink = _shrink(box, size) if reduced else 1
        return _resize(*region_decode(data, box, shrink, fast, whole), size)
    return run


class RegionCrop(RandomResizedCrop):
    """``RandomResizedCrop`` with the region decode in place of simplejpeg: the same boxes."""

    def _jpeg(self, data: Any, rng: np.random.Generator) -> tuple[np.ndarray, Box]:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        box = self.box(width, height, rng)
        return region_decode(bytes(data), box, _shrink(box, self.size) if self.reduced else 1, self.fast)


def stream(images: SyntheticImages, repeats: int, workers: int) -> None:
    """B (decode + crop 224 + flip, batches of 64, DataLoader workers) from the embedded
    SeaweedFS, with each decoder in turn."""
    from remote_loader import RemoteDataset, upload_cv_dataset  # noqa: PLC0415
    from remote_loader.testing.server import EmbeddedS3  # noqa: PLC0415

    rates: dict[str, list[float]] = {"simplejpeg (today)": [], "region decode": []}
    with EmbeddedS3(buckets=["bench"]) as server:
        client = server.client()
        upload_cv_dataset(images, client=client, bucket="bench", base_folder="b", workers=2, progress=False)
        for _ in range(repeats):
            for name, crop in (("simplejpeg (today)", RandomResizedCrop(224)), ("region decode", RegionCrop(224))):
                pipeline = RemoteDataset(client, "bench", "b", rank=0, world_size=1).decode(crop)
                loader = DataLoader(pipeline.to_tuple("jpg", "cls").batched(64), batch_size=None, num_workers=workers)
                started, count = time.perf_counter(), 0
                for crops, _ in loader:
                    count += len(crops)
                rates[name].append(count / (time.perf_counter() - started))
    today = statistics.median(rates["simplejpeg (today)"])
    print(f"\nB from the embedded SeaweedFS, {len(images)} images, {workers} DataLoader workers, median of {repeats}:")
    for name, runs in rates.items():
        rate = statistics.median(runs)
        print(f"| {name} | {rate:,.0f} images/s | {rate / today:.2f}x |", flush=True)


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
    parser.add_argument("--stream", type=int, default=0, help="also stream B with each decoder: this many images")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for --stream")
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
        region_library()
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"libjpeg-turbo's region decode is left out: it could not be built ({exc})")
    else:
        paths["libjpeg-turbo, whole image, exact"] = region_path(False, False, whole=True)
        paths["libjpeg-turbo, box region, exact"] = region_path(False, False, whole=False)
        paths["libjpeg-turbo, whole image, default (reduced, fast)"] = region_path(True, True, whole=True)
        paths["libjpeg-turbo, box region, default (reduced, fast)"] = region_path(True, True, whole=False)
    try:
        paths["pyvips, rows to the box's bottom, exact"] = vips_path(False)
        paths["pyvips, rows to the box's bottom, DCT-scaled (default)"] = vips_path(True)
    except ImportError:
        print("pyvips is not installed: only simplejpeg is measured")
    exact = [
        paths["simplejpeg, exact (reduced=False, fast=False)"](d, b, args.crop)
        for d, b in zip(data, boxes, strict=False)
    ]
    print(
        f"{args.images} JPEGs of about {args.size} ({sum(map(len, data)) / len(data) / 1e3:.0f} KB),"
        f" random-resized crop {args.crop}, one thread; CPU-seconds per 1,000 images, median of {args.repeats}"
        " rounds, each round running every path in turn"
    )
    costs: dict[str, list[float]] = {name: [] for name in paths}
    outputs: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name, path in paths.items():
            started = time.process_time()
            outputs[name] = [path(d, b, args.crop) for d, b in zip(data, boxes, strict=False)]
            costs[name].append((time.process_time() - started) * 1000 / len(data))
    print("| path | CPU-s per 1,000 | vs simplejpeg, same settings | largest pixel difference from exact |")
    print("|---|---|---|---|")
    for name in paths:
        cost = statistics.median(costs[name])
        settings = "exact (reduced=False, fast=False)" if "exact" in name else "default (reduced, fast)"
        base = statistics.median(costs[f"simplejpeg, {settings}"])
        worst = max(int((a.int() - b.int()).abs().max()) for a, b in zip(outputs[name], exact, strict=False))
        print(f"| {name} | {cost:.2f} | {cost / base:.2f}x | {worst} |", flush=True)
    if args.stream and "libjpeg-turbo, box region, exact" in paths:
        stream(SyntheticImages(args.stream, size=(width, height)), args.repeats, args.workers)


if __name__ == "__main__":
    main()
