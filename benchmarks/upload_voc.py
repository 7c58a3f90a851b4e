"""Upload rate of a VOC-like dataset of real JPEG files, against another checkout.

torchvision's VOCSegmentation hands over ``Image.open(jpg).convert("RGB")`` and the PNG mask
as opened: the upload either encodes the image again (a second JPEG) or, finding the file it
came from, stores the file's own bytes after decoding and comparing it. This times the upload
of such a dataset in one process (``workers=0``: the CPU an image costs, no pool) to a local
directory (no server: the encode or compare is what differs), alternating between this
checkout and ``--against``'s, each run a fresh process, and prints the medians and the share
of image members byte-identical to their files.

    python benchmarks/upload_voc.py --images 300 --repeats 5 --against ../base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent


def write_files(root: Path, n: int, size: tuple[int, int]) -> None:
    """``n`` photo-like JPEGs (smooth gradients, edges and noise, quality 90) and P masks."""
    rng = np.random.default_rng(0)
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    for i in range(n):
        base = np.stack([(x * (i % 7 + 1) + y) % 256, (y * 2 + i) % 256, (x + y * (i % 5)) % 256], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"{i:06d}.jpg", quality=90)
        mask = np.zeros((height, width), np.uint8)
        mask[height // 4:3 * height // 4, width // 5:(2 + i % 3) * width // 5] = 1 + i % 20
        Image.fromarray(mask).convert("P").save(root / f"{i:06d}.png")


class VOCLike:
    """As torchvision's VOCSegmentation reads its files."""

    def __init__(self, root: str, n: int) -> None:
        self.root, self.n = root, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        image = Image.open(os.path.join(self.root, f"{i:06d}.jpg")).convert("RGB")
        return image, Image.open(os.path.join(self.root, f"{i:06d}.png"))


def child(root: str, n: int) -> dict[str, Any]:
    from remote_loader import LocalStore, upload_cv_dataset

    with tempfile.TemporaryDirectory() as out:
        store = LocalStore(out)
        store.create_bucket("b")
        started = time.perf_counter()
        upload_cv_dataset(VOCLike(root, n), client=store, bucket="b", base_folder="voc", workers=0, progress=False,
                          maxcount=100)
        seconds = time.perf_counter() - started
        from remote_loader import RemoteDataset

        same = sum(bytes(s["0.jpg"]) == Path(root, f"{int(s['__key__']):06d}.jpg").read_bytes()
                   for s in RemoteDataset(store, "b", "voc") if "0.jpg" in s)
    return {"images_per_s": n / seconds, "seconds": seconds, "byte_identical": same / n}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--size", type=int, nargs=2, default=(500, 375))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", help="another checkout, measured alternating with this one")
    parser.add_argument("--json", help="write the runs and medians here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    rows = [("this", str(HERE.parent))] + ([(f"against {Path(args.against).name}", args.against)] if args.against
                                           else [])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in rows}
    with tempfile.TemporaryDirectory() as root:
        write_files(Path(root), args.images, tuple(args.size))
        for repeat in range(args.repeats):
            for name, checkout in rows:
                env = {**os.environ, "PYTHONPATH": checkout}
                done = subprocess.run([sys.executable, __file__, "--child", root, str(args.images)], env=env,
                                      capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[name].append(result)
                print(f"[{repeat + 1}/{args.repeats}] {name:<24} {result['images_per_s']:7.1f} images/s"
                      f"  byte-identical {result['byte_identical']:.0%}", flush=True)
    medians = {name: statistics.median(r["images_per_s"] for r in results) for name, results in runs.items()}
    print(f"\nmedians of {args.repeats}, {args.images} JPEGs of {args.size[0]}x{args.size[1]} with P masks,"
          " workers=0, to a local directory")
    for name, value in medians.items():
        ratio = f" ({value / medians['this']:.2f}x this)" if name != "this" else ""
        print(f"| {name} | {value:,.1f} images/s{ratio} | byte-identical {runs[name][0]['byte_identical']:.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
