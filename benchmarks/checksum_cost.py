"""What crc32 verification costs: bytes-only streaming with and without it, alternating runs.

    python benchmarks/checksum_cost.py --images 4000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics

from remote_loader import bench, upload_cv_dataset
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with EmbeddedS3(buckets=["bench"]) as server:
        client = server.client()
        upload_cv_dataset(SyntheticImages(args.images), client=client, bucket="bench", base_folder="ds",
                          maxsize=64e6, workers=2, progress=False)
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for verify in (True, False):
                rates[verify].append(
                    bench.run(client, "bench", "ds", workers=args.workers, verify=verify).samples_per_s
                )
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        print(
            f"bytes only, {args.images} images: verify on {on:.0f} samples/s, off {off:.0f} samples/s,"
            f" ratio {on / off:.3f}"
        )


if __name__ == "__main__":
    main()
