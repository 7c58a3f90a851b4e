"""How much of a sample's cost holds the GIL, part by part, and what that projects for a node
with many cores.

One Python process runs its Python on one core at a time: whatever holds the GIL (the
source, stages, the S3 client's request code) adds up to a ceiling of ``1 / GIL-seconds per
sample`` for the whole process, however many threads it has; what releases the GIL (socket
reads, crc32, libjpeg-turbo, Pillow's resize) runs beside it on other cores. So a node's
rate is projected from two figures per sample measured here, not from a 2-core run:

- GIL-held seconds: py-spy samples the process (``--gil --nonblocking``) during the epoch
  and counts the samples in which a thread of it holds the GIL; each run also spins pure
  Python for a moment under the same sampler, which gives how many py-spy samples a second
  of held GIL makes. Stacks say which part held it.
- CPU seconds of the process (``time.process_time``) and of its consuming thread.

Rows: the suite's scenarios in one process, stage threads as the suite runs them without
DataLoader workers (as many as cores), and the same without threads (what a DataLoader
worker runs). The projection for a node of ``--cores``:

- one process: ``1 / GIL`` (its ceiling; threads cannot pass it);
- a DataLoader worker: ``1 / max(GIL, consuming thread's CPU)`` without stage threads;
- ``W`` workers: ``min(W x worker, cores / CPU per sample)``, the server's CPU counted
  when it shares the node (``--server-on-node``, as in the node measurements).

    python benchmarks/gil_cost.py [--images 4000] [--repeats 2] [--scenarios A B-fused]
        [--cores 16] [--against CHECKOUT] [--json FILE]

``--against`` runs each row a second time with the remote_loader of another checkout,
alternating. Needs ``py-spy`` (benchmarks/requirements.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "suite"
SHUFFLE = 1000
_CALIBRATE_SECONDS = 0.5

SCENARIOS = {
    "A": "bytes only: shuffle(1000), to_tuple, batched(64) counted in the process",
    "A-noshuffle": "bytes only, no shuffle buffer",
    "B-fused": "shuffle(1000), decode(RandomResizedCrop(224)), to_tuple, batched(64)",
    "B": "shuffle(1000), to_tuple, map(Pillow decode + RRC 224 + flip), batched(64)",
}

# Which part of the process a stack belongs to: the first of these (leaf first) its frames
# name. Matched on file paths as py-spy prints them.
PARTS = (
    ("_calibrate_gil", "calibration"),
    ("botocore", "S3 client (requests)"),
    ("urllib3", "S3 client (requests)"),
    ("/http/client.py", "S3 client (requests)"),
    ("socket.py", "S3 client (requests)"),
    ("boto3", "S3 client (requests)"),
    ("remote_loader/storage/", "S3 client (requests)"),
    ("remote_loader/read/fetch.py", "prefetcher"),
    ("remote_loader/read/retry.py", "prefetcher"),
    ("simplejpeg", "decode"),
    ("PIL/", "decode"),
    ("remote_loader/pipeline/augment.py", "decode"),
    ("remote_loader/pipeline/decode.py", "decode"),
    ("augment.py", "user functions"),
    ("torch/", "collate (torch)"),
    ("remote_loader/pipeline/threads.py", "stage threads"),
    ("remote_loader/pipeline/", "source and stages"),
    ("remote_loader/read/", "source and stages"),
    ("remote_loader/format/", "source and stages"),
    ("numpy", "source and stages"),
    ("gil_cost.py", "the loop"),
)


def part_of(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        for needle, part in PARTS:
            if needle in frame:
                return part
    return "other"


def _calibrate_gil(seconds: float) -> None:
    """Pure Python for ``seconds``: the GIL held all along."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def calibration_us() -> float:
    """Microseconds of a fixed pure-Python workload (best of 5): compares one machine's
    Python speed with another's, so projections can be scaled to a node."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i % 7
        d = {}
        for i in range(50_000):
            d[i] = i
        best = min(best, time.perf_counter() - started)
    return best * 1e6


# ---------------------------------------------------------------------------- one run, in a child


def _pipeline(endpoint: str, keys: tuple[str, str], bucket: str, prefix: str, scenario: str, threads: int):  # noqa: ANN202
    sys.path.insert(0, str(SUITE))
    from augment import BATCH, count_batch, plain_augment, stack_batch

    from remote_loader import RandomResizedCrop, RemoteDataset, make_client

    client = make_client(endpoint, *keys)
    base = RemoteDataset(client, bucket, prefix, seed=0, rank=0, world_size=1)
    if scenario != "A-noshuffle":
        base = base.shuffle(SHUFFLE)
    if scenario.startswith("A"):
        return base.to_tuple("jpg", "cls").batched(BATCH, count_batch)
    if scenario == "B-fused":
        return base.decode(RandomResizedCrop(224), threads=threads).to_tuple("jpg", "cls").batched(BATCH, stack_batch)

    def augment_pair(pair):  # noqa: ANN001, ANN202
        return plain_augment(pair[0]), int(pair[1])

    return base.to_tuple("jpg", "cls").map(augment_pair, threads=threads).batched(BATCH, stack_batch)


def _count(batch: object, scenario: str) -> int:
    return batch[0] if scenario.startswith("A") else len(batch[1])  # type: ignore[index]


def child(spec: dict) -> dict:
    """One epoch: the first batches unmeasured, the rest under py-spy."""
    import torch

    torch.set_num_threads(1)
    ds = _pipeline(spec["endpoint"], tuple(spec["keys"]), spec["bucket"], spec["prefix"], spec["scenario"],
                   spec["threads"])
    stream = iter(ds)
    warm = sum(_count(next(stream), spec["scenario"]) for _ in range(3))
    out = os.path.join(tempfile.mkdtemp(prefix="gil-"), "raw.txt")
    spy = subprocess.Popen([spec["py_spy"], "record", "--pid", str(os.getpid()), "--gil", "--nonblocking",
                            "--rate", str(spec["rate"]), "--format", "raw", "--output", out],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert spy.stdout is not None
        spy.stdout.readline()  # "Sampling process ...": attached
        _calibrate_gil(_CALIBRATE_SECONDS)
        server = spec.get("server")
        served = _cpu(server)
        wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
        samples = sum(_count(batch, spec["scenario"]) for batch in stream)
        wall, cpu, own = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - own
        served = _cpu(server) - served
    finally:
        spy.send_signal(signal.SIGINT)
        spy.communicate(timeout=60)
    parts: Counter[str] = Counter()
    with open(out) as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            parts[part_of(stack)] += int(count)
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    per_gil_second = parts.pop("calibration", 0) / _CALIBRATE_SECONDS
    gil = {part: count / per_gil_second / samples * 1e6 for part, count in parts.items()} if per_gil_second else {}
    return {"samples": samples, "warm": warm, "rate": samples / wall, "cpu_us": cpu / samples * 1e6,
            "thread_us": own / samples * 1e6, "gil_us": sum(gil.values()), "gil_parts": gil,
            "server_us": served / samples * 1e6, "cores": cpu / wall, "calibration_us": calibration_us()}


def _cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    from remote_loader.testing.processes import cpu_seconds

    return cpu_seconds(pid)


# ---------------------------------------------------------------------------- the model


def project(row: dict, worker_row: dict | None, cores: int, server_on_node: bool) -> dict[str, float]:
    """Samples/s a node of ``cores`` would give: one process, one worker, and the best of W workers."""
    one = 1e6 / row["gil_us"]
    base = worker_row or row
    worker = 1e6 / max(base["gil_us"], base["thread_us"])
    cpu = base["cpu_us"] + (base["server_us"] if server_on_node else 0.0)
    out = {"one_process": one, "worker": worker, "cpu_limit": cores * 1e6 / cpu}
    for workers in (8, 16):
        out[f"workers_{workers}"] = min(workers * worker, out["cpu_limit"])
    return out


# ---------------------------------------------------------------------------- the run


def _run(spec: dict, against: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": against} if against else dict(os.environ)
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          timeout=1800, env=env, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    keys = ("rate", "cpu_us", "thread_us", "gil_us", "server_us", "cores", "calibration_us")
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    parts = {p for r in runs for p in r["gil_parts"]}
    row["gil_parts"] = {p: statistics.median(r["gil_parts"].get(p, 0.0) for r in runs) for p in parts}
    row["samples"] = runs[0]["samples"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", default=["A", "B-fused"], choices=list(SCENARIOS))
    parser.add_argument("--cores", type=int, default=16, help="cores of the node projected")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="stage threads in one process")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--server-on-node", action="store_true", help="count the server's CPU in the projection")
    parser.add_argument("--against", help="another checkout, run alternating with this one")
    parser.add_argument("--json", help="write the rows and projections here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    sys.path.insert(0, str(SUITE))
    import data

    from remote_loader import make_client, upload_cv_dataset
    from remote_loader.testing.server import EmbeddedS3

    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy is missing: pip install -r benchmarks/requirements.txt")
    items = data.build(Path(tempfile.gettempdir()) / "remote-loader-bench-images", args.images)
    checkouts = {"this": None, **({"against": args.against} if args.against else {})}
    results: dict[str, dict[str, list[dict]]] = {}
    with EmbeddedS3(buckets=["gil"]) as server:
        client = make_client(server.endpoint_url, server.access_key, server.secret_key)

        class Files:
            def __len__(self) -> int:
                return len(items)

            def __getitem__(self, i: int) -> tuple[bytes, int]:
                return Path(items[i][0]).read_bytes(), items[i][1]

        upload_cv_dataset(Files(), client=client, bucket="gil", base_folder="d", maxsize=64e6, workers=2,
                          progress=False)
        client.close()
        base = {"endpoint": server.endpoint_url, "keys": [server.access_key, server.secret_key], "bucket": "gil",
                "prefix": "d", "py_spy": py_spy, "rate": args.rate, "server": server.pid}
        for scenario in args.scenarios:
            for threads in sorted({args.threads, 0}, reverse=True):
                if scenario.startswith("A") and threads == 0:
                    continue  # bytes only has no threaded stage
                name = f"{scenario}, threads={threads}"
                for _ in range(args.repeats):
                    for label, checkout in checkouts.items():
                        run = _run({**base, "scenario": scenario, "threads": threads}, checkout)
                        results.setdefault(label, {}).setdefault(name, []).append(run)
                        print(f"{label:8s} {name:22s} {run['rate']:8,.0f}/s  GIL {run['gil_us']:6.1f} us"
                              f"  CPU {run['cpu_us']:6.1f} us  thread {run['thread_us']:6.1f} us", flush=True)
    report(results, args)


def report(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    out: dict[str, dict] = {}
    for label, rows in results.items():
        medians = {name: _median(runs) for name, runs in rows.items()}
        print(f"\n## {label}: medians of {args.repeats}, {os.cpu_count()} cores here, Python"
              f" {sys.version.split()[0]}")
        print("| row | samples/s here | GIL us/sample | CPU us/sample | consuming thread us | server us |"
              " cores | GIL by part (us) |\n|---|---|---|---|---|---|---|---|")
        for name, row in medians.items():
            parts = ", ".join(f"{p} {v:.1f}" for p, v in sorted(row["gil_parts"].items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {row['rate']:,.0f} | {row['gil_us']:.1f} | {row['cpu_us']:.1f} |"
                  f" {row['thread_us']:.1f} | {row['server_us']:.1f} | {row['cores']:.2f} | {parts} |")
        print(f"\nprojected for {args.cores} cores (samples/s){' with the server on the node' * args.server_on_node}:")
        print("| scenario | one process | one worker | 8 workers | 16 workers | CPU limit |\n|---|---|---|---|---|---|")
        projections = {}
        for scenario in args.scenarios:
            threaded = medians.get(f"{scenario}, threads={args.threads}")
            worker = medians.get(f"{scenario}, threads=0")
            if threaded is None:
                continue
            p = project(threaded, worker, args.cores, args.server_on_node)
            projections[scenario] = p
            print(f"| {scenario} | {p['one_process']:,.0f} | {p['worker']:,.0f} | {p['workers_8']:,.0f} |"
                  f" {p['workers_16']:,.0f} | {p['cpu_limit']:,.0f} |")
        calibration = statistics.median(r["calibration_us"] for r in medians.values())
        print(f"\nPython speed here: {calibration:,.0f} us for the calibration workload")
        out[label] = {"rows": medians, "projections": projections, "calibration_us": calibration}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
