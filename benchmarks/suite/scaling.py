"""How remote_loader's bytes-only rate, time to first batch and memory change with its settings.

- DataLoader workers 1, 2 and 4 on the suite's dataset (64 MB shards);
- shard sizes 16, 64 and 256 MB (the dataset converted again for each);
- manifests of 1k, 10k and 100k one-image shards (8 distinct shard bodies, put under
  every name); the run stops after the first batch and reports time to first batch and
  peak RSS.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from systems import Target

from remote_loader import DatasetReader, make_client, upload_cv_dataset
from remote_loader.format import MANIFEST_NAME
from remote_loader.testing.synthetic import SyntheticImages

Measure = Callable[..., dict[str, Any]]


def _rate(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {"samples_per_s": statistics.median(r["samples"] / r["seconds"] for r in runs),
            "first_batch_seconds": statistics.median(r["first_batch_seconds"] for r in runs),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs)}


def _big_manifests(target: Target, counts: Sequence[int]) -> list[str]:
    client = make_client(target.endpoint, target.access_key, target.secret_key)
    upload_cv_dataset(SyntheticImages(8, size=(96, 72)), client=client, bucket=target.bucket,
                      base_folder="scale-base", maxcount=1, workers=0, progress=False, overwrite=True)
    base = DatasetReader(client, target.bucket, "scale-base").manifest
    blobs = [client.get(target.bucket, f"scale-base/{entry.name}") for entry in base.shards]
    prefixes = []
    with ThreadPoolExecutor(16) as pool:
        for count in counts:
            prefix = f"scale-{count}"
            names = [f"shard-{i:07d}.tar" for i in range(count)]
            list(pool.map(lambda i: client.put(target.bucket, f"{prefix}/{names[i]}", blobs[i % len(blobs)]),
                          range(count)))
            shards = tuple(replace(base.shards[i % len(blobs)], name=names[i]) for i in range(count))
            client.put(target.bucket, f"{prefix}/{MANIFEST_NAME}", replace(base, shards=shards).encode())
            prefixes.append(prefix)
    client.close()
    return prefixes


def run(target: Target, items_file: str, measure: Measure, repeats: int, last_prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {"workers": {}, "shard_mb": {}, "manifest_shards": {}}
    for workers in (1, 2, 4):
        runs = [measure(["epoch", "remote_loader", last_prefix, "A", str(workers)], target) for _ in range(repeats)]
        out["workers"][workers] = _rate(runs)
        print(f"  scaling: {workers} workers {out['workers'][workers]}", flush=True)
    for mb in (16, 64, 256):
        prefix = f"remote_loader-shard{mb}"
        measure(
            ["write", "remote_loader", prefix, items_file], target, extra_env={"BENCH_SHARD_BYTES": str(mb * 1_000_000)}
        )
        runs = [measure(["epoch", "remote_loader", prefix, "A", "2"], target) for _ in range(repeats)]
        out["shard_mb"][mb] = _rate(runs)
        print(f"  scaling: {mb} MB shards {out['shard_mb'][mb]}", flush=True)
    counts = (1_000, 10_000, 100_000)
    for count, prefix in zip(counts, _big_manifests(target, counts), strict=False):
        runs = [measure(["epoch", "remote_loader", prefix, "A-first", "2"], target) for _ in range(repeats)]
        out["manifest_shards"][count] = {k: v for k, v in _rate(runs).items() if k != "samples_per_s"}
        print(f"  scaling: {count} shards {out['manifest_shards'][count]}", flush=True)
    return out
