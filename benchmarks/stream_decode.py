"""Streaming rates with RemoteDataset: bytes only, decode, and decode + random-resized-crop 224
with and without reduced-size JPEG decoding, on ImageNet-sized and on large images.

Each figure is the median of ``--repeats`` runs of ``remote_loader.bench.run`` (what
``remote-loader bench`` runs) against the embedded SeaweedFS server, 2 DataLoader workers.

    python benchmarks/stream_decode.py --images 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics

from remote_loader import bench, upload_cv_dataset
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

RUNS = [("none", None), ("pil", None), ("pil", 128), ("rrc-plain", None), ("rrc", None)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with EmbeddedS3(buckets=["bench"]) as server:
        client = server.client()
        for name, size, count in (
            ("imagenet-sized", (500, 375), args.images),
            ("large", (1600, 1200), args.images // 4),
        ):
            upload_cv_dataset(
                SyntheticImages(count, size=size),
                client=client,
                bucket="bench",
                base_folder=name,
                maxsize=64e6,
                workers=2,
                progress=False,
            )
            for decode, min_size in RUNS:
                label = f"{name} {decode}" + (f" min_size={min_size}" if min_size else "")
                runs = [
                    bench.run(client, "bench", name, decode=decode, min_size=min_size, workers=args.workers)
                    for _ in range(args.repeats)
                ]
                results[label] = {
                    "samples_per_s": statistics.median(r.samples_per_s for r in runs),
                    "first_sample_s": statistics.median(r.first_sample_seconds for r in runs),
                }
                print(f"{label:40s} {results[label]['samples_per_s']:8.0f} samples/s")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
