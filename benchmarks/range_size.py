"""What a decoding pipeline's fetch settings cost the store and the process: the range size
and the prefetch budget, against the server's CPU.

A smaller range holds less memory in each DataLoader worker (``FetchConfig.range_memory``),
and costs the store one more request every ``range_bytes``. This runs the suite's B-fused
pipeline (``shuffle(1000)``, ``decode(RandomResizedCrop(224))``, batches of 64) in one process
from the embedded SeaweedFS on loopback, one epoch a fresh process, each fetch setting in
turn, ``--repeats`` times; medians of its images/s, the CPU of the process and of the server
(all its processes) a sample, its GETs and the process's page faults a sample. The process
fixes its mmap threshold as a decoding DataLoader worker does (``read/heap.py``).

    python benchmarks/range_size.py [--images 4000] [--repeats 3] [--only NAME...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "suite")]

BUCKET, FOLDER = "bench", "d"
MiB = 1 << 20
SETTINGS = {
    "defaults (8 MiB ranges, 128 MiB budget)": {},
    "for_decoding (8 MiB ranges, 32 MiB budget)": {"prefetch_bytes": 32 * MiB, "free_ranges": 0},
    "8 MiB ranges, 32 MiB budget, 2 free kept": {"prefetch_bytes": 32 * MiB},
    "4 MiB ranges, 32 MiB budget": {"prefetch_bytes": 32 * MiB, "range_bytes": 4 * MiB, "free_ranges": 0},
    "2 MiB ranges, 32 MiB budget": {"prefetch_bytes": 32 * MiB, "range_bytes": 2 * MiB, "free_ranges": 0},
}

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {suite!r})
import torch
from augment import BATCH, stack_batch
from remote_loader import FetchConfig, RandomResizedCrop, RemoteDataset, make_client
from remote_loader.read.heap import keep_large_blocks_apart

keep_large_blocks_apart()  # as in a DataLoader worker that decodes

torch.set_num_threads(1)
endpoint, access_key, secret_key, settings = sys.argv[1:5]
ds = RemoteDataset(make_client(endpoint, access_key, secret_key), {bucket!r}, {folder!r}, seed=0,
                   fetch=FetchConfig(**json.loads(settings)))
ds = ds.shuffle(1000).decode(RandomResizedCrop(224)).to_tuple("jpg", "cls").batched(BATCH, stack_batch)
started, cpu, samples = time.perf_counter(), time.process_time(), 0
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for batch in ds:
    samples += len(batch[1])
print(json.dumps({{"samples": samples, "seconds": time.perf_counter() - started,
                  "cpu": time.process_time() - cpu, "gets": ds.metrics.gets,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}}))
"""


def server_cpu(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the runs and medians here")
    parser.add_argument("--only", nargs="+", help="the settings whose names hold one of these")
    args = parser.parse_args()
    settings_run = {name: s for name, s in SETTINGS.items() if not args.only or any(o in name for o in args.only)}
    import data

    from remote_loader import upload_cv_dataset
    from remote_loader.testing.server import EmbeddedS3

    items = data.build(Path(tempfile.gettempdir()) / "remote-loader-bench-images", args.images)

    child = CHILD.format(suite=str(HERE / "suite"), bucket=BUCKET, folder=FOLDER)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in settings_run}
    with EmbeddedS3(buckets=[BUCKET]) as server:
        upload_cv_dataset(data.Files(items), client=server.client(), bucket=BUCKET, base_folder=FOLDER, maxsize=64e6,
                          workers=2, progress=False)
        assert server.pid is not None
        for _ in range(args.repeats):
            for name, settings in settings_run.items():
                before = server_cpu(server.pid)
                done = subprocess.run([sys.executable, "-c", child, server.endpoint_url, server.access_key,
                                       server.secret_key, json.dumps(settings)], capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=900)
                run = json.loads(done.stdout.strip().splitlines()[-1])
                run["server_cpu"] = server_cpu(server.pid) - before
                runs[name].append(run)
                print(name, json.dumps(run), flush=True)
    medians = {}
    print(f"\n{'setting':45} {'images/s':>9} {'process us':>11} {'server us':>10} {'GETs':>6} {'faults':>7}")
    for name, rows in runs.items():
        medians[name] = {
            "rate": statistics.median(r["samples"] / r["seconds"] for r in rows),
            "process_us": statistics.median(r["cpu"] / r["samples"] * 1e6 for r in rows),
            "server_us": statistics.median(r["server_cpu"] / r["samples"] * 1e6 for r in rows),
            "gets": statistics.median(r["gets"] for r in rows),
            "faults_per_sample": statistics.median(r["faults"] / r["samples"] for r in rows),
        }
        m = medians[name]
        print(f"{name:45} {m['rate']:9,.0f} {m['process_us']:11,.0f} {m['server_us']:10,.0f} {m['gets']:6.0f}"
              f" {m['faults_per_sample']:7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"images": args.images, "runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
