"""Node-local caches across the S3-like link: ours against MosaicML Streaming's (``local``) and
LitData's (``cache_dir``), each written by its own writer and read as the suite reads it
(``suite/systems.py``: scenario A, bytes only, a shuffled epoch, batches of 64).

1. One process, two epochs of one DataLoader (a training loop's): epoch 1 with the cache
   emptied, epoch 2 with it kept; samples/s, the first batch, and the bytes and requests each
   sent to the store, counted by the relay (``shaper.py --counters``). Ours without a cache and
   ours on loopback (no relay, no cache: the rate epoch 2 must reach) beside them.
2. Two ranks of one node (torch.distributed over gloo, one process each, 0 workers), two
   epochs: what they fetched from the store together, with the cache and without it.

    BENCH_SHARD_BYTES=16000000 python benchmarks/cache.py [--images 3000] [--workers 0 2]
        [--profile s3-same-region] [--repeats 3] [--cache-rows] [--shorter 32 32]
        [--out results/cache-<commit>.json]

``--cache-rows`` runs only the rows of (1) with each system's cache: epoch 2 there is each
loader's own cost per sample, the store out of the way. ``--views`` adds ours with
``views=True`` (members as read-only views of the cache's mapped files, as LitData hands out
its items: no copy). ``--read`` has each batch's consumer
read one byte of each 4 KB page of each sample (``augment.read_batch``), as a decoder would:
without it a loader that hands out views of a memory-mapped file it never reads (LitData)
is timed without reading the bytes at all, one that hands out ``bytes`` (ours) with a copy.
Two trees compared alternate runs of ``--repeats 1``, each with ``PYTHONPATH`` naming its
tree (the child processes inherit it).

Every row is a fresh process (each system's cache emptied first), each row run ``--repeats``
times in turn; the tables show the run of the median rate per epoch. The relay and the server
are ended by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "suite")]

from shaper import Counters, relayed  # noqa: E402
from systems import settings  # noqa: E402

PEERS = ("remote_loader", "streaming", "litdata")


# ---------------------------------------------------------------------------- in a child process


def _ours(target: Any, prefix: str, workers: int, collate: Callable[[list[Any]], Any], views: bool) -> Any:
    """Ours as the suite reads it (``systems._load_remote_loader``, scenario A), the rank from
    torch.distributed; the cache from ``REMOTE_LOADER_CACHE_DIR`` when the row has one;
    members as ``bytes`` or, with ``views``, as views of the cache's mapped files."""
    from augment import BATCH
    from systems import SHUFFLE_BUFFER
    from torch.utils.data import DataLoader

    from remote_loader import RemoteDataset, make_client

    client = make_client(target.endpoint, target.access_key, target.secret_key)
    options = {"views": True} if views else {}  # an older tree, compared, has no such argument
    stream = RemoteDataset(client, target.bucket, prefix, seed=0, **options)
    stream = stream.shuffle(SHUFFLE_BUFFER).to_tuple("jpg", "cls")
    return DataLoader(stream.batched(BATCH, collate), batch_size=None, num_workers=workers)


def child(system: str, prefix: str, workers: int, cache: str, counters: str, epochs: int,
          setting: str | None = None) -> list[dict[str, float]]:
    """``epochs`` epochs of one loader; per epoch its rate, first batch and what went to the store."""
    import systems

    systems.prepare(system)
    target = systems.Target(os.environ["BENCH_ENDPOINT"], os.environ["BENCH_BUCKET"], os.environ["BENCH_ACCESS_KEY"],
                            os.environ["BENCH_SECRET_KEY"])
    distributed = _join_world()
    count = Counters(counters) if counters else None
    started = time.perf_counter()
    scenario = "A-read" if os.environ.get("BENCH_READ") == "1" else "A"
    if system == "remote_loader":
        os.environ.update(target.environ())
        loader = _ours(target, prefix, workers, systems._collate(scenario), setting == "views")
    else:
        loader = systems.loader(system, target, prefix, scenario, workers, cache, setting)
    out = []
    for _ in range(epochs):
        before = count.read() if count else (0, 0)
        samples, first = 0, 0.0
        for batch in loader:
            samples += batch[0]
            if not first:
                first = time.perf_counter() - started
        seconds = time.perf_counter() - started
        if distributed is not None:
            distributed.barrier()  # every rank's epoch is over before the relay's counters are read
        after = count.read() if count else (0, 0)
        out.append({"samples": samples, "seconds": seconds, "first_batch_seconds": first,
                    "store_bytes": after[0] - before[0], "store_requests": after[1] - before[1]})
        started = time.perf_counter()
    return out


def _join_world() -> Any:
    """torch.distributed (gloo) where the row has ranks, as a DDP job would: every system finds
    its rank there (or in RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, also set)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist


# ---------------------------------------------------------------------------- the run


def _env(target: Any, cache: str | None, rank: int = 0, world: int = 1, port: int = 0) -> dict[str, str]:
    env = {**os.environ, "BENCH_ENDPOINT": target.endpoint, "BENCH_BUCKET": target.bucket,
           "BENCH_ACCESS_KEY": target.access_key, "BENCH_SECRET_KEY": target.secret_key,
           "LITDATA_DISABLE_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"}
    env.pop("REMOTE_LOADER_CACHE_DIR", None)
    if cache:
        env["REMOTE_LOADER_CACHE_DIR"] = cache  # ours: the cache from the environment, as a job script sets it
    if world > 1:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _rows(system: str, target: Any, workers: int, cache: str | None, counters: str, world: int = 1,
          epochs: int = 2, setting: str | None = None) -> list[list[dict[str, float]]]:
    """One row: ``world`` ranks in processes of their own; each rank's epochs."""
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    port = _free_port()
    command = [sys.executable, __file__, "child", system, system, str(workers), cache or "", counters, str(epochs),
               *([setting] if setting else [])]
    procs = [subprocess.Popen(command, env=_env(target, cache, rank, world, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir()) for rank in range(world)]
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"{system} (workers {workers}, cache {bool(cache)}): {stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _line(name: str, epochs: list[dict[str, float]]) -> str:
    cells = []
    for e in epochs:
        rate = e["samples"] / e["seconds"] if e["seconds"] else 0.0
        cells.append(f"{rate:8,.0f}/s {e['store_bytes'] / 1e6:8,.1f} MB {e['store_requests']:6,d} req")
    return f"{name:<48}" + " | ".join(cells)


def _measure(args: argparse.Namespace, target: Any, shaped: Any, counters: str, work: Path,
             record: Callable[[str, list[dict[str, float]]], None], failed: dict[str, str]) -> None:
    """Every row once, in this order: at each worker count each system with its cache, ours
    without; two ranks of each; ours on loopback."""
    for workers in args.workers:
        for system in args.systems:
            for setting in _settings(system, args.views):  # LitData: batch_decode 1 and all, as the suite tries it
                name = f"{system}, {workers} workers{_setting_name(system, setting)}, cache"
                try:
                    (epochs,) = _rows(system, shaped, workers, str(work / f"cache-{system}"), counters, setting=setting)
                except RuntimeError as error:  # a row that fails is reported as failed; the others still run
                    failed.setdefault(name, str(error).strip().splitlines()[-1])
                    print(f"{name:<48}failed: {failed[name]}", flush=True)
                    continue
                record(name, epochs)
        if args.cache_rows:
            continue
        (epochs,) = _rows("remote_loader", shaped, workers, None, counters)
        record(f"remote_loader, {workers} workers, no cache", epochs)
    if args.cache_rows:
        return
    for system in args.systems:
        for cache in (True, False) if system == "remote_loader" else (True,):
            ranks = _rows(system, shaped, 0, str(work / f"cache-{system}") if cache else None, counters, world=2,
                          setting=settings(system)[-1])
            record(f"{system}, 2 ranks, {'cache' if cache else 'no cache'}", ranks[0])  # rank 0 read the counters
    for workers in args.workers:
        (epochs,) = _rows("remote_loader", target, workers, None, "", epochs=1)
        record(f"remote_loader, {workers} workers, loopback, no cache", epochs)


def _settings(system: str, views: bool) -> tuple[str | None, ...]:
    """Each setting a system's cache rows are run with: ours with ``bytes`` and, with
    ``--views``, with ``views=True`` too; LitData's ``batch_decode`` values."""
    if system == "remote_loader":
        return (None, "views") if views else (None,)
    return settings(system)


def _setting_name(system: str, setting: str | None) -> str:
    if setting is None:
        return ""
    return f", {setting}" if system == "remote_loader" else f", batch_decode={setting}"


def _median(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per epoch, the run of the median rate (its bytes and requests with it)."""
    out = []
    for epoch in range(len(runs[0])):
        ranked = sorted((r[epoch] for r in runs), key=lambda e: e["samples"] / e["seconds"] if e["seconds"] else 0.0)
        out.append(ranked[len(ranked) // 2])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--profile", default="s3-same-region")
    parser.add_argument("--systems", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every row; the tables show medians")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "remote-loader-bench-images",
                        help="where the generated JPEGs are kept between runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--cache-rows", action="store_true", help="only the rows of (1) with each system's cache")
    parser.add_argument("--read", action="store_true", help="each batch's consumer reads a byte of each page")
    parser.add_argument("--views", action="store_true", help="ours also with views=True (members as views)")
    parser.add_argument("--shorter", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="the images' shorter side in pixels (default 300-500, ImageNet-like; 32 32: CIFAR-sized)")
    args = parser.parse_args()
    if args.read:
        os.environ["BENCH_READ"] = "1"  # the children's consumers read what they are given

    import data
    import servers
    import stubs
    import systems

    stubs.install()  # the peers' writers import torchvision, whose CUDA build here does not import whole

    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    runs: dict[str, list[list[dict[str, float]]]] = {}
    failed: dict[str, str] = {}  # row -> the last line of its first failure

    def record(name: str, epochs: list[dict[str, float]]) -> None:
        runs.setdefault(name, []).append(epochs)
        print(_line(name, epochs), flush=True)

    try:
        shorter = tuple(args.shorter) if args.shorter else data.SHORTER
        folder = args.data / (str(args.images) + ("" if shorter == data.SHORTER else "-{}-{}".format(*shorter)))
        items = [(str(p), label) for p, label in data.build(folder, args.images, shorter=shorter)]
        with servers.seaweedfs() as (target, _):
            for system in args.systems:
                systems.write(system, items, target, system)
            counters = str(work / "counters")
            with relayed(target.endpoint, args.profile, counters) as (endpoint, _):
                shaped = systems.Target(endpoint, target.bucket, target.access_key, target.secret_key)
                print(f"{args.images:,d} images through {args.profile}; per epoch: samples/s, what went to the store")
                for repeat in range(args.repeats):
                    print(f"run {repeat + 1} of {args.repeats}", flush=True)
                    _measure(args, target, shaped, counters, work, record, failed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: _median(found) for name, found in runs.items()}
    print(f"medians of {args.repeats}:")
    for name, epochs in medians.items():
        print(_line(name, epochs))
    if args.out:
        Path(args.out).write_text(json.dumps({"images": args.images, "profile": args.profile, "shorter": args.shorter,
                                              "shard_bytes": systems.SHARD_BYTES, "medians": medians, "runs": runs,
                                              "failed": failed},
                                             indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        system, prefix, workers, cache, counters, epochs = sys.argv[2:8]
        setting = sys.argv[8] if len(sys.argv) > 8 else None
        print(json.dumps(child(system, prefix, int(workers), cache, counters, int(epochs), setting)))
    else:
        main()
