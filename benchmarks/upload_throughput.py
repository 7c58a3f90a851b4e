"""Upload throughput: an image folder of ~110 KB JPEGs to the embedded S3 server.

Writes N generated JPEGs to a folder tree once (outside the timing), then uploads it with
``upload_cv_dataset`` at each worker count, several times, and reports the median
images/s and MB/s next to the server's own PUT rate for the same bytes in 16 MB objects
(the limit an uploader can approach on this machine). With ``--dask``, the same uploads
also run on a dask.distributed LocalCluster of as many worker processes (one thread each)
on 127.0.0.1, through ``executor=client.get_executor()``.

    python benchmarks/upload_throughput.py --images 2000 --workers 1 2 --repeats 3 [--dask]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from remote_loader import ImageFolder, upload_cv_dataset
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages


def write_tree(root: Path, n: int) -> int:
    ds = SyntheticImages(n, num_classes=10)
    total = 0
    for i in range(n):
        data, label = ds[i]
        folder = root / ds.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.jpg").write_bytes(data)
        total += len(data)
    return total


def put_rate(client, bucket: str, total: int) -> float:
    """MB/s of plain 16 MB PUTs from 2 threads: what the server takes on this machine."""
    blob = bytes(16 * 2**20)
    count = max(1, total // len(blob))
    started = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: client.put(bucket, f"raw/{i}", blob), range(count)))
    return count * len(blob) / 1e6 / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--maxsize", type=float, default=64e6)
    parser.add_argument("--dask", action="store_true", help="also upload on a Dask LocalCluster")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedS3(buckets=["bench"]) as server:
        total = write_tree(Path(tmp) / "tree", args.images)
        ds = ImageFolder(Path(tmp) / "tree")
        client = server.client()
        print(f"{len(ds)} images, {total / 1e6:.1f} MB, mean {total / len(ds) / 1e3:.0f} KB")
        results = {"images": len(ds), "mb": total / 1e6, "put_mb_per_s": put_rate(client, "bench", total)}
        for workers in args.workers:
            for pool in ("local", "dask") if args.dask else ("local",):
                with _executor(pool, workers) as executor:
                    runs = [upload_cv_dataset(ds, client=client, bucket="bench", base_folder=f"{pool}{workers}-{r}",
                                              maxsize=args.maxsize, workers=workers, executor=executor, progress=False)
                            for r in range(args.repeats)]
                mb = statistics.median(s.mb_per_s for s in runs)
                ips = statistics.median(s.samples_per_s for s in runs)
                results[f"{pool} workers={workers}"] = {"mb_per_s": mb, "images_per_s": ips}
                print(
                    f"{pool} workers={workers}: {ips:.0f} images/s, {mb:.1f} MB/s ({mb / results['put_mb_per_s']:.2f}x"
                    f" the server's PUT rate of {results['put_mb_per_s']:.0f} MB/s)",
                    flush=True,
                )
        print(json.dumps(results, indent=2))


@contextlib.contextmanager
def _executor(pool: str, workers: int) -> Iterator[Any]:
    """None (the uploader's own process pool) or a LocalCluster's executor, closed after."""
    if pool == "local":
        yield None
        return
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"dashboard": False},
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client.get_executor()


if __name__ == "__main__":
    main()
