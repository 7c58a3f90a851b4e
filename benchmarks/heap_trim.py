"""The heap's trim at a pass's start, weighed: many short passes of scenario A (bytes only,
shuffle(1000), batches of 64) in one process from a dataset on tmpfs, each set-up a fresh
process; samples/s, CPU and page faults a sample, peak RSS.

- ``trim``: as the library runs (``malloc_trim`` as each pass starts: the last pass's freed
  samples go back to the OS, and the next pass's shuffle buffer faults them in again);
- ``no trim``: the same without it (the heap fragments over the passes);
- ``no trim, blocks apart`` / ``trim, blocks apart``: with glibc's mmap threshold fixed at
  256 KiB (``read/heap.keep_large_blocks_apart``, as a decoding DataLoader worker runs).

    python benchmarks/heap_trim.py [--images 4000] [--passes 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("trim", "no trim", "no trim, blocks apart", "trim, blocks apart")

_CHILD = """
import json, resource, sys, time
import remote_loader.pipeline.sources.indexed as indexed
from remote_loader import RemoteDataset
from remote_loader.read import heap
from remote_loader.storage.local import LocalStore
root, mode, passes = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode.startswith("no trim"):
    indexed.release_free_memory = lambda: None
if mode.endswith("blocks apart"):
    heap.keep_large_blocks_apart()
ds = (RemoteDataset(LocalStore(root), "heap", "d", seed=0, rank=0, world_size=1)
      .shuffle(1000).to_tuple("jpg", "cls").batched(64, len))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
wall, cpu, n = time.perf_counter(), time.process_time(), 0
for _ in range(passes):
    n += sum(ds)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rate": n / wall, "cpu_us": cpu / n * 1e6, "faults": (usage.ru_minflt - faults) / n,
                  "peak_mb": usage.ru_maxrss / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE / "suite"))
    import data

    from remote_loader import upload_cv_dataset
    from remote_loader.storage.local import LocalStore

    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="heap-trim-", dir=shm if shm.is_dir() else None))
    try:
        (root / "heap").mkdir()
        items = data.build(Path(tempfile.gettempdir()) / "remote-loader-bench-images", args.images)
        upload_cv_dataset(data.Files(items), client=LocalStore(str(root)), bucket="heap", base_folder="d",
                          maxsize=64e6, workers=2, progress=False)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                done = subprocess.run([sys.executable, "-c", _CHILD, str(root), mode, str(args.passes)],
                                      capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(mode, runs[mode][-1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.passes} passes of {args.images:,} images, one process, medians of {args.repeats}\n")
    print("| set-up | samples/s | CPU us a sample | page faults a sample | peak RSS MB |\n|---|---|---|---|---|")
    for mode, rows in runs.items():
        m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {mode} | {m['rate']:,.0f} | {m['cpu_us']:.1f} | {m['faults']:.1f} | {m['peak_mb']:,.0f} |")


if __name__ == "__main__":
    main()
