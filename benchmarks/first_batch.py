"""The first batch, request by request: one process (no DataLoader workers) opens a dataset
and takes its first batch, directly (loopback) and through ``shaper.py`` under each of its
profiles. For every request sent before the first batch it prints when it was sent and when
its response headers arrived, and counts the round trips on the critical path: the chain of
requests each of which was sent only after the one before it had answered (through the
relay only: on loopback answers come before the next request is ready, so every request
would look dependent).

    python benchmarks/first_batch.py [--images 2000] [--repeats 3] [--batch 64] [--shuffle 1000]
        [--against CHECKOUT]

``--shuffle`` puts a shuffle buffer before the batches, as the suite's set-up does.
``--against`` runs each repeat a second time with the remote_loader of another checkout
(a ``git worktree`` of an earlier commit), alternating, and prints both medians: on a
shared machine only runs taken side by side compare.
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
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages

# botocore's events mark when a request leaves (before-send) and when its response headers
# are back (after-call); a GET's body arrives after that.
_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    from remote_loader import RemoteDataset, make_client
    endpoint, key, secret, batch, shuffle = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    requests, current = [], threading.local()  # a thread sends one request at a time
    def sent(request, **_):
        current.request = {"what": request.method + " " + request.url.rsplit("/", 1)[-1].split("?")[0]
                           + (" " + request.headers["Range"].decode() if "Range" in request.headers else ""),
                           "sent": time.perf_counter() - started, "answered": None}
        requests.append(current.request)
    def answered(**_):
        current.request["answered"] = time.perf_counter() - started
    started = time.perf_counter()
    client = make_client(endpoint, key, secret)
    events = client._sdk().meta.events
    events.register("before-send.s3", sent)
    events.register("after-call.s3", answered)
    started = time.perf_counter()
    ds = RemoteDataset(client, "net", "d", seed=1)
    ds = (ds.shuffle(shuffle) if shuffle else ds).batched(batch, collation_fn=list)
    batches = iter(ds)  # kept: dropping it closes the pipeline, which this must not time
    first = next(batches)
    seconds = time.perf_counter() - started
    assert len(first) == batch
    print(json.dumps({"seconds": seconds, "requests": [r for r in requests if r["sent"] < seconds]}))
""")


def round_trips(requests: list[dict]) -> int:
    """The longest chain of requests each sent after the previous one answered."""
    depth: list[int] = []
    for r in requests:
        before = [
            d
            for other, d in zip(requests, depth, strict=False)
            if other["answered"] is not None and other["answered"] <= r["sent"]
        ]
        depth.append(1 + max(before, default=0))
    answered = [d for r, d in zip(requests, depth, strict=False) if r["answered"] is not None]
    return max(answered, default=0)


def _run(endpoint: str, server: EmbeddedS3, batch: int, shuffle: int, checkout: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout} if checkout else None
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, endpoint, server.access_key, server.secret_key, str(batch), str(shuffle)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tempfile.gettempdir(),  # not this checkout: ``-c`` puts the working directory first on the path
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout)


def measure(profile: str, server: EmbeddedS3, repeats: int, batch: int, shuffle: int,
            against: str | None) -> tuple[list[dict], list[dict]]:
    """The runs of this checkout and, alternating with them, of ``against``'s."""
    ours: list[dict] = []
    theirs: list[dict] = []
    with relayed(server.endpoint_url, profile) as (endpoint, _):
        for _ in range(repeats):
            ours.append(_run(endpoint, server, batch, shuffle))
            if against:
                theirs.append(_run(endpoint, server, batch, shuffle, against))
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--profiles", nargs="+", default=["loopback", "s3-same-region", "s3-cross-region"])
    parser.add_argument("--shuffle", type=int, default=0, help="a shuffle buffer of this many samples (0: none)")
    parser.add_argument("--against", help="another checkout's path: its runs alternate with this one's")
    args = parser.parse_args()
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
            f"{args.images} JPEGs of ~110 KB in ~64 MB shards; one process, defaults"
            f"{f', shuffle({args.shuffle})' if args.shuffle else ''}; first batch of {args.batch};"
            f" medians of {args.repeats}"
        )
        rows = []
        for profile in args.profiles:
            runs, against = measure(profile, server, args.repeats, args.batch, args.shuffle, args.against)
            median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
            for name, taken in (("this checkout", runs), ("against", against)):
                if taken:
                    times = sorted(r["seconds"] for r in taken)
                    print(f"{profile}, {name}: " + " ".join(f"{t:.3f}" for t in times))
            trips = "-" if profile == "loopback" else round_trips(median["requests"])
            print(
                f"\n{profile}: first batch {median['seconds']:.3f} s, {trips} round trips,"
                f" {len(median['requests'])} requests (the median run):"
            )
            for r in median["requests"]:
                answered = "-" if r["answered"] is None else f"{r['answered'] * 1000:7.1f}"
                print(f"  sent {r['sent'] * 1000:7.1f} ms  answered {answered} ms  {r['what']}")
            rows.append(
                (
                    profile,
                    statistics.median(r["seconds"] for r in runs),
                    "-"
                    if profile == "loopback"
                    else f"{statistics.median(round_trips(r['requests']) for r in runs):.0f}",
                    statistics.median(r["seconds"] for r in against) if against else None,
                )
            )
        print(f"\n| profile | first batch (s) | round trips |{' against (s) |' if args.against else ''}"
              f"\n|---|---|---|{'---|' if args.against else ''}")
        for profile, seconds, trips, theirs in rows:
            print(f"| {profile} | {seconds:.3f} | {trips} |" + (f" {theirs:.3f} |" if theirs is not None else ""))


if __name__ == "__main__":
    main()
