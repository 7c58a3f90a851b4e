"""Memory with large targets: samples of two 1920 x 1080 images and a 2 x 1080 x 1920 float32
flow field (16.6 MB) uploaded to the embedded server and streamed back with ``restore``; the
peak RSS of the uploading process and of the reading one, against one sample's size.

    python benchmarks/large_targets.py [--samples 48] [--maxsize 2e8]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from typing import Any

import numpy as np


class Flow:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        from PIL import Image

        rng = np.random.default_rng(index)
        image = Image.fromarray(rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8))
        return image, image, rng.standard_normal((2, 1080, 1920)).astype(np.float32), None


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--maxsize", type=float, default=2e8)
    parser.add_argument("--role", choices=("upload", "read"), help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        from remote_loader import RemoteDataset, make_client, restore, upload_cv_dataset

        client = make_client(args.endpoint, "minioadmin", "minioadmin")
        before = _peak_mb()
        if args.role == "upload":
            client.create_bucket("large")
            upload_cv_dataset(Flow(args.samples), client=client, bucket="large", base_folder="flow",
                              maxsize=args.maxsize, workers=0, progress=False)
        else:
            count = sum(1 for _ in RemoteDataset(client, "large", "flow", seed=0).map(restore))
            assert count == args.samples
        print(f"{args.role}: peak RSS {_peak_mb():,.0f} MB ({before:,.0f} MB after imports)")
        return
    from remote_loader.testing.server import EmbeddedS3

    with EmbeddedS3() as server:
        for role in ("upload", "read"):
            subprocess.run([sys.executable, __file__, "--role", role, "--endpoint", server.endpoint_url,
                            "--samples", str(args.samples), "--maxsize", str(args.maxsize)], check=True)
    print(f"one sample: {2 * 1080 * 1920 * 4 / 1e6:.1f} MB of flow and two 1920 x 1080 images;"
          f" {args.samples} samples, shards of at most {args.maxsize / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
