"""What the epoch split holds at many shards: the order of a version 2 manifest against the
order by blocks of a version 3 manifest.

    python benchmarks/split_memory.py [--shards 10000000] [--block 4096]

A manifest of version 1 or 2 orders an epoch as one permutation of every shard, positions
found through the cumulative sample counts along it: two arrays over all shards, made in
every process that splits the epoch. Version 3 permutes blocks of ``--block`` consecutive
shards (a page's), then each block's shards when a reader reaches it, with sample counts
kept as runs (a full upload is one run of full shards per task): what a rank of 8 then
touches is its share of the blocks. Both are ``format.epoch_order.EpochOrder``; each is measured
in a fresh process (RSS added, seconds), up to rank 3 of 8's first block made.
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
    from remote_loader.format.shard_counts import ArrayCounts, RunCounts
    from remote_loader.format.epoch_order import EpochOrder

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
        counts = ArrayCounts(np.repeat(values, lengths))  # a version 2 manifest: one count per shard
        order = EpochOrder(counts, None, 0, 0, True)
    else:
        order = EpochOrder(RunCounts(values, lengths), block, 0, 0, True)
    total = order.total
    pieces = order.pieces(3 * total // 8, 4 * total // 8)
    touched = len(pieces) / len(order.blocks)
    order.piece(*pieces[0])  # rank 3 of 8's first block: its shards' order and where each ends
    print(json.dumps({"seconds": time.perf_counter() - t0, "rss_mb": rss() - before, "rank_3_of_8_touches": touched}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000_000)
    parser.add_argument("--block", type=int, default=4096)
    args = parser.parse_args()
    print(f"| {args.shards:,d} shards | seconds | RSS added | share of the per-shard rows rank 3 of 8 touches |")
    print("|---|---|---|---|")
    for mode, label in (("today", "version 2: a permutation of every shard"),
                        ("blocks", f"version 3: blocks of {args.block:,d} shards, counts as runs")):
        out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(args.shards), str(args.block)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout)
        print(f"| {label} | {row['seconds']:.3f} | {row['rss_mb']:.0f} MB | {row['rank_3_of_8_touches']:.3f} |")


if __name__ == "__main__":
    main()
