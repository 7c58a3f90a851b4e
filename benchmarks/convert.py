"""Convert + upload (the suite's E) alone: each system's writer, in a fresh process, the
systems alternating, against SeaweedFS directly or through ``shaper.py``'s relay.

    python benchmarks/convert.py --profile s3-same-region --repeats 5 \\
        --systems remote_loader streaming [--against CHECKOUT] [--workers 2]

``--against`` adds remote_loader as another checkout has it (a ``git worktree`` of an
earlier commit), in the same alternation: on a shared machine only runs taken side by
side compare. The order turns by one each repeat, so no writer is always the first on a
fresh server or the one after a given other. Uses the suite's dataset (``suite/data.py``:
4,000 JPEGs of ~110 KB).

Beside each writer's time it gives the CPU-seconds its process tree used (user and
system) and those the server used meanwhile: on a machine whose cores the server shares,
their sum bounds every writer's time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "suite"))

import data  # noqa: E402
import servers  # noqa: E402
from run import measure  # noqa: E402
from systems import SYSTEMS  # noqa: E402

from remote_loader.testing.processes import cpu_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="s3-same-region", help="loopback, or a shaper.py profile")
    parser.add_argument("--systems", nargs="+", default=["remote_loader", "streaming"], choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--against", help="another checkout's path: its remote_loader joins the alternation")
    parser.add_argument("--workers", type=int, default=2, help="remote_loader's upload processes (0: in this one)")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "remote-loader-bench-data")
    args = parser.parse_args()
    items = [(str(path), label) for path, label in data.build(args.data / str(args.images), args.images)]
    runs: dict[str, list[tuple[float, float, float, float]]] = {}  # seconds, user, system, server CPU-s
    with tempfile.TemporaryDirectory() as tmp, servers.seaweedfs() as (target, server):
        items_file = Path(tmp) / "items.json"
        items_file.write_text(json.dumps(items))
        relay = nullcontext(target) if args.profile == "loopback" else servers.shaped(target, args.profile)
        with relay as through:
            for repeat in range(args.repeats):
                order = args.systems + (["remote_loader@against"] if args.against else [])
                for system in order[repeat % len(order):] + order[:repeat % len(order)]:  # each goes first in turn
                    name, _, against = system.partition("@")
                    env = {"BENCH_UPLOAD_WORKERS": str(args.workers)}
                    if against:
                        env["PYTHONPATH"] = args.against
                    used, served = resource.getrusage(resource.RUSAGE_CHILDREN), cpu_seconds(server)
                    run = measure(["write", name, f"{name}{against}-{repeat}", str(items_file)], through, extra_env=env)
                    now = resource.getrusage(resource.RUSAGE_CHILDREN)  # the writer's tree, waited for
                    row = (run["seconds"], now.ru_utime - used.ru_utime, now.ru_stime - used.ru_stime,
                           cpu_seconds(server) - served)
                    runs.setdefault(system, []).append(row)
                    print(f"  {system} #{repeat}: {row[0]:.2f} s; CPU-s: writer {row[1]:.2f} user {row[2]:.2f} system,"
                          f" server {row[3]:.2f}", flush=True)
    where = "on loopback" if args.profile == "loopback" else f"via {args.profile}"
    print(f"\n{args.images} JPEGs, SeaweedFS {where}, remote_loader with workers={args.workers}, medians of"
          f" {args.repeats}, systems alternating; CPU-seconds of the writer's processes (imports included) and of"
          " the server\n\n| system | convert + upload (s) | runs | writer user | writer system | server |"
          "\n|---|---|---|---|---|---|")
    for system, rows in runs.items():
        seconds, user, system_cpu, served = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {system} | {seconds:.2f} | {' '.join(f'{r[0]:.2f}' for r in sorted(rows))} | {user:.2f} |"
              f" {system_cpu:.2f} | {served:.2f} |")


if __name__ == "__main__":
    main()
