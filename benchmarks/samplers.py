"""Samplers at scale: time and added RSS before rank 0 of 8 hands out its first 10,000
indices, for datasets of 1k to 1M shards of 1,000 samples (up to a billion samples), each
figure from a fresh process. torch's ``RandomSampler`` (a permutation of every index) is
measured beside ours up to the size it can allocate here.

    python benchmarks/samplers.py [--shards 1000 10000 100000 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

PER_SHARD = 1000
FIRST = 10_000

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    kind, shards, per_shard, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sizes = np.full(shards, per_shard, dtype=np.int64)   # what a RemoteMapDataset's manifest gives
    import torch
    from remote_loader.mapstyle.samplers import LocalitySampler, UniformSampler
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if kind == "locality":
        sampler = LocalitySampler(sizes, window=4, seed=0, rank=0, world_size=8)
    elif kind == "uniform":
        sampler = UniformSampler(shards * per_shard, seed=0, rank=0, world_size=8)
    else:  # torch's, as DistributedSampler and RandomSampler build it: a permutation of every index
        g = torch.Generator().manual_seed(0)
        sampler = torch.randperm(shards * per_shard, generator=g).tolist()
    iterator = iter(sampler)
    indices = [next(iterator) for _ in range(first)]
    seconds = time.perf_counter() - started
    added = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({"seconds": seconds, "mb": added, "unique": len(set(indices))}))
""")


def measure(kind: str, shards: int, repeats: int) -> dict[str, float] | None:
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _CHILD, kind, str(shards), str(PER_SHARD), str(FIRST)],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return None
        runs.append(json.loads(done.stdout))
    return {"seconds": statistics.median(r["seconds"] for r in runs), "mb": statistics.median(r["mb"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-up-to", type=int, default=100_000, help="largest shard count for torch's permutation")
    args = parser.parse_args()
    print(
        f"before the first {FIRST:,} indices of rank 0 of 8, {PER_SHARD:,} samples per shard; medians of {args.repeats}"
    )
    print("| sampler | " + " | ".join(f"{n:,} shards" for n in args.shards) + " |")
    print("|---|" + "---|" * len(args.shards))
    for kind, label in (
        ("locality", "LocalitySampler(window=4)"),
        ("uniform", "UniformSampler"),
        ("torch", "torch.randperm (RandomSampler)"),
    ):
        cells = []
        for shards in args.shards:
            if kind == "torch" and shards > args.torch_up_to:
                cells.append("-")
                continue
            result = measure(kind, shards, args.repeats)
            cells.append("failed" if result is None else f"{result['seconds']:.3f} s, +{result['mb']:.0f} MB")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
