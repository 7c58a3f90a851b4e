"""How much of a sample's cost holds the GIL, part by part, and what that projects for a node
with many cores.

One Python process runs its Python on one core at a time: whatever holds the GIL (the
source, stages, the S3 client's request code) adds up to a ceiling of ``1 / GIL-seconds per
sample`` for the whole process, however many threads it has; what releases the GIL (socket
reads, crc32, libjpeg-turbo, Pillow's resize) runs beside it on other cores. So a node's
rate is projected from figures per sample measured here, not from a 2-core run, where the
server and the loader fight for the same two cores:

- the pipeline from memory: each scenario streams one epoch from a local directory on
  tmpfs (``LocalStore``: a GET is one read of the page cache), so nothing else runs;
- the S3 client's cost per ranged GET of ``part_size``: GETs from the embedded SeaweedFS,
  one at a time, in one thread; spread over the samples a part holds.

Each is timed by the CPU seconds of the process (``time.process_time``) and of its consuming
thread, and by the GIL-held seconds: py-spy samples the process (``--gil --nonblocking``)
and counts the samples in which a thread of it holds the GIL; each run also spins pure
Python for a moment under the same sampler, which gives how many py-spy samples a second of
held GIL makes. Stacks say which part held it.

Rows: the suite's scenarios in one process, stage threads as the suite runs them without
DataLoader workers (as many as cores), and the same without threads (what a DataLoader
worker runs). Each row also runs beside a thread of the same process spinning pure Python,
which gives the GIL up only every switch interval (5 ms): a GIL-held figure lowered by
releasing the GIL once a sample shows there as a wait of up to a switch interval a sample.
The projection for a node of ``--cores``, each of its cores ``--scale``
times slower than one here (the node's own CPU-seconds per sample of a row measured on it,
over the same row's here):

- one process: ``1 / GIL`` (its ceiling; threads cannot pass it);
- a DataLoader worker: ``1 / max(GIL, consuming thread's CPU)`` without stage threads;
- ``W`` workers: ``min(W x worker, cores / CPU per sample)``; the last column counts the server's CPU
  too, for a server on the node (SeaweedFS on loopback, as in the node measurements).

    python benchmarks/gil_cost.py [--images 4000] [--repeats 2] [--scenarios A B-fused]
        [--cores 16] [--scale 1.0] [--against CHECKOUT] [--json FILE]

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
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "suite"
SHUFFLE = 1000
BUCKET = "gil"
_CALIBRATE_SECONDS = 0.5
MEASURE_SECONDS = 4.0

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
    ("remote_loader/read/session.py", "prefetcher"),
    ("simplejpeg", "decode"),
    ("PIL/", "decode"),
    ("remote_loader/pipeline/stages/augment.py", "decode"),
    ("remote_loader/pipeline/stages/decode.py", "decode"),
    ("augment.py", "user functions"),
    ("torch/", "collate (torch)"),
    ("remote_loader/pipeline/stages/threads.py", "stage threads"),
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


def _pipeline(spec: dict):  # noqa: ANN202
    sys.path.insert(0, str(SUITE))
    from augment import BATCH, count_batch, plain_augment, stack_batch

    from remote_loader import RandomResizedCrop, RemoteDataset
    from remote_loader.storage.local import LocalStore

    scenario, threads = spec["scenario"], spec["threads"]
    base = RemoteDataset(LocalStore(spec["root"]), BUCKET, spec.get("folder", "d"), seed=0, rank=0, world_size=1)
    if scenario != "A-noshuffle":
        base = base.shuffle(SHUFFLE)
    if scenario.startswith("A"):
        return base.to_tuple("jpg", "cls").batched(BATCH, count_batch)
    if scenario == "B-fused":
        return base.decode(RandomResizedCrop(224), threads=threads).to_tuple("jpg", "cls").batched(BATCH, stack_batch)

    def augment_pair(pair):  # noqa: ANN001, ANN202
        return plain_augment(pair[0]), int(pair[1])

    return base.to_tuple("jpg", "cls").map(augment_pair, threads=threads).batched(BATCH, stack_batch)


class Spy:
    """py-spy on this process, counting GIL-held samples by part (see the module's docstring)."""

    def __init__(self, py_spy: str, rate: int) -> None:
        self.out = os.path.join(tempfile.mkdtemp(prefix="gil-"), "raw.txt")
        self.process = subprocess.Popen([py_spy, "record", "--pid", str(os.getpid()), "--gil", "--nonblocking",
                                         "--rate", str(rate), "--format", "raw", "--output", self.out],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "Sampling process ...": attached
        _calibrate_gil(_CALIBRATE_SECONDS)

    def stop(self, per: int) -> dict[str, float]:
        """Microseconds of held GIL by part, per ``per`` (samples, or GETs)."""
        self.process.send_signal(signal.SIGINT)
        self.process.communicate(timeout=60)
        parts: Counter[str] = Counter()
        with open(self.out) as handle:
            for line in handle:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                parts[part_of(stack)] += int(count)
        shutil.rmtree(os.path.dirname(self.out), ignore_errors=True)
        per_gil_second = parts.pop("calibration", 0) / _CALIBRATE_SECONDS
        return {part: n / per_gil_second / per * 1e6 for part, n in parts.items()} if per_gil_second else {}


def upload_child(spec: dict) -> dict:
    """The dataset uploaded by this process's remote_loader (a checkout's own: an older one
    may not read the manifest a newer one writes)."""
    from remote_loader import upload_cv_dataset
    from remote_loader.storage.local import LocalStore

    items = spec["items"]

    class Files:
        def __len__(self) -> int:
            return len(items)

        def __getitem__(self, i: int) -> tuple[bytes, int]:
            return Path(items[i][0]).read_bytes(), items[i][1]

    summary = upload_cv_dataset(Files(), client=LocalStore(spec["root"]), bucket=BUCKET, base_folder=spec["folder"],
                                maxsize=64e6, workers=2, progress=False)
    return {"shards": summary.shards, "samples": summary.samples}


def child(spec: dict) -> dict:
    """Epochs from memory under py-spy, for at least ``MEASURE_SECONDS`` (a short epoch gives
    py-spy too few samples); the first batches of the first unmeasured."""
    import torch

    torch.set_num_threads(1)
    pipeline = _pipeline(spec)
    stream = iter(pipeline)
    scenario = spec["scenario"]
    count = (lambda batch: batch[0]) if scenario.startswith("A") else (lambda batch: len(batch[1]))
    warm = sum(count(next(stream)) for _ in range(3))
    spy = Spy(spec["py_spy"], spec["rate"])
    wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    samples = sum(count(batch) for batch in stream)
    while time.perf_counter() - wall < MEASURE_SECONDS:
        samples += sum(count(batch) for batch in pipeline)  # the next epoch
    wall, cpu, own = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - own
    gil = spy.stop(samples)
    return {"samples": samples, "warm": warm, "rate": samples / wall, "cpu_us": cpu / samples * 1e6,
            "thread_us": own / samples * 1e6, "gil_us": sum(gil.values()), "gil_parts": gil, "cores": cpu / wall,
            "calibration_us": calibration_us(), "beside_rate": _beside_spinning(pipeline, count)}


def _beside_spinning(pipeline, count) -> float:  # noqa: ANN001
    """Samples/s of the pipeline beside a thread of this process spinning pure Python (which
    gives the GIL up only every switch interval), over at least half ``MEASURE_SECONDS``: what
    releasing the GIL per sample costs where a training step's own Python runs beside it."""
    spinning = threading.Event()
    spinning.set()

    def spin() -> None:
        while spinning.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        wall, samples = time.perf_counter(), 0
        while time.perf_counter() - wall < MEASURE_SECONDS / 2:
            for batch in pipeline:
                samples += count(batch)
                if time.perf_counter() - wall >= MEASURE_SECONDS / 2:
                    break
        return samples / (time.perf_counter() - wall)
    finally:
        spinning.clear()
        spinner.join()


def gets_child(spec: dict) -> dict:
    """Ranged GETs of ``part_size`` from the S3 server, one at a time, into one buffer."""
    import numpy as np

    from remote_loader import FetchConfig, make_client

    client = make_client(spec["endpoint"], *spec["keys"])
    part = FetchConfig().part_size
    objects = [(o, client.head(BUCKET, o)) for o in spec["objects"]]
    parts = [(key, start, min(start + part, size)) for key, size in objects for start in range(0, size, part)]
    buffer = np.empty(part, dtype=np.uint8)
    for key, start, end in parts[:2]:  # warm: the connection, the client
        client.get_range_into(BUCKET, key, start, end, buffer.data[: end - start])
    from remote_loader.testing.processes import cpu_seconds

    spy = Spy(spec["py_spy"], spec["rate"])
    wall, cpu, served = time.perf_counter(), time.process_time(), cpu_seconds(spec["server"])
    gets = 0
    while not gets or time.perf_counter() - wall < MEASURE_SECONDS:
        for key, start, end in parts:
            client.get_range_into(BUCKET, key, start, end, buffer.data[: end - start])
        gets += len(parts)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    served = cpu_seconds(spec["server"]) - served
    gil = spy.stop(gets)
    return {"gets": gets, "rate": gets / wall, "cpu_us": cpu / gets * 1e6, "server_us": served / gets * 1e6,
            "gil_us": sum(gil.values()), "gil_parts": gil}


# ---------------------------------------------------------------------------- the model


def project(row: dict, worker_row: dict | None, get: dict, per_sample_gets: float, cores: int,
            scale: float) -> dict[str, float]:
    """Samples/s a node of ``cores``, each ``scale`` times slower, would give: one process,
    one worker, and W workers (the S3 client's cost per GET spread over the samples of a part)."""
    extra_gil, extra_cpu = get["gil_us"] * per_sample_gets, get["cpu_us"] * per_sample_gets
    gil = (row["gil_us"] + extra_gil) * scale
    base = worker_row or row
    worker_gil = (base["gil_us"] + extra_gil) * scale
    worker = 1e6 / max(worker_gil, base["thread_us"] * scale)
    cpu = (base["cpu_us"] + extra_cpu) * scale
    served = get.get("server_us", 0.0) * per_sample_gets * scale
    out = {"gil_us": gil, "one_process": 1e6 / gil, "worker": worker, "cpu_limit": cores * 1e6 / cpu,
           "cpu_limit_with_server": cores * 1e6 / (cpu + served)}
    for workers in (8, 16):
        out[f"workers_{workers}"] = min(workers * worker, out["cpu_limit"])
    return out


# ---------------------------------------------------------------------------- the run


def _run(mode: str, spec: dict, against: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": against} if against else dict(os.environ)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:  # a spec with every item's path is too long for argv
        json.dump(spec, file)
        file.flush()
        done = subprocess.run([sys.executable, __file__, mode, file.name], capture_output=True, text=True,
                              timeout=1800, env=env, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    parts = {p for r in runs for p in r["gil_parts"]}
    row["gil_parts"] = {p: statistics.median(r["gil_parts"].get(p, 0.0) for r in runs) for p in parts}
    return row


def _tmpfs() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="gil-cost-", dir=shm if shm.is_dir() else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--gets-child", help=argparse.SUPPRESS)
    parser.add_argument("--upload-child", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", default=["A", "B-fused"], choices=list(SCENARIOS))
    parser.add_argument("--cores", type=int, default=16, help="cores of the node projected")
    parser.add_argument("--scale", type=float, default=1.0, help="how many times slower a core of the node is")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="stage threads in one process")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--against", help="another checkout, run alternating with this one")
    parser.add_argument("--json", help="write the rows and projections here")
    args = parser.parse_args()
    if args.upload_child:
        print(json.dumps(upload_child(json.loads(Path(args.upload_child).read_text()))), flush=True)
        return
    if args.child or args.gets_child:
        spec = json.loads(Path(args.child or args.gets_child).read_text())
        result = child(spec) if args.child else gets_child(spec)
        print(json.dumps(result), flush=True)
        return
    results = measure(args)
    report(results, args)


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    sys.path.insert(0, str(SUITE))
    import data

    from remote_loader import make_client, upload_cv_dataset
    from remote_loader.storage.local import LocalStore
    from remote_loader.testing.server import EmbeddedS3

    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy is missing: pip install -r benchmarks/requirements.txt")
    items = data.build(Path(tempfile.gettempdir()) / "remote-loader-bench-images", args.images)

    checkouts = {"this": None, **({"against": args.against} if args.against else {})}
    results: dict[str, dict[str, list[dict]]] = {}
    root = _tmpfs()
    try:
        (root / BUCKET).mkdir()
        summary = upload_cv_dataset(data.Files(items), client=LocalStore(str(root)), bucket=BUCKET, base_folder="d",
                                    maxsize=64e6, workers=2, progress=False)
        folders = {"this": "d"}
        for label, checkout in checkouts.items():
            if checkout is not None:  # each checkout reads the dataset its own upload writes
                folders[label] = f"d-{label}"
                _run("--upload-child", {"root": str(root), "folder": folders[label],
                                        "items": [[str(p), int(c)] for p, c in items]}, checkout)
        base = {"root": str(root), "py_spy": py_spy, "rate": args.rate}
        for scenario in args.scenarios:
            for threads in sorted({args.threads, 0}, reverse=True):
                if scenario.startswith("A") and threads == 0:
                    continue  # bytes only has no threaded stage
                name = f"{scenario}, threads={threads}"
                for _ in range(args.repeats):
                    for label, checkout in checkouts.items():
                        run = _run("--child", {**base, "scenario": scenario, "threads": threads,
                                               "folder": folders[label]}, checkout)
                        results.setdefault(label, {}).setdefault(name, []).append(run)
                        print(f"{label:8s} {name:22s} {run['rate']:8,.0f}/s  beside a spinning thread"
                              f" {run['beside_rate']:8,.0f}/s  GIL {run['gil_us']:6.1f} us"
                              f"  CPU {run['cpu_us']:6.1f} us  thread {run['thread_us']:6.1f} us", flush=True)
        with EmbeddedS3(buckets=[BUCKET]) as server:
            client = make_client(server.endpoint_url, server.access_key, server.secret_key)
            names = [f"d/{p.name}" for p in sorted((root / BUCKET / "d").glob("*.tar"))][:4]
            for name in names:
                client.put(BUCKET, name, (root / BUCKET / name).read_bytes())
            client.close()
            spec = {**base, "endpoint": server.endpoint_url, "keys": [server.access_key, server.secret_key],
                    "objects": names, "server": server.pid}
            for _ in range(args.repeats):
                for label, checkout in checkouts.items():
                    run = _run("--gets-child", spec, checkout)
                    results[label].setdefault("GET", []).append(run)
                    print(f"{label:8s} {'GET of a part':22s} {run['rate']:8,.0f}/s  GIL {run['gil_us']:6.1f} us"
                          f"  CPU {run['cpu_us']:6.1f} us", flush=True)
        for runs in results.values():
            runs["dataset"] = [{"sample_bytes": summary.bytes / summary.samples}]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def report(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    from remote_loader import FetchConfig

    out: dict[str, dict] = {}
    for label, rows in results.items():
        sample_bytes = rows.pop("dataset")[0]["sample_bytes"]
        medians = {name: _median(runs) for name, runs in rows.items()}
        get = medians.pop("GET")
        per_sample_gets = sample_bytes / FetchConfig().part_size
        print(f"\n## {label}: medians of {args.repeats}, {os.cpu_count()} cores here, Python"
              f" {sys.version.split()[0]}; {sample_bytes / 1e3:.0f} KB a sample")
        print("| row (from memory) | samples/s here | beside a spinning thread | GIL us/sample | CPU us/sample |"
              " consuming thread us | cores | GIL by part (us) |\n|---|---|---|---|---|---|---|---|")
        for name, row in medians.items():
            parts = ", ".join(f"{p} {v:.1f}" for p, v in sorted(row["gil_parts"].items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {row['rate']:,.0f} | {row.get('beside_rate', float('nan')):,.0f} |"
                  f" {row['gil_us']:.1f} | {row['cpu_us']:.1f} |"
                  f" {row['thread_us']:.1f} | {row['cores']:.2f} | {parts} |")
        print(f"\nS3 client, one ranged GET of {FetchConfig().part_size >> 20} MiB: GIL {get['gil_us']:.0f} us,"
              f" CPU {get['cpu_us']:.0f} us ({get['gil_us'] * per_sample_gets:.1f} and"
              f" {get['cpu_us'] * per_sample_gets:.1f} us a sample); the server's CPU"
              f" {get.get('server_us', 0.0) * per_sample_gets:.1f} us a sample")
        print(f"\nprojected for {args.cores} cores, each {args.scale:g}x slower than one here (samples/s):")
        print("| scenario | GIL us/sample | one process | one worker | 8 workers | 16 workers | CPU limit |"
              " CPU limit, server on the node |\n|---|---|---|---|---|---|---|---|")
        projections = {}
        for scenario in args.scenarios:
            threaded = medians.get(f"{scenario}, threads={args.threads}")
            if threaded is None:
                continue
            p = project(threaded, medians.get(f"{scenario}, threads=0"), get, per_sample_gets, args.cores,
                        args.scale)
            projections[scenario] = p
            print(f"| {scenario} | {p['gil_us']:.1f} | {p['one_process']:,.0f} | {p['worker']:,.0f} |"
                  f" {p['workers_8']:,.0f} | {p['workers_16']:,.0f} | {p['cpu_limit']:,.0f} |"
                  f" {p['cpu_limit_with_server']:,.0f} |")
        calibration = statistics.median(r["calibration_us"] for r in medians.values())
        print(f"\nPython speed here: {calibration:,.0f} us for the calibration workload")
        out[label] = {"rows": medians, "get": get, "projections": projections, "calibration_us": calibration,
                      "sample_bytes": sample_bytes}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
