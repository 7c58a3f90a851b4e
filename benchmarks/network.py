"""remote_loader across a network: one process streaming one epoch bytes-only (defaults, no
DataLoader workers) from the embedded SeaweedFS directly (loopback) and through
``shaper.py`` under each of its profiles; samples/s, the ratio to loopback, and the time to
the first sample (construction included). Each run is a fresh process; medians of
``--repeats``.

    python benchmarks/network.py [--images 3000] [--repeats 2] [--fetch '{"prefetch_bytes": 134217728}']
        [--against CHECKOUT]

``--against`` runs each repeat a second time with the remote_loader of another checkout (a
``git worktree`` of an earlier commit), alternating, and prints its rates beside.
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

from shaper import relayed

from remote_loader import upload_cv_dataset
from remote_loader.testing.processes import cpu_seconds
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

_CHILD = textwrap.dedent("""
    import json, sys, time
    from remote_loader import FetchConfig, RemoteDataset, make_client
    endpoint, key, secret, fetch = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    started = time.perf_counter()
    ds = RemoteDataset(make_client(endpoint, key, secret), "net", "d", seed=1, fetch=FetchConfig(**fetch))
    first, count, nbytes = None, 0, 0
    for sample in ds:
        if first is None:
            first = time.perf_counter() - started
        count += 1
        nbytes += len(sample["jpg"])
    seconds = time.perf_counter() - started
    print(json.dumps({"samples": count, "seconds": seconds, "first": first, "mb": nbytes / 1e6,
                      "gets": ds.metrics.gets_in_flight, "buffered": ds.metrics.peak_buffered / 2**20}))
""")


def _run(endpoint: str, server: EmbeddedS3, fetch: dict[str, int], against: str | None) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, endpoint, server.access_key, server.secret_key, json.dumps(fetch)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **({"PYTHONPATH": against} if against else {})},
        cwd=tempfile.gettempdir(),  # not a checkout: "" first on sys.path would import it
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout)


def measure(profile: str, server: EmbeddedS3, repeats: int, fetch: dict[str, int],
            against: str | None = None) -> dict[str, float]:
    relay_cpu = 0.0
    runs, theirs = [], []
    with relayed(server.endpoint_url, profile) as (endpoint, relay):
        for _ in range(repeats):  # alternating, so drift on the machine touches both alike
            runs.append(_run(endpoint, server, fetch, None))
            if against:
                theirs.append(_run(endpoint, server, fetch, against))
        if relay is not None:  # user + system seconds the relay spent moving the bytes of every run
            relay_cpu = cpu_seconds(relay)
    return {
        "rate": statistics.median(r["samples"] / r["seconds"] for r in runs),
        "against": statistics.median(r["samples"] / r["seconds"] for r in theirs) if theirs else 0.0,
        "first": statistics.median(r["first"] for r in runs),
        "samples": runs[0]["samples"],
        "gets": max(r["gets"] for r in runs),
        "buffered": max(r["buffered"] for r in runs),
        "relay_cpu": relay_cpu / sum(r["seconds"] for r in runs + theirs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fetch", default="{}", help='FetchConfig fields as JSON, e.g. {"prefetch_bytes": 134217728}')
    parser.add_argument("--profiles", nargs="+", default=["loopback", "s3-same-region", "s3-cross-region"])
    parser.add_argument("--against", help="another checkout's path: its runs alternate with this one's")
    args = parser.parse_args()
    fetch = json.loads(args.fetch)
    with EmbeddedS3(buckets=["net"]) as server:
        upload_cv_dataset(
            SyntheticImages(args.images),
            client=server.client(),
            bucket="net",
            base_folder="d",
            maxsize=64e6,
            workers=2,
            progress=False,
        )
        print(
            f"{args.images} JPEGs of ~110 KB in ~64 MB shards; one process, FetchConfig({args.fetch or 'defaults'});"
            f" medians of {args.repeats}"
        )
        extra = " against: samples/s | against: vs loopback |" if args.against else ""
        print(
            "| profile | samples/s | vs loopback | first sample (s) | GETs in flight (most) | peak prefetched MiB"
            f" | relay CPU (cores) |{extra}"
        )
        print("|---|---|---|---|---|---|---|" + "---|---|" * bool(args.against))
        base = base_against = None
        for profile in args.profiles:
            result = measure(profile, server, args.repeats, fetch, args.against)
            base, base_against = base or result["rate"], base_against or result["against"]
            theirs = (f" {result['against']:,.0f} | {result['against'] / base_against:.2f}x |"
                      if args.against else "")
            print(
                f"| {profile} | {result['rate']:,.0f} | {result['rate'] / base:.2f}x | {result['first']:.2f} |"
                f" {result['gets']} | {result['buffered']:.0f} | {result['relay_cpu']:.2f} |{theirs}",
                flush=True,
            )

if __name__ == "__main__":
    main()
