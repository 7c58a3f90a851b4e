"""The benchmark suite: remote_loader against WebDataset, MosaicML Streaming and LitData.

    make bench                                   # everything, default settings
    python benchmarks/suite/run.py --images 1000 --repeats 3 --servers localbucket
    python benchmarks/suite/run.py --endpoint http://127.0.0.1:9000   # any S3 server (AWS_* credentials)
    python benchmarks/suite/run.py --servers seaweedfs --profiles loopback s3-same-region --workers 0 2 4

Builds the JPEG dataset (``data.py``), converts it with each system's own writer (E),
then measures each system on each server, directly and through ``benchmarks/shaper.py``
under each of ``--profiles`` (a network's latency and per-connection bandwidth),
``--repeats`` times in alternation, each run a fresh process, each system at each of
``--workers`` DataLoader worker counts (0, 2 and 4) and compared at its best one, set up as
its own documentation shows (``systems.configuration``, recorded in the results): A (bytes
only, one shuffled epoch), B (Pillow decode + augment, batches of 64; remote_loader runs it
as a user transform on threads) and remote_loader's fused path, C (time to first batch)
and the steady-state rate after it, D (peak RSS of the process tree, sampled every 50 ms).
It also measures this machine's limits (GET throughput, Pillow decode + augment from local
files) and remote_loader's scaling. Every run starts after ``os.sync()``, so that the dirty
pages a run leaves (a writer's local files, as LitData's and MosaicML Streaming's, and the
server's) are not written back during the next one.
Writes ``results.json``, ``results.md`` and ``results.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import data  # noqa: E402
import limits  # noqa: E402
import report  # noqa: E402
import scaling  # noqa: E402
import servers  # noqa: E402
from systems import SYSTEMS, Target, configuration, label, settings  # noqa: E402

SCENARIOS = ("A", "B", "B-fused")


def child_env(target: Target) -> dict[str, str]:
    return {**os.environ, "BENCH_ENDPOINT": target.endpoint, "BENCH_BUCKET": target.bucket,
            "BENCH_ACCESS_KEY": target.access_key, "BENCH_SECRET_KEY": target.secret_key,
            "LITDATA_DISABLE_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"}


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def measure(args: list[str], target: Target, timeout: float = 1800,
            extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``measure.py args`` and return its JSON, plus the peak RSS of its process tree."""
    command = [sys.executable, str(HERE / "measure.py"), *args]
    os.sync()  # dirty pages the run before left (local files, the server's): none is written back in this one
    process = subprocess.Popen(
        command,
        env={**child_env(target), **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = 0
    deadline = time.monotonic() + timeout
    while process.poll() is None:  # sampling memory, not synchronising
        peak = max(peak, tree_rss(process.pid))
        if time.monotonic() > deadline:
            process.kill()
        time.sleep(0.05)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({process.returncode}):\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss_mb"] = peak / 1e6
    return result


def measure_retrying(args: list[str], target: Target, failures: list[str], attempts: int = 3) -> dict[str, Any]:
    """``measure``, run again if the system fails; each failure is recorded with its last error line."""
    for attempt in range(attempts):
        try:
            return measure(args, target)
        except RuntimeError as exc:
            failures.append(f"{args[1]} {args[3]}: {str(exc).strip().splitlines()[-1][:200]}")
            print(f"  FAILED ({attempt + 1}/{attempts}): {failures[-1]}", flush=True)
    raise RuntimeError(f"{' '.join(args)} failed {attempts} times")


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs}
    if "samples" in runs[0]:
        out["samples_per_s"] = statistics.median(r["samples"] / r["seconds"] for r in runs)
        out["first_batch_seconds"] = median(runs, "first_batch_seconds")
        out["steady_samples_per_s"] = median(runs, "steady_samples_per_s")
    out["seconds"] = median(runs, "seconds")
    out["peak_rss_mb"] = median(runs, "peak_rss_mb")
    return out


def bench_server(name: str, target: Target, items_file: Path, images: int, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    writes: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    for repeat in range(args.repeats):  # E: conversion + upload, systems alternating, each first in turn
        for system in args.systems[repeat % len(args.systems):] + args.systems[:repeat % len(args.systems)]:
            run = measure(["write", system, f"{system}-{repeat}", str(items_file)], target)
            run["samples"] = images
            writes[system].append(run)
            print(f"  [{name}] E {system} #{repeat}: {run['seconds']:.1f} s", flush=True)
    epochs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    failures: list[str] = []
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            for workers in args.workers:
                for system in args.systems:
                    if scenario == "B-fused" and system != "remote_loader":
                        continue
                    for setting in settings(system):
                        extra = [] if setting is None else [setting]
                        try:
                            run = measure_retrying(["epoch", system, f"{system}-{args.repeats - 1}", scenario,
                                                    str(workers), *extra], target, failures)
                        except RuntimeError:
                            continue  # recorded in failed_runs; the table shows a gap
                        if run["samples"] != images:
                            raise RuntimeError(f"{system} {scenario} delivered {run['samples']} of {images} samples")
                        setup = label(workers, setting)
                        epochs.setdefault((system, scenario, setup), []).append(run)
                        print(
                            f"  [{name}] {scenario} {system} w={setup} #{repeat}:"
                            f" {run['samples'] / run['seconds']:,.0f} samples/s, first batch"
                            f" {run['first_batch_seconds']:.2f} s, peak RSS {run['peak_rss_mb']:,.0f} MB",
                            flush=True,
                        )
    for system in args.systems:
        setups = {label(w, s): (w, s) for w in args.workers for s in settings(system)}
        results[system] = {
            "E": {"seconds": median(writes[system], "seconds"), "runs": writes[system]},
            "configurations": {setup: configuration(system, *ws) for setup, ws in setups.items()},
            "by_workers": {},
        }
        for scenario in SCENARIOS:
            measured = {
                setup: summarize(epochs[(system, scenario, setup)]) for setup in setups
                if (system, scenario, setup) in epochs
            }
            if measured:  # compared at its best set-up
                best = max(measured, key=lambda w: measured[w]["samples_per_s"])
                results[system][scenario] = {**measured[best], "workers": best}
                for setup, summary in measured.items():
                    results[system]["by_workers"].setdefault(setup, {})[scenario] = summary
        results[system]["failed_runs"] = [f for f in failures if f.startswith(f"{system} ")]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000, help="dataset size (mean ~110 KB per JPEG)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[0, 2, 4],
        help="DataLoader worker counts; each system is compared at its best one",
    )
    parser.add_argument(
        "--servers", nargs="+", default=["seaweedfs", "localbucket"], choices=["seaweedfs", "localbucket"]
    )
    parser.add_argument("--endpoint", help="measure on this S3 endpoint instead (credentials from AWS_*)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument(
        "--profiles",
        nargs="+",
        default=["loopback", "s3-same-region", "s3-cross-region"],
        help="network profiles of benchmarks/shaper.py to measure through (loopback: directly)",
    )
    parser.add_argument("--no-scaling", action="store_true", help="skip remote_loader's scaling runs")
    parser.add_argument("--no-limits", action="store_true", help="skip the machine-limit measurements")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "remote-loader-bench-data")
    parser.add_argument("--out", type=Path, default=HERE.parent / "results")
    args = parser.parse_args()

    print(f"building {args.images} JPEGs in {args.data} ...", flush=True)
    items = [(str(path), label) for path, label in data.build(args.data / str(args.images), args.images)]
    mean_kb = statistics.mean(Path(p).stat().st_size for p, _ in items) / 1e3
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {
            "images": args.images,
            "mean_kb": round(mean_kb, 1),
            "repeats": args.repeats,
            "workers": args.workers,
            "batch": 64,
            "shard_mb": 64,
            "shuffle_buffer": 1000,
        },
        "versions": report.versions(),
        "servers": {},
    }
    chosen = (
        {"endpoint": lambda: servers.external(args.endpoint)}
        if args.endpoint
        else {"seaweedfs": servers.seaweedfs, "localbucket": servers.localbucket}
    )
    with tempfile.TemporaryDirectory() as tmp:
        items_file = Path(tmp) / "items.json"
        items_file.write_text(json.dumps(items))
        scaled = False  # scaling runs on the first server only
        for name, start in chosen.items():
            if not args.endpoint and name not in args.servers:
                continue
            print(f"server {name}", flush=True)
            with start() as (target, pid):
                for profile in [p for p in args.profiles if p != "loopback"]:  # each through the relay
                    with servers.shaped(target, profile) as through:
                        label = f"{name} via {profile}"
                        print(f"server {label}", flush=True)
                        results["servers"][label] = {
                            "systems": bench_server(label, through, items_file, len(items), args)
                        }
                if "loopback" not in args.profiles:
                    continue
                server: dict[str, Any] = {"systems": bench_server(name, target, items_file, len(items), args)}
                if not args.no_limits:
                    server["get_limits"] = limits.get_throughput(target, "remote_loader-0", mean_kb * 1e3)
                    print(f"  [{name}] GET limits: {server['get_limits']}", flush=True)
                if not args.no_scaling and "remote_loader" in args.systems and not scaled:
                    server["scaling"] = scaling.run(
                        target, str(items_file), measure, args.repeats, f"remote_loader-{args.repeats - 1}"
                    )
                    scaled = True
            results["servers"][name] = server
    if not args.no_limits:
        results["decode_limits"] = limits.decode_throughput([p for p, _ in items[:1000]])
        print(f"decode limits: {results['decode_limits']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    table = report.markdown(results)
    (args.out / "results.md").write_text(table)
    report.chart(results, args.out / "results.png")
    if args.out.resolve() == (
        Path(__file__).resolve().parents[1] / "results"
    ):  # the published run: the docs' chart too
        report.chart(results, Path(__file__).resolve().parents[2] / "docs" / "img" / "benchmark.png")
    print(table)


if __name__ == "__main__":
    main()
