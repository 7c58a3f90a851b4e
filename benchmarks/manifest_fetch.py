"""How long a large manifest takes to arrive: one GET against ``fetch_whole``'s parallel ranges.

Manifests of 100k and 1M shards (2.5 and 25 MB, as ``scale.py`` builds them) are put on
the embedded SeaweedFS and fetched directly and through ``shaper.py``'s profiles, each
way ``--repeats`` times in turn, in this process (one client, its connections warm):
``Store.get`` (one GET, what a reader did before) and ``fetch_whole`` (the first 4 MiB with
the object's size, then the rest in as many ranges as the first GET's speed calls for).

    python benchmarks/manifest_fetch.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from scale import manifest, one_shard  # type: ignore[import-not-found]
from shaper import relayed  # type: ignore[import-not-found]

from remote_loader import FetchConfig, make_client
from remote_loader.read.metrics import Metrics
from remote_loader.read.session import ReadSession
from remote_loader.read.whole import fetch_whole
from remote_loader.testing.server import EmbeddedS3

BUCKET = "manifests"


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profiles", nargs="+", default=["loopback", "s3-same-region", "s3-cross-region"])
    args = parser.parse_args()
    entry = one_shard()[1]
    manifests = {count: manifest(count, entry) for count in args.shards}
    print(f"medians of {args.repeats}; GETs: how many fetch_whole made")
    print("| profile | shards | manifest | one GET | fetch_whole | GETs | ratio |")
    print("|---|---|---|---|---|---|---|")
    with EmbeddedS3(buckets=[BUCKET]) as server:
        with server.client() as client:
            for count, data in manifests.items():
                client.put(BUCKET, f"n{count}", data)
        for profile in args.profiles:
            with relayed(server.endpoint_url, profile) as (endpoint, _):
                with make_client(endpoint, server.access_key, server.secret_key) as client:
                    for count, data in manifests.items():
                        key = f"n{count}"
                        assert client.get(BUCKET, key) == data  # and a connection is warm
                        single = timed(lambda: client.get(BUCKET, key), args.repeats)
                        metrics = Metrics()
                        session = ReadSession(FetchConfig(), metrics, client)
                        assert fetch_whole(session, BUCKET, key) == data
                        ranged = timed(lambda: fetch_whole(session, BUCKET, key), args.repeats)
                        gets = int(metrics.gets) // (args.repeats + 1)
                        print(f"| {profile} | {count:,} | {len(data) / 1e6:.1f} MB | {single:.3f} s | {ranged:.3f} s"
                              f" | {gets} | {single / ranged:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
