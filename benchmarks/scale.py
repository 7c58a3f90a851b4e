"""Metadata at scale: manifests of 1k, 100k, 1M (and 10M) shards of 1,000 samples (up to 10B samples).

For each size, against the embedded SeaweedFS, each figure from a fresh process:

- opening: construction to a ready ``RemoteDataset`` / ``RemoteMapDataset`` (``len()``
  answered: manifest GET, decode, counts), the RSS it added and the bytes its store's reads
  returned; and the same for one rank of 8;
- one rank of 8 with one DataLoader worker: construction to its first batch, and the
  worker's private memory (USS) then;
- first batch: construction to the first batch of 64 through a 1,000-sample shuffle buffer
  with 2 DataLoader workers, and each worker's private memory (USS) then;
- random access: ``ds[i]`` for random ``i``, index cache cold (index GET + sample GET) and
  warm (sample GET);
- at the largest size, 2 ranks x 4 workers against 1 process: the PSS of every process.

Every manifest lists its shards under template names; only the shards a run reads exist,
as copies of one real shard (1,000 samples of a ``cls`` field).

    python benchmarks/scale.py [--sizes 1000 100000 1000000] [--repeats 3]

``--profile s3-same-region`` (or ``s3-cross-region``) runs every child through
``shaper.py``'s relay; ``--first-batch-only`` measures only the first batch.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from shaper import PROFILES, relayed  # type: ignore[import-not-found]

from remote_loader.format import Manifest, ShardEntry, ShardTable, ShardWriter
from remote_loader.format.epoch_order import EpochOrder
from remote_loader.format.pages import PAGE_ROWS
from remote_loader.format.shard_counts import ArrayCounts, RunCounts
from remote_loader.pipeline.order.split import PlanSpans, laps, worker_bounds
from remote_loader.testing.server import EmbeddedS3

PER_SHARD = 1000
BUCKET = "scale"
RUN = "5ca1ab1e"
AHEAD = 160  # shards each worker may fetch ahead of its first batch (the 128 MiB budget of 1 MB shards, and more)
RANDOM = 40

_COMMON = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    from remote_loader import RemoteDataset, RemoteMapDataset, make_client

    def memory(pid="self"):
        fields = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
        return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}

    def children():
        me = os.getpid()
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            out.append(int(entry))
                except OSError:
                    pass
        return sorted(out)

    received = [0]  # bytes the store returned to this process

    def counted(store):
        # the store, counting the bytes each of its reads returns
        sizes = {"get": len, "get_range": len, "get_first_bytes": lambda r: len(r[0]),
                 "get_range_and_size": lambda r: len(r[0]), "get_versioned": lambda r: len(r[0])}
        for name, size in sizes.items():
            def read(*a, _method=getattr(store, name), _size=size, **k):
                out = _method(*a, **k)
                received[0] += _size(out)
                return out
            setattr(store, name, read)
        into = store.get_range_into

        def read_into(bucket, key, start, end, out):
            into(bucket, key, start, end, out)
            received[0] += end - start
        store.get_range_into = read_into
        return store

    endpoint, key, secret, prefix, mode = sys.argv[1:6]
    args = sys.argv[6:]
    client = counted(make_client(endpoint, key, secret))
    client.head("scale", f"{prefix}/manifest.msgpack")  # SDK set-up and a connection, outside the timings
""")

_CHILD = _COMMON + textwrap.dedent("""
    if mode in ("open-stream", "open-map"):
        world = {"rank": int(args[0]), "world_size": int(args[1])} if args else {}
        before, read = memory(), received[0]
        t0 = time.perf_counter()
        ds = (RemoteDataset if mode == "open-stream" else RemoteMapDataset)(client, "scale", prefix, **world)
        n = len(ds)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "rss_mb": memory()["rss"] - before["rss"],
                          "read_mb": (received[0] - read) / 1e6, "samples": n}))
    elif mode == "first-batch":
        from remote_loader import FetchConfig
        workers, rank, world = int(args[0]), int(args[1]), int(args[2])
        fetch, bufsize = json.loads(args[3]) if len(args) > 3 else {}, int(args[4]) if len(args) > 4 else 1000
        t0 = time.perf_counter()
        if fetch.get("bare"):  # a DataLoader worker that only forks and hands out ints: the floor
            class Bare(torch.utils.data.IterableDataset):
                def __iter__(self):
                    for i in range(10**6):
                        yield list(range(64)) if i % 64 == 0 else None
            loader = DataLoader(Bare(), batch_size=None, num_workers=workers, collate_fn=lambda b: len(b))
        else:
            ds = (RemoteDataset(client, "scale", prefix, rank=rank, world_size=world, fetch=FetchConfig(**fetch))
                  .shuffle(bufsize).batched(64, collation_fn=len))
            loader = DataLoader(ds, batch_size=None, num_workers=workers)
        batches = iter(loader)
        assert next(batches) == 64
        seconds = time.perf_counter() - t0
        workers = []
        for pid in children():
            try:
                workers.append(memory(pid))
            except OSError:  # a helper process that ended meanwhile
                pass
        print(json.dumps({"seconds": seconds, "main": memory(), "workers": workers}))
        del batches
    elif mode == "random":
        ds = RemoteMapDataset(client, "scale", prefix, cache_shards=len(args) + 1)
        cold, warm = [], []
        for i in map(int, args):
            for times in (cold, warm):
                t0 = time.perf_counter()
                sample = ds[i]
                times.append(time.perf_counter() - t0)
                assert sample["cls"] == str(i % 1000).encode(), (i, sample)
        print(json.dumps({"cold_ms": 1000 * float(np.median(cold)), "warm_ms": 1000 * float(np.median(warm))}))
""")


def one_shard() -> tuple[bytes, ShardEntry]:
    """A real shard of 1,000 samples whose ``cls`` is the sample's position in it."""
    out = io.BytesIO()
    writer = ShardWriter(out.write)
    for j in range(PER_SHARD):
        writer.add(f"{j:07d}", {"cls": str(j).encode()})
    summary = writer.close()
    return out.getvalue(), ShardEntry.from_summary("x.tar", summary)


PAGES = f"shard-{RUN}-manifest.pages"


def manifest(count: int, entry: ShardEntry, version: int) -> tuple[bytes, bytes | None]:
    """``count`` shards like ``entry`` under ``shard-RUN-<task>-000.tar``, built as columns:
    the manifest, and (version 3) its pages when they are not inline."""
    column = {c: np.full(count, getattr(entry, c), dtype=np.uint64) for c in
              ("samples", "size", "index_offset", "index_size", "index_crc", "crc32")}
    table = ShardTable.from_template(column, (f"shard-{RUN}-", "-", ".tar"), (6, 3),
                                     (np.arange(count), np.zeros(count, dtype=np.uint8)))
    return Manifest(shards=table, fields=("cls",), version=version).encode_parts(PAGES)


def needed(count: int, layouts: list[tuple[int, int, int]], samples: list[int], version: int) -> set[int]:
    """Shards the runs read: the first AHEAD of each worker's order, and those of ``samples``."""
    counts = np.full(count, PER_SHARD, dtype=np.int64)
    shards = {i // PER_SHARD for i in samples}
    order = (EpochOrder(RunCounts.of(counts), PAGE_ROWS, 0, 0, True) if version == 3
             else EpochOrder(ArrayCounts(counts), None, 0, 0, True))
    for workers, rank, world in layouts:
        for worker in range(max(1, workers)):
            low, high = worker_bounds(len(counts) * PER_SHARD, rank=rank, world_size=world, worker=worker,
                                      num_workers=max(1, workers), equalize=world > 1)
            spans = PlanSpans(order, laps(len(counts) * PER_SHARD, low, high))
            for _, span in zip(range(AHEAD), spans, strict=False):
                shards.add(span.shard)
    return shards


def child(server: EmbeddedS3, endpoint: str, prefix: str, mode: str, *args: Any) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, endpoint, server.access_key, server.secret_key,
                          prefix, mode, *map(str, args)], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{mode} on {prefix} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--profile", choices=["loopback", *sorted(PROFILES)], default="loopback")
    parser.add_argument("--first-batch-only", action="store_true")
    parser.add_argument("--manifest-version", type=int, choices=[2, 3], default=3,
                        help="the manifest version to write (2: one object; 3: a head and pages)")
    args = parser.parse_args()
    body, entry = one_shard()
    results: dict[str, Any] = {}
    with (EmbeddedS3(buckets=[BUCKET]) as server, ThreadPoolExecutor(8) as pool,
          relayed(server.endpoint_url, args.profile) as (endpoint, _)):
        client = server.client()
        for count in args.sizes:
            prefix = f"n{count}"
            data, pages = manifest(count, entry, args.manifest_version)
            if pages is not None:
                client.put(BUCKET, f"{prefix}/{PAGES}", pages)
            client.put(BUCKET, f"{prefix}/manifest.msgpack", data)
            samples = [int(i) for i in np.random.default_rng(count).integers(0, count * PER_SHARD, RANDOM)]
            layouts = [(2, 0, 1), (1, 3, 8)] + ([(0, 0, 2), (4, 0, 2), (4, 1, 2)] if count == max(args.sizes) else [])
            shards = needed(count, layouts, samples, args.manifest_version)
            list(pool.map(lambda s: client.put(BUCKET, f"{prefix}/shard-{RUN}-{s:06d}-000.tar", body), shards))

            def median(mode: str, *extra: Any) -> dict[str, Any]:
                runs = [child(server, endpoint, prefix, mode, *extra) for _ in range(args.repeats)]
                return {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)} | {
                    k: runs[-1][k] for k in runs[0] if not isinstance(runs[0][k], float)}

            row: dict[str, Any] = {"manifest_mb": len(data) / 1e6, "pages_mb": len(pages or b"") / 1e6,
                                   "samples": count * PER_SHARD, "version": args.manifest_version}
            if args.first_batch_only:
                row["first_batch"] = median("first-batch", 2, 0, 1)
                results[str(count)] = row
                print(json.dumps({count: row}), flush=True)
                continue
            row["open_stream"] = median("open-stream")
            row["open_map"] = median("open-map")
            row["first_batch"] = median("first-batch", 2, 0, 1)
            row["open_rank"] = median("open-stream", 3, 8)
            row["rank_first_batch"] = median("first-batch", 1, 3, 8)
            row["random"] = median("random", *samples)
            if count == max(args.sizes):
                # Where a worker's private memory goes: the same first batch without the
                # prefetch budget (1 MiB ranges, one GET), then also without the shuffle buffer.
                lean = json.dumps({"prefetch_bytes": 1 << 20, "range_bytes": 1 << 20, "part_size": 1 << 20,
                                   "concurrency": 1})
                row["breakdown"] = {"bare": median("first-batch", 2, 0, 1, json.dumps({"bare": 1})),
                                    "lean": median("first-batch", 2, 0, 1, lean),
                                    "lean_small_buffer": median("first-batch", 2, 0, 1, lean, 64)}
                row["one_process"] = median("first-batch", 0, 0, 2)
                row["ranks"] = [median("first-batch", 4, rank, 2) for rank in (0, 1)]
            results[str(count)] = row
            print(json.dumps({count: row}), flush=True)
        client.close()
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _size(row: dict[str, Any]) -> str:
    """The manifest's size: one object (version 2), or its head and its pages (version 3)."""
    if row.get("pages_mb"):
        return f"{1000 * row['manifest_mb']:.0f} kB head, {row['pages_mb']:.0f} MB pages"
    if row.get("version") == 3:
        return f"{1000 * row['manifest_mb']:.0f} kB, pages inline"
    return f"{row['manifest_mb']:.1f} MB"


def report(results: dict[str, Any]) -> str:
    if "open_stream" not in next(iter(results.values())):
        smallest = results[min(results, key=int)]["first_batch"]["seconds"]
        lines = ["| shards (samples) | manifest | first batch (2 workers) | against the smallest |",
                 "|---|---|---|---|"]
        lines += [
            f"| {int(count):,d} ({row['samples']:,d}) | {_size(row)} "
            f"| {row['first_batch']['seconds']:.2f} s | {row['first_batch']['seconds'] / smallest:.2f}x |"
            for count, row in results.items()
        ]
        return "\n".join(lines)
    lines = [
        "| shards (samples) | manifest | open RemoteDataset (time, RSS, read) | open RemoteMapDataset "
        "| first batch (2 workers) | USS per worker | ds[i] cold / warm |",
        "|---|---|---|---|---|---|---|",
    ]
    for count, row in results.items():
        workers = row["first_batch"]["workers"]
        lines.append(
            f"| {int(count):,d} ({row['samples']:,d}) | {_size(row)} "
            f"| {row['open_stream']['seconds']:.3f} s, +{row['open_stream']['rss_mb']:.0f} MB,"
            f" {1000 * row['open_stream']['read_mb']:.0f} kB "
            f"| {row['open_map']['seconds']:.3f} s, +{row['open_map']['rss_mb']:.0f} MB "
            f"| {row['first_batch']['seconds']:.2f} s "
            f"| {statistics.mean(w['uss'] for w in workers):.0f} MB "
            f"| {row['random']['cold_ms']:.1f} / {row['random']['warm_ms']:.1f} ms |"
        )
    smallest = results[min(results, key=int)]
    lines += ["", "One rank of 8 (rank 3), and its one DataLoader worker:", "",
              "| shards | open: time, RSS added, bytes read | first batch | against the smallest | worker USS |",
              "|---|---|---|---|---|"]
    for count, row in results.items():
        opened, first = row["open_rank"], row["rank_first_batch"]
        lines.append(
            f"| {int(count):,d} | {opened['seconds']:.3f} s, +{opened['rss_mb']:.0f} MB,"
            f" {1000 * opened['read_mb']:.0f} kB "
            f"| {first['seconds']:.2f} s | {first['seconds'] / smallest['rank_first_batch']['seconds']:.2f}x "
            f"| {statistics.mean(w['uss'] for w in first['workers']):.0f} MB |"
        )
    largest = results[max(results, key=int)]
    if "breakdown" in largest:
        parts = {"default": largest["first_batch"], **largest["breakdown"]}
        uss = {name: statistics.mean(w["uss"] for w in run["workers"]) for name, run in parts.items()}
        lines.append("")
        lines.append(
            f"Worker USS at the first batch, largest size: {uss['default']:.0f} MB; with 1 MiB ranges and one GET"
            f" {uss['lean']:.0f} MB; and a 64-sample shuffle buffer {uss['lean_small_buffer']:.0f} MB; a bare"
            f" forked worker handing out ints {uss['bare']:.0f} MB"
        )
    if "ranks" in largest:
        one = largest["one_process"]["main"]["pss"]
        ranks = largest["ranks"]
        total = sum(r["main"]["pss"] + sum(w["pss"] for w in r["workers"]) for r in ranks)
        uss = [w["uss"] for r in ranks for w in r["workers"]]
        lines.append("")
        rank_pss = ", ".join(f"{r['main']['pss']:.0f}" for r in ranks)
        lines.append(
            f"2 ranks x 4 workers at the largest size: PSS of all 10 processes {total:.0f} MB "
            f"(ranks {rank_pss} MB; workers' USS "
            f"{min(uss):.0f}-{max(uss):.0f} MB) against {one:.0f} MB for 1 process without workers"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
