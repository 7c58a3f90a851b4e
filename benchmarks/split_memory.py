"""What the epoch split holds at many shards: today's order against an order by blocks of shards.

    python benchmarks/split_memory.py [--shards 10000000] [--block 4096]

Today (``pipeline/split.py``), each epoch's shard order is a permutation of every shard, and
positions are found through the cumulative sample counts along it: two arrays over all
shards, made in every process that splits the epoch. The alternative measured beside it
permutes blocks of ``--block`` consecutive shards, then each block's shards when a reader
reaches it, with sample counts kept as runs (a full upload is one run of full shards per
task): what a rank of 8 then touches is its share of the blocks. Each part is measured in a
fresh process (RSS added, seconds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from remote_loader.pipeline.split import EpochOrders

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    mode, shards, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tasks = max(1, shards // 4096)  # an upload of 4,096-shard tasks, each ending with a short shard
    values = np.tile(np.array([1000, 17], dtype=np.int64), tasks)
    lengths = np.tile(np.array([shards // tasks - 1, 1], dtype=np.int64), tasks)
    lengths[-2] += shards - int(lengths.sum())
    before, t0 = rss(), time.perf_counter()
    if mode == "today":
        counts = np.repeat(values, lengths)  # what the reader holds today: one count per shard
        order, ends = EpochOrders().get(counts, 0, 0, True, keep=True)
        touched = 1.0
    else:
        starts = np.concatenate([[0], np.cumsum(lengths)])
        totals = np.concatenate([[0], np.cumsum(values * lengths)])

        def before_shard(x):  # samples in shards [0, x)
            run = np.minimum(np.searchsorted(starts, x, side="right") - 1, len(values) - 1)
            return totals[run] + (x - starts[run]) * values[run]

        edges = np.minimum(np.arange(0, shards + block, block), shards)
        blocks = np.diff(before_shard(edges))
        order = np.random.default_rng([0, 0]).permutation(len(blocks))
        ends = np.cumsum(blocks[order])
        total = int(ends[-1])
        first, last = np.searchsorted(ends, [3 * total // 8, 4 * total // 8 - 1], side="right")
        touched = (int(last) - int(first) + 1) / len(blocks)
        k = int(order[first])  # the first block rank 3 of 8 reads: its shards' order and counts
        inner = np.random.default_rng([0, 0, k]).permutation(int(edges[k + 1] - edges[k])) + edges[k]
        _ = before_shard(inner + 1) - before_shard(inner)
    print(json.dumps({"seconds": time.perf_counter() - t0, "rss_mb": rss() - before, "rank_3_of_8_touches": touched}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000_000)
    parser.add_argument("--block", type=int, default=4096)
    args = parser.parse_args()
    print(f"| {args.shards:,d} shards | seconds | RSS added | share of the per-shard rows rank 3 of 8 touches |")
    print("|---|---|---|---|")
    for mode, label in (("today", "today: a permutation of every shard"),
                        ("blocks", f"blocks of {args.block:,d} shards, counts as runs")):
        out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(args.shards), str(args.block)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout)
        print(f"| {label} | {row['seconds']:.3f} | {row['rss_mb']:.0f} MB | {row['rank_3_of_8_touches']:.3f} |")


if __name__ == "__main__":
    main()
