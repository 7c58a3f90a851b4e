"""CPU-seconds per 1,000 samples for each stage of a training pipeline, and what they project
for a node with many cores.

Each stage is measured on its own, in this process (``time.process_time``, all threads),
over the same ``--images`` samples streamed from the embedded SeaweedFS on loopback:

- GET: ranged GETs of 8 MiB parts into a buffer (the client side; the server's CPU is
  reported beside it, since here it shares the machine), on 1 and 2 threads;
- read: a bytes-only epoch (``RemoteDataset``, defaults, no DataLoader workers) less the
  GETs: indexes, tar parsing, crc32 of every sample, mixing across shards;
- checksum: crc32 of every sample alone (part of read);
- shuffle: ``.shuffle(1000)`` less the same epoch without it;
- decode, crop: a full JPEG decode (simplejpeg, exact), then the crop's antialiased resize to 224;
- fused: ``RandomResizedCrop(224)`` (defaults: DCT-scaled, fast IDCT), on 1 and 2 threads;
- collate: ``default_collate`` of batches of 64 crops.

    python benchmarks/stage_cost.py [--images 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import simplejpeg
import torch
from torch.nn import functional
from torch.utils.data import default_collate

from remote_loader import RandomResizedCrop, RemoteDataset, upload_cv_dataset
from remote_loader.checksum import crc32
from remote_loader.testing.processes import cpu_seconds
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

PART = 8 << 20


def cost(
    work: Callable[[], object], repeats: int, samples: int, server: int | None = None
) -> tuple[float, float, float]:
    """Median CPU-seconds per 1,000 samples of ``work`` here, and at the server; and its wall rate."""
    here, there, rate = [], [], []
    for _ in range(repeats):
        cpu, wall, served = time.process_time(), time.perf_counter(), cpu_seconds(server) if server else 0.0
        work()
        wall = time.perf_counter() - wall
        here.append((time.process_time() - cpu) * 1000 / samples)
        there.append(((cpu_seconds(server) - served) if server else 0.0) * 1000 / samples)
        rate.append(samples / wall)
    return statistics.median(here), statistics.median(there), statistics.median(rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[tuple[str, float, float, float]] = []
    with EmbeddedS3(buckets=["cost"]) as server:
        client = server.client()
        upload_cv_dataset(
            SyntheticImages(args.images),
            client=client,
            bucket="cost",
            base_folder="d",
            maxsize=64e6,
            workers=2,
            progress=False,
        )
        ds = RemoteDataset(client, "cost", "d", seed=1)
        n = len(ds)
        shards = [
            (ds.reader.location.key(name), int(size))
            for name, size in zip(ds.reader.manifest.shards.names, ds.reader.manifest.shards.size, strict=False)
        ]
        parts = [(key, start, min(start + PART, size)) for key, size in shards for start in range(0, size, PART)]
        buffers = [np.empty(PART, np.uint8) for _ in range(2)]

        def gets(threads: int) -> Callable[[], object]:
            def fetch(i: int) -> None:
                key, start, end = parts[i]
                client.get_range_into("cost", key, start, end, buffers[i % threads].data[: end - start])

            return lambda: list(ThreadPoolExecutor(threads).map(fetch, range(len(parts))))

        for threads in (1, 2):
            rows.append(
                (f"GET, {threads} thread{'s' * (threads > 1)}", *cost(gets(threads), args.repeats, n, server.pid))
            )
        epoch = cost(lambda: sum(1 for _ in ds), args.repeats, n, server.pid)
        rows.append(("read (bytes-only epoch less GET)", epoch[0] - rows[1][1], epoch[1] - rows[1][2], epoch[2]))
        samples = [bytes(s["jpg"]) for s in ds]
        rows.append(("  of which checksum (crc32)", *cost(lambda: [crc32(s) for s in samples], args.repeats, n)))
        shuffled = cost(lambda: sum(1 for _ in ds.shuffle(1000)), args.repeats, n, server.pid)
        rows.append(("shuffle(1000)", shuffled[0] - epoch[0], 0.0, shuffled[2]))

        rrc = RandomResizedCrop(224, seed=0)
        rng = np.random.default_rng(0)
        # Decoded images are dropped as they come (3,000 of them would be 1.7 GB of fresh pages);
        # the crops cycle over the first 200 decoded.
        decoded = [simplejpeg.decode_jpeg(s, colorspace="RGB") for s in samples[:200]]

        def decode_all() -> None:
            for s in samples:
                simplejpeg.decode_jpeg(s, colorspace="RGB")

        def crop_all() -> list[torch.Tensor]:
            return [
                functional.interpolate(
                    torch.from_numpy(decoded[i % 200])[t:b, left:r].permute(2, 0, 1).unsqueeze(0),
                    size=(224, 224),
                    mode="bilinear",
                    antialias=True,
                    align_corners=False,
                )[0]
                for i, (left, t, r, b) in enumerate(
                    rrc.box(decoded[i % 200].shape[1], decoded[i % 200].shape[0], rng) for i in range(n)
                )
            ]

        rows.append(("decode (full, exact)", *cost(decode_all, args.repeats, n)))
        rows.append(("crop (resize the box to 224)", *cost(crop_all, args.repeats, n)))
        for threads in (1, 2):
            fused = (
                (lambda: [rrc.decode(s) for s in samples])
                if threads == 1
                else (lambda: list(ThreadPoolExecutor(threads).map(rrc.decode, samples)))
            )
            rows.append(
                (f"fused RandomResizedCrop(224), {threads} thread{'s' * (threads > 1)}", *cost(fused, args.repeats, n))
            )
        crops = [rrc.decode(s) for s in samples]
        rows.append(
            (
                "collate (batches of 64)",
                *cost(lambda: [default_collate(crops[i : i + 64]) for i in range(0, n, 64)], args.repeats, n),
            )
        )
        client.close()
    size = sum(len(s) for s in samples) / n
    print(f"{n} JPEGs of {size / 1e3:.0f} KB (500x375 +-25%), SeaweedFS on loopback; medians of {args.repeats}")
    print("| stage | CPU-s per 1,000 samples | server CPU-s per 1,000 | samples/s (wall) |\n|---|---|---|---|")
    for name, here, there, rate in rows:
        print(f"| {name} | {here:.3f} | {there:.3f} | {rate:,.0f} |")
    by = {name: here for name, here, _, _ in rows}
    a = by["GET, 2 threads"] + by["read (bytes-only epoch less GET)"]  # the fetcher's GETs run on threads
    b = a + by["shuffle(1000)"] + by["fused RandomResizedCrop(224), 1 thread"] + by["collate (batches of 64)"]
    print(
        f"\nper 1,000 samples, client side: A (bytes only) {a:.3f} CPU-s,"
        f" B (shuffle, fused crop, collate) {b:.3f} CPU-s"
    )
    print("| cores for loading | A samples/s | B samples/s | B bytes/s |\n|---|---|---|---|")
    for cores in (2, 16, 64):
        print(
            f"| {cores} | {cores * 1000 / a:,.0f} | {cores * 1000 / b:,.0f}"
            f" | {cores * 1000 / b * size / 1e9:.2f} GB/s |"
        )


if __name__ == "__main__":
    main()
