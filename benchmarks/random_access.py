"""Random access: samples/s of RemoteMapDataset.__getitems__ batches of 64, and GETs per batch
for the locality-aware sampler at several window sizes against a uniform sampler; and a
first batch with every index still to fetch (median of 5 fresh datasets).

    python benchmarks/random_access.py --images 2000 --maxcount 100 [--profile s3-same-region]

``--profile`` reads through ``shaper.py``'s relay (a round trip per request, a bandwidth
cap per connection). ``--cache`` adds rows read from a node cache (``cache_dir``, in a
temporary directory) once an epoch filled it: uniform batches, and single ``ds[i]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np
from shaper import PROFILES, relayed  # type: ignore[import-not-found]

from remote_loader import make_client, upload_cv_dataset
from remote_loader.mapstyle.dataset import RemoteMapDataset
from remote_loader.mapstyle.samplers import LocalitySampler
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

BATCH = 64


def run(ds: RemoteMapDataset, order: list[int]) -> tuple[float, float]:
    """(samples/s, GETs per batch) over full batches of ``order``."""
    gets, started, count = ds.metrics.gets, time.perf_counter(), 0
    for b in range(0, len(order) - BATCH + 1, BATCH):
        count += len(ds.__getitems__(order[b : b + BATCH]))
    seconds = time.perf_counter() - started
    return count / seconds, (ds.metrics.gets - gets) / (count // BATCH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--maxcount", type=int, default=100)
    parser.add_argument("--profile", choices=["loopback", *sorted(PROFILES)], default="loopback")
    parser.add_argument("--cache", action="store_true", help="also read from a node cache, once an epoch filled it")
    args = parser.parse_args()
    with EmbeddedS3(buckets=["bench"]) as server, relayed(server.endpoint_url, args.profile) as (endpoint, _):
        upload_cv_dataset(SyntheticImages(args.images), client=server.client(), bucket="bench", base_folder="ra",
                          maxcount=args.maxcount, workers=2, progress=False)
        client = make_client(endpoint, server.access_key, server.secret_key)
        cold = []
        for seed in range(5):
            fresh = RemoteMapDataset(make_client(endpoint, server.access_key, server.secret_key), "bench", "ra")
            order = np.random.default_rng(seed).permutation(len(fresh)).tolist()
            started = time.perf_counter()
            fresh.__getitems__(order[:BATCH])
            cold.append(time.perf_counter() - started)
            fresh.reader.client.close()
        ds = RemoteMapDataset(client, "bench", "ra", cache_shards=1000)
        ds.__getitems__(list(range(0, len(ds), args.maxcount)))  # every shard index cached: count sample GETs
        rows = [("uniform", np.random.default_rng(0).permutation(len(ds)).tolist())]
        rows += [(f"locality k={k}", list(LocalitySampler(ds, window=k, seed=0))) for k in (1, 4, 16)]
        print(f"{len(ds)} samples of ~110 KB in {len(ds.reader.manifest.shards)} shards, batches of {BATCH},"
              f" {args.profile}")
        print(f"first batch, every index to fetch: {statistics.median(cold):.3f} s")
        for name, order in rows:
            rate, gets = run(ds, order)
            # Randomness: how many shards a batch draws from (uniform: nearly all of them).
            spread = np.mean([len({ds.locate(i)[0] for i in order[b : b + BATCH]})
                              for b in range(0, len(order) - BATCH + 1, BATCH)])
            print(f"{name:15s} {rate:8.0f} samples/s {gets:6.1f} GETs per batch {spread:5.1f} shards per batch")
        ds.close()
        if args.cache:
            from_cache(client, rows[0][1])
        client.close()


def from_cache(client: object, order: list[int], repeats: int = 3) -> None:
    """Rows from a node cache an epoch filled: uniform batches of ``BATCH``, then ``ds[i]``
    one at a time (medians of ``repeats`` epochs, each a new order)."""
    folder = tempfile.mkdtemp(prefix="random-access-cache-")
    try:
        ds = RemoteMapDataset(client, "bench", "ra", cache_shards=1000, cache_dir=folder)
        run(ds, order)  # fills the cache
        batches, singles = [], []
        for seed in range(1, repeats + 1):
            shuffled = np.random.default_rng(seed).permutation(len(ds)).tolist()
            batches.append(run(ds, shuffled)[0])
            started = time.perf_counter()
            for i in shuffled:
                ds[i]
            singles.append(len(shuffled) / (time.perf_counter() - started))
        print(f"{'node cache':15s} {statistics.median(batches):8.0f} samples/s in batches,"
              f" {statistics.median(singles):8.0f} samples/s by ds[i], {ds.metrics.gets} GETs in all")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
