"""The node benchmark: remote_loader's default set-up against a sweep of workers x threads and
against WebDataset, on one machine with many cores, in a few minutes.

    bash run.sh [--images 20000] [--out DIR] [--budget 280]     # on a node, from the bundle
    python benchmarks/node/run.py --images 1000                 # in a checkout (scikit-image, webdataset)

Makes the suite's JPEGs (``benchmarks/suite/data.py``, one generator per image, on every
core), starts SeaweedFS on loopback, writes them with remote_loader's uploader and with
WebDataset's writer, then streams one shuffled epoch per row, each in a fresh process:

- remote_loader as the README shows it (``loader(ds)``: a worker per core of the rank), in
  scenarios A (bytes only), B-fused (``RandomResizedCrop(224)``) and B (Pillow decode + RRC
  + flip as a user ``map``), batches of 64;
- remote_loader at a sweep: one process with a stage thread per core (``num_workers=0``),
  and 4, 8, 16 (up to the cores) workers, each without and with 2 stage threads;
- WebDataset at 8 and 16 workers (A and B), set up as in the suite (``suite/systems.py``);
- on a GPU (B-gpu, batches of 256): remote_loader's ``decode(RandomResizedCrop(224),
  device="cuda")`` through ``loader()`` (and at 8 workers); WebDataset with 8 workers and
  torchvision's GPU ``decode_jpeg`` of each batch, then a crop, resize and flip per image,
  as its users write it; and both decoders on 2,048 JPEGs held in memory (their ceilings).
  Without a GPU, where nvImageCodec is installed (the ``gpu`` extra), our B-gpu rows run on
  its CPU backend (``device="cpu", batched=True``: the same code path, so it runs end to
  end anywhere); torchvision's need a GPU.

Per row: samples/s, time to the first batch, cores busy (CPU-seconds of the process and
its workers per second), and the node's memory for the loader: the peak of the sum of PSS
over the process and its workers (shared pages counted once), sampled every 0.1 s. Then
``gil_cost.py`` from memory (GIL-held microseconds per sample on this node, and its Python
speed). Rows run most important first, within ``--budget`` seconds; results are written
after each row to ``<out>/node-<device>.json`` (device: the GPU's name, or the CPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent
sys.path.insert(0, str(BENCHMARKS / "suite"))

BUCKET = "node"
SHUFFLE = 1000
_SAMPLE_EVERY = 0.1


def device() -> str:
    """The GPU's name (``nvidia-h200``), or the CPU's cores (``cpu-16``)."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return f"cpu-{os.cpu_count()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or f"cpu-{os.cpu_count()}"


# ---------------------------------------------------------------------------- one epoch, in a child


def _ours(spec: dict) -> Any:
    from augment import BATCH, count_batch, stack_batch

    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    client = make_client(spec["endpoint"], spec["access_key"], spec["secret_key"])
    base = RemoteDataset(client, BUCKET, "ours", seed=0).shuffle(SHUFFLE)
    scenario, threads = spec["scenario"], spec["threads"]
    if scenario == "A":
        ds = base.to_tuple("jpg", "cls").batched(BATCH, count_batch)
    elif scenario == "B-fused":
        ds = base.decode(RandomResizedCrop(224), threads=threads).to_tuple("jpg", "cls").batched(BATCH, stack_batch)
    else:
        ds = base.to_tuple("jpg", "cls").map(_augment_pair, threads=threads).batched(BATCH, stack_batch)
    return loader(ds) if spec["workers"] is None else loader(ds, num_workers=spec["workers"])


GPU_BATCH = 256
SMOKE_SECONDS = 90
IN_MEMORY = 2048


def _ours_on_gpu(spec: dict) -> Any:
    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    client = make_client(spec["endpoint"], spec["access_key"], spec["secret_key"])
    ds = (RemoteDataset(client, BUCKET, "ours", seed=0).shuffle(SHUFFLE)
          .decode(RandomResizedCrop(224), device=spec["device"], batched=True).to_tuple("jpg", "cls")
          .batched(GPU_BATCH))
    return loader(ds) if spec["workers"] is None else loader(ds, num_workers=spec["workers"])


def torchvision_augment(datas: list[Any]) -> Any:
    """What a WebDataset user writes for GPU decoding: torchvision's batched ``decode_jpeg`` on
    the GPU, then its RandomResizedCrop box, an antialiased resize and a flip per image."""
    import random

    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import RandomResizedCrop
    from torchvision.transforms.v2 import functional as tvf

    images = decode_jpeg([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas], device="cuda")
    out = []
    for image in images:
        top, left, height, width = RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3))
        crop = tvf.resized_crop(image, top, left, height, width, [224, 224], antialias=True)
        out.append(tvf.horizontal_flip(crop) if random.random() < 0.5 else crop)
    return torch.stack(out)


def _webdataset_on_gpu(spec: dict) -> Any:
    import systems
    import webdataset as wds
    from torch.utils.data import DataLoader

    target = systems.Target(spec["endpoint"], BUCKET, spec["access_key"], spec["secret_key"])
    os.environ.update(target.environ())
    wds.gopen_schemes["s3"] = systems._s3_opener
    listing = target.boto3().list_objects_v2(Bucket=BUCKET, Prefix="wds/")
    urls = sorted(f"s3://{BUCKET}/{o['Key']}" for o in listing.get("Contents", []) if o["Key"].endswith(".tar"))
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, nodesplitter=wds.single_node_only,
                              workersplitter=wds.split_by_worker, empty_check=False)
               .shuffle(SHUFFLE).to_tuple("jpg", "cls").batched(GPU_BATCH, collation_fn=list))
    batches = DataLoader(dataset, batch_size=None, num_workers=spec["workers"], pin_memory=True)
    return ((torchvision_augment([d for d, _ in batch]), [int(c) for _, c in batch]) for batch in batches)


def _in_memory(spec: dict) -> Any:
    """Batches of ``GPU_BATCH`` of the first ``IN_MEMORY`` JPEGs, four times over, decoded
    by one of the two decoders in this thread: the decoder's own ceiling (on the CPU backend,
    one batch: its dense resize is for a GPU)."""
    import numpy as np

    from remote_loader import RandomResizedCrop
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, check_device, prepare

    on_gpu = spec["device"] == "cuda"
    datas = [p.read_bytes() for p in sorted(Path(spec["images"]).glob("*.jpg"))[: IN_MEMORY if on_gpu else GPU_BATCH]]
    crop, rng = RandomResizedCrop(224), np.random.default_rng(0)
    place = check_device(spec["device"], True)
    assert place is not None
    decoder = DeviceDecoder(crop, place)
    for _ in range(4 if on_gpu else 1):
        for first in range(0, len(datas), GPU_BATCH):
            chunk = datas[first : first + GPU_BATCH]
            if spec["decoder"] == "torchvision":
                images = torchvision_augment(chunk)
            else:
                batch = EncodedBatch([prepare(crop, d, rng, str(i), "memory") for i, d in enumerate(chunk)])
                batch = batch.pin_memory() if on_gpu else batch
                images, _ = decoder.decode(batch)
            yield images, [0] * len(chunk)


def _augment_pair(pair: tuple[Any, Any]) -> tuple[Any, int]:
    from augment import plain_augment

    return plain_augment(pair[0]), int(pair[1])


def _webdataset(spec: dict) -> Any:
    import systems

    target = systems.Target(spec["endpoint"], BUCKET, spec["access_key"], spec["secret_key"])
    return systems.loader("webdataset", target, "wds", spec["scenario"], spec["workers"], tempfile.gettempdir())


def epoch(spec: dict) -> dict[str, Any]:
    """One shuffled epoch: samples, seconds, first batch, and the CPU-seconds of this process
    and its workers (counted once they have exited)."""
    import torch

    torch.set_num_threads(1)
    import systems

    systems.prepare("remote_loader" if spec["system"] == "ours" else "webdataset")
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    if spec["scenario"] == "B-gpu":
        stream = {"ours": _ours_on_gpu, "webdataset": _webdataset_on_gpu, "memory": _in_memory}[spec["system"]](spec)
    else:
        stream = _ours(spec) if spec["system"] == "ours" else _webdataset(spec)
    workers = getattr(stream, "num_workers", spec.get("workers") or 0)
    samples, first = 0, 0.0
    for batch in stream:
        samples += batch[0] if spec["scenario"] == "A" else len(batch[1])
        if not first:
            first = time.perf_counter() - started
        del batch
    if spec["scenario"] == "B-gpu" and spec["device"] == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del stream  # persistent workers end here, and are counted below
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (own.ru_utime - before.ru_utime + own.ru_stime - before.ru_stime + children.ru_utime + children.ru_stime)
    return {"samples": samples, "seconds": seconds, "first_batch_seconds": first, "workers": workers,
            "rate": samples / seconds, "steady_rate": samples / max(1e-9, seconds - first), "cores": cpu / seconds}


# ---------------------------------------------------------------------------- the orchestration


def tree_pss(pid: int) -> int:
    """The sum of PSS over a process and its descendants (shared pages counted once)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def measure(spec: dict, timeout: float) -> dict[str, Any]:
    """An epoch in a fresh process, with the peak PSS of its process tree."""
    os.sync()  # the pages a run before left dirty are not written back during this one
    process = subprocess.Popen([sys.executable, __file__, "--epoch", json.dumps(spec)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(_SAMPLE_EVERY):
            peak = max(peak, tree_pss(process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise RuntimeError(f"the epoch took more than {timeout:.0f} s") from None
    finally:
        stop.set()
        sampler.join()
    if process.returncode != 0:
        raise RuntimeError(err[-3000:])
    return {**json.loads(out.strip().splitlines()[-1]), "peak_pss_mb": peak / 1e6}


def rows(cores: int, device: str | None) -> list[dict[str, Any]]:
    """The rows, most important first (the GPU's after the defaults and the peers). ``device``:
    where the B-gpu rows decode (``cuda``; ``cpu``, nvImageCodec's CPU backend, runs ours
    only: torchvision's GPU decode needs a GPU); None: no B-gpu rows."""
    sweep = sorted({w for w in (4, 8, 16) if w <= cores} | {cores})
    out: list[dict[str, Any]] = []
    for scenario in ("A", "B-fused"):
        out.append({"system": "ours", "scenario": scenario, "workers": None, "threads": 0, "default": True})
    out += [{"system": "webdataset", "scenario": "A", "workers": min(8, cores)},
            {"system": "webdataset", "scenario": "B", "workers": min(16, cores)}]
    gpu: list[dict[str, Any]] = [
        {"system": "ours", "scenario": "B-gpu", "workers": None, "threads": 0, "default": True, "device": device},
        {"system": "memory", "scenario": "B-gpu", "workers": 0, "decoder": "ours", "device": device}]
    if device == "cuda":
        out += [gpu[0], {"system": "webdataset", "scenario": "B-gpu", "workers": min(8, cores), "device": device},
                gpu[1], {"system": "memory", "scenario": "B-gpu", "workers": 0, "decoder": "torchvision",
                         "device": device},
                {"system": "ours", "scenario": "B-gpu", "workers": min(8, cores), "threads": 0, "device": device}]
    for scenario in ("A", "B-fused"):
        out.append({"system": "ours", "scenario": scenario, "workers": 0, "threads": cores})
        for workers in sweep:
            for threads in (0, 2) if scenario != "A" else (0,):
                out.append({"system": "ours", "scenario": scenario, "workers": workers, "threads": threads})
    out += [{"system": "ours", "scenario": "B", "workers": None, "threads": 0, "default": True},
            {"system": "webdataset", "scenario": "A", "workers": min(16, cores)},
            {"system": "webdataset", "scenario": "B", "workers": min(8, cores)}]
    if device == "cpu":  # the GPU's code path on nvImageCodec's CPU backend: a check that it runs, last
        out += gpu
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for row in out:  # on fewer cores some set-ups are the same
        key = (row["system"], row["scenario"], row["workers"], row.get("threads", 0), row.get("default", False),
               row.get("decoder"))
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def name(row: dict[str, Any]) -> str:
    if row["system"] == "memory":
        held = IN_MEMORY if row["device"] == "cuda" else GPU_BATCH
        return f"{row['decoder']} B-gpu on {row['device']}, {held} JPEGs in memory"
    workers = "default (loader)" if row.get("default") else f"workers={row['workers']}"
    threads = f", threads={row['threads']}" if row["system"] == "ours" and row.get("threads") else ""
    device = f" on {row['device']}" if row.get("device") else ""
    return f"{row['system']} {row['scenario']}{device} {workers}{threads}"


def environment(cores: int) -> dict[str, Any]:
    import torch

    import remote_loader
    from remote_loader.errors import ConfigError
    from remote_loader.pipeline.device import nvimgcodec

    commit = (BENCHMARKS.parent / ".git").exists() and subprocess.run(
        ["git", "-C", str(BENCHMARKS.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    gpu_rows: str | None = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: nvImageCodec's CPU backend
    if gpu_rows == "cpu":  # on a GPU our rows run and fail alone (naming the extra), the peers' still run
        try:
            nvimgcodec()
        except ConfigError:
            gpu_rows = None
    return {"device": device(), "cores": cores, "rank_cores": remote_loader.rank_cores(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "gpu_rows": gpu_rows, "remote_loader": remote_loader.__version__,
            "commit": commit or os.environ.get("NODE_BENCH_COMMIT") or None}


def prepare(images: int, cores: int, folder: Path, server: Any) -> dict[str, Any]:
    """The JPEGs, written by remote_loader's uploader and by WebDataset's writer."""
    import data
    import systems

    from remote_loader import upload_cv_dataset

    started = time.perf_counter()
    items = data.build_parallel(folder, images, cores)
    made = time.perf_counter() - started
    target = systems.Target(server.endpoint_url, BUCKET, server.access_key, server.secret_key)

    class Files:
        def __len__(self) -> int:
            return len(items)

        def __getitem__(self, i: int) -> tuple[bytes, int]:
            return Path(items[i][0]).read_bytes(), items[i][1]

    summary = upload_cv_dataset(Files(), client=server.client(), bucket=BUCKET, base_folder="ours", maxsize=64e6,
                                workers=min(cores, 8), progress=False)
    systems.write("webdataset", [(str(p), label) for p, label in items], target, "wds")
    return {"images": images, "sample_kb": summary.bytes / summary.samples / 1e3, "generate_seconds": made,
            "prepare_seconds": time.perf_counter() - started}


def gil(images: int, budget: float) -> dict[str, Any] | None:
    """``gil_cost.py`` on this node (A and B-fused from memory), its JSON."""
    out = Path(tempfile.mkdtemp(prefix="node-gil-")) / "gil.json"
    command = [sys.executable, str(BENCHMARKS / "gil_cost.py"), "--images", str(images), "--repeats", "1",
               "--scenarios", "A", "B-fused", "--cores", str(os.cpu_count()), "--json", str(out)]
    try:
        subprocess.run(command, check=True, timeout=budget, capture_output=True, text=True)
        return json.loads(out.read_text())["this"]
    except (subprocess.SubprocessError, OSError, KeyError, ValueError) as error:
        return {"error": str(error)[-500:]}
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def smoke(shared: dict[str, str], images: Path, out: Path) -> dict[str, Any]:
    """``smoke.py`` in a fresh process, before any row: its checks, or why it failed."""
    path = out / "smoke.json"
    command = [sys.executable, str(HERE / "smoke.py"), "--images", str(images), "--endpoint", shared["endpoint"],
               "--access-key", shared["access_key"], "--secret-key", shared["secret_key"], "--bucket", BUCKET,
               "--json", str(path)]
    try:
        done = subprocess.run(command, timeout=SMOKE_SECONDS, capture_output=True, text=True)
        print(done.stdout[-6000:], done.stderr[-3000:], flush=True)
    except subprocess.TimeoutExpired:
        print(f"the smoke check took more than {SMOKE_SECONDS} s", flush=True)
    return json.loads(path.read_text()) if path.exists() else {"error": "no result"}


def summary(results: dict[str, Any]) -> list[str]:
    """The table, and the default set-up against the best of the sweep per scenario."""
    lines = ["| set-up | samples/s | cores busy | first batch (s) | loader PSS (MB) |", "|---|---|---|---|---|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error'][-80:]} | | | |")
            continue
        lines.append(f"| {row['name']} | {row['rate']:,.0f} | {row['cores']:.1f} | {row['first_batch_seconds']:.2f} |"
                     f" {row['peak_pss_mb']:,.0f} |")
    for scenario in ("A", "B-fused", "B", "B-gpu"):
        ours = [r for r in results["rows"] if r.get("system") == "ours" and r["scenario"] == scenario and "rate" in r]
        default = [r["rate"] for r in ours if r.get("default")]
        if default and len(ours) > 1:
            best = max(ours, key=lambda r: r["rate"])
            lines.append(f"\n{scenario}: the default gives {default[0] / best['rate']:.0%} of the best row"
                         f" ({best['name']}, {best['rate']:,.0f}/s)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epoch", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    parser.add_argument("--gil-images", type=int, default=4000, help="images for gil_cost.py (0: skip it)")
    parser.add_argument("--gpu-only", action="store_true", help="the smoke check and the B-gpu rows alone")
    args = parser.parse_args()
    if args.epoch:
        print(json.dumps(epoch(json.loads(args.epoch))), flush=True)
        os._exit(0)  # a peer's non-daemon threads may linger; the result is out
    run(args)


def run(args: argparse.Namespace) -> None:
    from remote_loader.testing.server import EmbeddedS3

    started = time.monotonic()
    cores = os.cpu_count() or 1
    results: dict[str, Any] = {"environment": environment(cores), "rows": []}
    path = args.out / f"node-{results['environment']['device']}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="node-bench-images-"))
    try:
        with EmbeddedS3(buckets=[BUCKET]) as server:
            results["data"] = prepare(args.images, cores, folder, server)
            print(f"data: {results['data']}", flush=True)
            shared = {"endpoint": server.endpoint_url, "access_key": server.access_key,
                      "secret_key": server.secret_key}
            for warm in ({"system": "ours", "scenario": "A", "workers": 0, "threads": 0},
                         {"system": "webdataset", "scenario": "A", "workers": 0}):
                measure({**shared, **warm}, timeout=args.budget)  # every object read once: no row reads cold
            results["smoke"] = smoke(shared, folder, args.out)
            chosen = rows(cores, results["environment"]["gpu_rows"])
            if args.gpu_only:
                chosen = [row for row in chosen if row["scenario"] == "B-gpu"]
            for row in chosen:
                left = args.budget - (time.monotonic() - started) - (60 if args.gil_images else 0)
                if left < 20:
                    results.setdefault("skipped", []).append(name(row))
                    continue
                try:
                    spec = {**shared, **row, "images": str(folder)}
                    result = {"name": name(row), **row, **measure(spec, timeout=left)}
                except RuntimeError as error:
                    result = {"name": name(row), **row, "error": str(error)}
                results["rows"].append(result)
                print(json.dumps(result), flush=True)
                path.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.gil_images:
        left = args.budget - (time.monotonic() - started)
        results["gil"] = gil(args.gil_images, max(30.0, left)) if left > 30 else {"skipped": "out of time"}
    results["seconds"] = time.monotonic() - started
    results["rates"] = {r["name"]: r["rate"] for r in results["rows"] if "rate" in r}
    path.write_text(json.dumps(results, indent=1))
    print("\n".join(summary(results)))
    print(f"\n{path} written in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
