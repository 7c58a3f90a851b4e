"""Where the memory of scenario B goes: the suite's leanest set-up (decode + random-resized-crop
224 on 2 stage threads, no DataLoader workers, a 1,000-sample shuffle buffer) from SeaweedFS,
then the same with one setting changed at a time, each run a fresh process whose own RSS is
sampled every 10 ms.

    python benchmarks/memory.py [--images 4000] [--repeats 3] [--against CHECKOUT]

``--against`` runs every set-up a second time, alternating, with the remote_loader of another
checkout (a ``git worktree`` of an earlier commit): a before and after in one run.
``--allocator`` runs the suite's set-up under glibc malloc settings instead (a fixed mmap
threshold, a fixed trim threshold), which return freed memory sooner at a cost in page faults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "suite"))

import data  # noqa: E402
import servers  # noqa: E402
import systems  # noqa: E402

_CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    sys.path.insert(0, sys.argv[3])
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    import torch.utils.data
    import remote_loader
    from remote_loader import FetchConfig, RandomResizedCrop, RemoteDataset, make_client
    from augment import stack_batch
    imported, peak, done = rss(), [0.0], threading.Event()
    def sample():
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss())
    threading.Thread(target=sample, daemon=True).start()
    setup = json.loads(sys.argv[1])
    client = make_client(os.environ["BENCH_ENDPOINT"], os.environ["BENCH_ACCESS_KEY"], os.environ["BENCH_SECRET_KEY"])
    ds = RemoteDataset(client, os.environ["BENCH_BUCKET"], sys.argv[2], seed=0, rank=0, world_size=1,
                       fetch=FetchConfig(**setup.get("fetch", {})))
    stream = ds.shuffle(setup.get("shuffle", 1000))
    if setup.get("decode", True):
        stream = stream.decode(RandomResizedCrop(224), threads=2).to_tuple("jpg", "cls").batched(64, stack_batch)
    else:
        stream = stream.to_tuple("jpg", "cls").batched(64)
    started, samples = time.perf_counter(), 0
    for batch in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=0):
        samples += len(batch[1])
    seconds = time.perf_counter() - started
    done.set()
    print(json.dumps({"imported_mb": imported, "peak_mb": max(peak[0], rss()), "images_s": samples / seconds,
                      "from": os.path.dirname(os.path.dirname(remote_loader.__file__))}))
""")

SETUPS = (
    ("as in the suite (defaults, shuffle(1000))", {}, {}),
    ("MALLOC_ARENA_MAX=2", {}, {"MALLOC_ARENA_MAX": "2"}),
    ("and prefetch_bytes 32 MiB, range_bytes 4 MiB", {"fetch": {"prefetch_bytes": 32 << 20, "range_bytes": 4 << 20}},
     {"MALLOC_ARENA_MAX": "2"}),
    ("and shuffle(100)", {"shuffle": 100, "fetch": {"prefetch_bytes": 32 << 20, "range_bytes": 4 << 20}},
     {"MALLOC_ARENA_MAX": "2"}),
    ("bytes only (no decode), defaults, shuffle(1000)", {"decode": False}, {}),
    ("defaults, no shuffle buffer (shuffle(1))", {"shuffle": 1}, {}),
    ("defaults, FetchConfig(prefetch 8 MiB, ranges and parts 2 MiB)",
     {"fetch": {"prefetch_bytes": 8 << 20, "range_bytes": 2 << 20, "part_size": 2 << 20}}, {}),
    ("both: no shuffle buffer, prefetch 8 MiB, ranges 2 MiB",
     {"shuffle": 1, "fetch": {"prefetch_bytes": 8 << 20, "range_bytes": 2 << 20, "part_size": 2 << 20}}, {}),
)

ALLOCATOR = (
    ("as in the suite (defaults, shuffle(1000))", {}, {}),
    ("MALLOC_MMAP_THRESHOLD_=1048576", {}, {"MALLOC_MMAP_THRESHOLD_": "1048576"}),
    ("MALLOC_MMAP_THRESHOLD_=262144", {}, {"MALLOC_MMAP_THRESHOLD_": "262144"}),
    ("MALLOC_TRIM_THRESHOLD_=4194304", {}, {"MALLOC_TRIM_THRESHOLD_": "4194304"}),
    ("bytes only (no decode), defaults, shuffle(1000)", {"decode": False}, {}),
    ("bytes only, MALLOC_MMAP_THRESHOLD_=1048576", {"decode": False}, {"MALLOC_MMAP_THRESHOLD_": "1048576"}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", help="another checkout's path: its runs alternate with this one's")
    parser.add_argument("--allocator", action="store_true", help="glibc malloc settings instead of loader settings")
    args = parser.parse_args()
    setups = ALLOCATOR if args.allocator else SETUPS
    checkouts = {"": {}} | ({"against": {"PYTHONPATH": args.against}} if args.against else {})
    folder = Path(tempfile.gettempdir()) / "remote-loader-bench-data" / str(args.images)
    items = [(str(p), label) for p, label in data.build(folder, args.images)]
    runs: dict[tuple[str, str], list[dict]] = {(name, c): [] for name, _, _ in setups for c in checkouts}
    with servers.seaweedfs() as (target, _):
        systems.write("remote_loader", items, target, "memory")
        env = {**os.environ, "BENCH_ENDPOINT": target.endpoint, "BENCH_BUCKET": target.bucket,
               "BENCH_ACCESS_KEY": target.access_key, "BENCH_SECRET_KEY": target.secret_key, "OMP_NUM_THREADS": "1"}
        for _ in range(args.repeats):  # set-ups alternate, so drift on the machine touches each alike
            for name, setup, extra in setups:
                for checkout, path in checkouts.items():
                    done = subprocess.run(
                        [sys.executable, "-c", _CHILD, json.dumps(setup), "memory", str(HERE / "suite")],
                        env={**env, **extra, **path}, capture_output=True, text=True, timeout=600,
                        cwd=tempfile.gettempdir())  # not a checkout: "" first on sys.path would import it
                    if done.returncode != 0:
                        raise RuntimeError(done.stderr[-2000:])
                    runs[name, checkout].append(json.loads(done.stdout))
    first = runs[setups[0][0], ""]
    print(f"{args.images} JPEGs (~110 KB), decode + RRC 224 on 2 threads, 0 workers; medians of {args.repeats}\n")
    imported = statistics.median(r["imported_mb"] for r in first)
    print(f"interpreter + torch + remote_loader imported: {imported:.0f} MB\n")
    for checkout in checkouts:
        print(f"remote_loader from {runs[setups[0][0], checkout][0]['from']}{' (against)' if checkout else ''}")
    heads = " | ".join(f"{k} (MB) | {k.replace('peak RSS', 'images/s')}" for k in
                       ["peak RSS"] + (["against: peak RSS"] if args.against else []))
    print(f"\n| set-up | {heads} |\n|---|{'---|---|' * len(checkouts)}")
    for name, _, _ in setups:
        cells = " | ".join(f"{statistics.median(r['peak_mb'] for r in runs[name, c]):.0f} |"
                           f" {statistics.median(r['images_s'] for r in runs[name, c]):,.0f}" for c in checkouts)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
