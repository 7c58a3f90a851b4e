"""Memory of writing a large manifest: an upload's main process gathering every task's
results (``upload.written.Written``) and encoding manifest version 3 (head and pages).

    python benchmarks/manifest_write.py [--tasks 1000000] [--parts 10]

Each task's result arrives as entry objects, as from a worker, and is let go once taken;
the peak RSS above the start is printed after gathering and after encoding.
"""

from __future__ import annotations

import argparse
import resource
import time

from remote_loader.format import Manifest, ShardEntry
from remote_loader.upload.tasks import TaskResult, shard_name
from remote_loader.upload.written import Written

RUN = "0a1b2c3d"


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--parts", type=int, default=10, help="shards a task writes")
    args = parser.parse_args()
    base, started = peak_mb(), time.perf_counter()
    written = Written(RUN)
    for task in range(args.tasks):
        written.add(TaskResult(task, [ShardEntry(shard_name(RUN, task, part), 1000, 1_000_000 + task % 977, 990_000,
                                                 9000, task & 0xFFFF, part) for part in range(args.parts)]))
    gathered = peak_mb()
    table = written.table()
    del written
    head, pages = Manifest(shards=table, fields=("cls",)).encode_parts(f"shard-{RUN}-manifest.pages")
    shards = args.tasks * args.parts
    print(f"{shards:,d} shards: gathered, peak +{gathered - base:.0f} MB ({(gathered - base) * 1e6 / shards:.0f} bytes"
          f" a shard); encoded, peak +{peak_mb() - base:.0f} MB; head {len(head) / 1e3:.0f} kB, pages"
          f" {len(pages or b'') / 1e6:.0f} MB; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
