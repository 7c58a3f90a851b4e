"""What decoding a batch on the device stage costs the thread that decodes it: its CPU
microseconds per image (``time.thread_time``: the Python around the codec, the crop and
resize set-up; the codec's own threads not counted), and the rate, on JPEGs held in memory.

    python benchmarks/device_cost.py [--images 1024] [--batch 256] [--device cpu|cuda]
        [--small] [--repeats 3] [--against CHECKOUT] [--json FILE]

The images are the suite's (``suite/data.py``, made once into a temporary folder), or with
``--small`` generated 48 x 32 JPEGs cropped to 16 x 16. On the CPU (nvImageCodec's CPU
backend, the tests' path) the codec and the resize run in this thread, so on the suite's
images the figures say little; on small ones what is left is mostly the Python around them
per image, which is what bounds a GPU node's main process. ``--against`` runs the same
measurement with the remote_loader of another checkout (its ``DeviceDecoder``,
``EncodedBatch`` and ``prepare``), alternating, each in a fresh process.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "suite"))


def jpegs(count: int, small: bool = False) -> list[bytes]:
    if small:
        from remote_loader.testing.synthetic import SyntheticImages

        images = SyntheticImages(count, size=(48, 32))
        return [images.encoded(i) for i in range(count)]
    import data

    folder = Path(tempfile.gettempdir()) / f"remote-loader-device-cost-{count}"
    return [path.read_bytes() for path, _ in data.build_parallel(folder, count, os.cpu_count() or 1)]


def measure(datas: list[bytes], batch: int, device: str, size: int = 224) -> dict[str, Any]:
    """Decode ``datas`` in batches twice (the first warms up): the second pass's figures."""
    import numpy as np
    import torch

    from remote_loader import RandomResizedCrop
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, prepare

    crop = RandomResizedCrop(size)
    place = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    decoder = DeviceDecoder(crop, place)
    rng = np.random.default_rng(0)
    batches = [EncodedBatch([prepare(crop, d, rng, str(i), "memory") for i, d in enumerate(datas[f : f + batch])])
               for f in range(0, len(datas), batch)]
    if device == "cuda":
        batches = [b.pin_memory() for b in batches]
    for _ in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        started, cpu = time.perf_counter(), time.thread_time()
        for b in batches:
            images, _ = decoder.decode(b)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
    return {"images": len(datas), "rate": len(datas) / seconds, "thread_cpu_us": cpu / len(datas) * 1e6,
            "decoded_on": getattr(decoder, "decoded_on", None), "shape": list(images.shape)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--small", action="store_true", help="48 x 32 JPEGs to 16 x 16 crops")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", help="another checkout, measured alternating with this one")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(measure(jpegs(args.images, args.small), args.batch, args.device, 16 if args.small else 224)))
        return
    if not args.small:
        jpegs(args.images)  # made once, before any timing
    runs: dict[str, list[dict[str, Any]]] = {"this": [], **({"against": []} if args.against else {})}
    for _ in range(args.repeats):
        for name in runs:
            env = dict(os.environ)
            env["PYTHONPATH"] = args.against if name == "against" else str(HERE.parent)
            command = [sys.executable, __file__, "--one", "--images", str(args.images), "--batch", str(args.batch),
                       "--device", args.device, *(["--small"] if args.small else [])]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    result = {name: {"rate": statistics.median(r["rate"] for r in rows),
                     "thread_cpu_us": statistics.median(r["thread_cpu_us"] for r in rows), "runs": rows}
              for name, rows in runs.items()}
    for name, row in result.items():
        print(f"{name:8s} {row['thread_cpu_us']:9.1f} us of the decoding thread's CPU an image,"
              f" {row['rate']:8.1f} images/s (medians of {args.repeats})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
