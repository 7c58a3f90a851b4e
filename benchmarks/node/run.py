"""The node benchmark: remote_loader's default set-up against a sweep of workers x threads and
against WebDataset, on one machine with many cores, in a few minutes.

    bash run.sh [--images 20000] [--out DIR] [--budget 280]     # on a node, from the bundle
    python benchmarks/node/run.py --images 1000                 # in a checkout (scikit-image, webdataset)

Makes the suite's JPEGs (``benchmarks/suite/data.py``, one generator per image, on every
core), starts SeaweedFS on loopback, writes them with remote_loader's uploader and with
WebDataset's writer, then streams one shuffled epoch per row, each in a fresh process:

- remote_loader as the README shows it (``loader(ds)``: a worker per core of the rank, 4 at
  most where the workers only fetch, as in A), in
  scenarios A (bytes only), B-fused (``RandomResizedCrop(224)``) and B (Pillow decode + RRC
  + flip as a user ``map``), batches of 64;
- remote_loader at a sweep: one process with a stage thread per core (``num_workers=0``),
  and 4, 8, 16 (up to the cores) workers, each without and with 2 stage threads;
- WebDataset at 8 and 16 workers (A and B), set up as in the suite (``suite/systems.py``);
- on a GPU (B-gpu, batches of 256; ``gpu.py``): remote_loader's ``decode(RandomResizedCrop(224),
  device="cuda")`` through ``loader()``; the ceiling (nvImageCodec alone decoding whole
  batches from memory, the hardware decoder alone and splitting batches with the hybrid
  decoder); DALI's ImageNet training pipeline fed from the bucket and from memory;
  WebDataset with torchvision's GPU decode as its users write it; a ResNet-50 training
  step alone and fed by ours (and by DALI); ours beside a spinning Python thread; both
  decoders from memory. Without a GPU the rows that can run on the CPU do, last (ours on
  nvImageCodec's CPU backend, nvImageCodec alone, DALI's CPU operators where installed): a
  check that the script runs end to end.

Per row: samples/s, time to the first batch, cores busy (CPU-seconds of the process and
its workers per second), and the node's memory for the loader: the peak of the sum of PSS
over the process and its workers (shared pages counted once), sampled every 0.1 s. Then,
where there are GPU rows, ``beside_python.py`` (the GPU stage beside a Python thread, and
the GIL-held microseconds an image of the process that iterates), and but for
``--gpu-only`` ``gil_cost.py`` from memory (GIL-held microseconds per sample on this node,
and its Python speed). Rows run most important first, within ``--budget`` seconds; results
are written after each row to ``<out>/node-<device>.json`` (device: the GPU's name, or the
CPU's), and the GPU stage's targets are printed as ratios of this run's rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
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


SMOKE_SECONDS = 120
TRAIN_STEPS = 40  # the training rows: 10,240 images, the first step's start-up included once


def _augment_pair(pair: tuple[Any, Any]) -> tuple[Any, int]:
    from augment import plain_augment

    return plain_augment(pair[0]), int(pair[1])


def _webdataset(spec: dict) -> Any:
    import systems

    target = systems.Target(spec["endpoint"], BUCKET, spec["access_key"], spec["secret_key"])
    return systems.loader("webdataset", target, "wds", spec["scenario"], spec["workers"], tempfile.gettempdir())


def _gpu_stream(spec: dict) -> Any:
    import gpu

    system = spec["system"]
    if system == "ours":
        return gpu.ours(spec, BUCKET, SHUFFLE)
    if system == "webdataset":
        return gpu.webdataset(spec, BUCKET, SHUFFLE)
    if system == "dali":
        return gpu.dali(spec, BUCKET)
    if system == "model":
        return gpu.model(spec, TRAIN_STEPS)
    return {"memory": gpu.memory, "raw": gpu.raw}[system](spec)


class Spinner:
    """A thread spinning pure Python (a training step's Python, logging, a tokenizer at their
    worst): the share of its loops a second alone that it keeps beside the loader. Alone and
    beside, the same loop, stopped by an event."""

    def __init__(self) -> None:
        alone = threading.Event()
        threading.Timer(0.5, alone.set).start()
        self.alone = self._spin(alone)
        self.stop = threading.Event()
        self.rate = 0.0
        self.thread = threading.Thread(target=lambda: setattr(self, "rate", self._spin(self.stop)), daemon=True)

    @staticmethod
    def _spin(stop: threading.Event) -> float:
        loops, started = 0, time.perf_counter()
        while not stop.is_set():
            loops += 1
        return loops / (time.perf_counter() - started)

    def share(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.rate / self.alone


def epoch(spec: dict) -> dict[str, Any]:
    """One shuffled epoch: samples, seconds, first batch, and the CPU-seconds of this process
    and its workers (counted once they have exited); a training step on each batch with
    ``train``, a spinning thread beside the loop from the first batch with ``spinner``."""
    import torch

    torch.set_num_threads(1)
    import systems

    systems.prepare("remote_loader" if spec["system"] == "ours" else "webdataset")
    on_gpu = spec.get("device") == "cuda"
    spinner = Spinner() if spec.get("spinner") else None
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    if spec["scenario"] == "B-gpu":
        stream = _gpu_stream(spec)
    else:
        stream = _ours(spec) if spec["system"] == "ours" else _webdataset(spec)
    train = None
    if spec.get("train"):
        import gpu

        train = gpu.Trainer(spec["device"])
    workers = getattr(stream, "num_workers", spec.get("workers") or 0)
    samples, first, first_samples, batches = 0, 0.0, 0, 0
    for batch in stream:
        if train is not None:
            train(batch[0], batch[1])
        samples += batch[0] if spec["scenario"] == "A" else len(batch[1])
        batches += 1
        if not first:
            first_samples = samples
            if on_gpu:
                torch.cuda.synchronize()
            first = time.perf_counter() - started
            if spinner is not None:
                spinner.thread.start()
        del batch
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    close = getattr(stream, "close", None)
    if close is not None:  # a decoding process ends (and is counted below) now, not at exit
        close()
    del stream  # persistent workers end here, and are counted below
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (own.ru_utime - before.ru_utime + own.ru_stime - before.ru_stime + children.ru_utime + children.ru_stime)
    steady = (samples - first_samples) / (seconds - first) if batches > 1 and seconds > first else None
    out = {"samples": samples, "batches": batches, "seconds": seconds, "first_batch_seconds": first,
           "workers": workers, "rate": samples / seconds, "steady_rate": steady, "cores": cpu / seconds}
    if spinner is not None:
        out["spinner_share"] = spinner.share()
    return out


# ---------------------------------------------------------------------------- the orchestration


def tree_memory(pid: int) -> list[tuple[bool, int, int]]:
    """``(is the process itself, PSS, USS)`` in bytes of a process and each of its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for process in processes:
        try:
            info = process.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out.append((process.pid == pid, info.pss, info.uss))
    return out


def tree_pss(pid: int) -> int:
    """The sum of PSS over a process and its descendants (shared pages counted once)."""
    return sum(pss for _, pss, _ in tree_memory(pid))


def measure(spec: dict, timeout: float) -> dict[str, Any]:
    """An epoch in a fresh process, with the peak PSS of its process tree."""
    os.sync()  # the pages a run before left dirty are not written back during this one
    process = subprocess.Popen([sys.executable, __file__, "--epoch", json.dumps(spec)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               start_new_session=True)
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
        _end_group(process)
        raise RuntimeError(f"the epoch took more than {timeout:.0f} s") from None
    finally:
        stop.set()
        sampler.join()
    if process.returncode != 0:
        raise RuntimeError(err[-3000:])
    return {**json.loads(out.strip().splitlines()[-1]), "peak_pss_mb": peak / 1e6}


def gpu_rows(cores: int, device: str, dali: bool) -> list[dict[str, Any]]:
    """The B-gpu rows (``gpu.py``), most important first: ours by ``loader()``'s defaults; the
    ceiling (nvImageCodec alone, the hardware decoder, then batches split with the hybrid
    decoder); DALI from the bucket; WebDataset with torchvision's GPU decode; the training
    step alone and fed by ours; ours beside a spinning Python thread; then the rest. On the
    CPU (``device="cpu"``: nvImageCodec's CPU backend) the rows that run there, as a check."""
    base = {"scenario": "B-gpu", "device": device}
    ours = {**base, "system": "ours", "workers": None, "threads": 0, "default": True}
    dali_bucket = {**base, "system": "dali", "source": "bucket", "threads": min(4, cores), "workers": min(4, cores)}
    out = [ours, {**base, "system": "raw", "workers": 0, "load": None},
           {**base, "system": "raw", "workers": 0, "load": 0.8}, dali_bucket,
           {**base, "system": "webdataset", "workers": min(8, cores)},
           {**base, "system": "model", "workers": 0, "train": True}, {**ours, "train": True},
           {**ours, "spinner": True}, {**ours, "default": False, "decoding": "process"},
           {**ours, "default": False, "decoding": "process", "train": True},
           {**base, "system": "raw", "workers": 0, "load": 0.65}, {**base, "system": "raw", "workers": 0, "load": 0.5},
           {**base, "system": "dali", "source": "memory", "threads": min(4, cores), "workers": 0},
           {**dali_bucket, "threads": min(8, cores), "workers": min(8, cores)},
           {**base, "system": "memory", "workers": 0, "decoder": "ours"},
           {**base, "system": "memory", "workers": 0, "decoder": "torchvision"},
           {**dali_bucket, "train": True}, {**ours, "default": False, "workers": min(8, cores)}]
    on_gpu_only = ("webdataset", "model")
    return [row for row in out if (dali or row["system"] != "dali")
            and (device == "cuda" or (row["system"] not in on_gpu_only and not row.get("train")
                                      and row.get("decoder") != "torchvision" and row.get("load") is None))]


def rows(cores: int, device: str | None, dali: bool = False) -> list[dict[str, Any]]:
    """The rows, most important first (the GPU's after the defaults and the peers). ``device``:
    where the B-gpu rows decode (``cuda``; ``cpu``: nvImageCodec's and DALI's CPU backends,
    last, a check that they run); None: no B-gpu rows. ``dali``: DALI is installed."""
    sweep = sorted({w for w in (4, 8, 16) if w <= cores} | {cores})
    out: list[dict[str, Any]] = []
    for scenario in ("A", "B-fused"):
        out.append({"system": "ours", "scenario": scenario, "workers": None, "threads": 0, "default": True})
    out += [{"system": "webdataset", "scenario": "A", "workers": min(8, cores)},
            {"system": "webdataset", "scenario": "B", "workers": min(16, cores)}]
    if device == "cuda":
        out += gpu_rows(cores, device, dali)
    for scenario in ("A", "B-fused"):
        out.append({"system": "ours", "scenario": scenario, "workers": 0, "threads": cores})
        for workers in sweep:
            for threads in (0, 2) if scenario != "A" else (0,):
                out.append({"system": "ours", "scenario": scenario, "workers": workers, "threads": threads})
    out += [{"system": "ours", "scenario": "B", "workers": None, "threads": 0, "default": True},
            {"system": "webdataset", "scenario": "A", "workers": min(16, cores)},
            {"system": "webdataset", "scenario": "B", "workers": min(8, cores)}]
    if device == "cpu":
        out += gpu_rows(cores, device, dali)
    seen: set[str] = set()
    unique = []
    for row in out:  # on fewer cores some set-ups are the same
        key = json.dumps({**row, "threads": row.get("threads", 0)}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def name(row: dict[str, Any]) -> str:
    import gpu

    device = row.get("device")
    held = gpu.IN_MEMORY if device == "cuda" else gpu.GPU_BATCH
    system = row["system"]
    if system == "memory":
        text = f"{row['decoder']} B-gpu on {device}, {held} JPEGs in memory"
    elif system == "raw":
        backends = "hardware decoder" if row["load"] is None else f"hardware {row['load']:.0%} + hybrid"
        text = f"nvImageCodec alone on {device} ({backends}), {held} JPEGs in memory"
    elif system == "dali":
        source = "the bucket" if row["source"] == "bucket" else f"{held} JPEGs in memory"
        text = f"DALI on {device} from {source}, {row['threads']} threads, {row['workers']} source workers"
    elif system == "model":
        text = f"ResNet-50 training step alone on {device}, one fixed batch"
    else:
        workers = "default (loader)" if row.get("default") else f"workers={row['workers']}"
        threads = f", threads={row['threads']}" if system == "ours" and row.get("threads") else ""
        text = f"{system} {row['scenario']}{f' on {device}' if device else ''} {workers}{threads}"
        if row.get("decoding"):
            text += f", decoding={row['decoding']}"
    if row.get("train") and system != "model":
        text += ", feeding ResNet-50 training"
    if row.get("spinner"):
        text += ", beside a spinning Python thread"
    return text


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
    try:
        import nvidia.dali

        dali: str | None = nvidia.dali.__version__
    except ImportError:
        dali = None
    return {"device": device(), "cores": cores, "rank_cores": remote_loader.rank_cores(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "gpu_rows": gpu_rows, "remote_loader": remote_loader.__version__,
            "dali": dali, "commit": commit or os.environ.get("NODE_BENCH_COMMIT") or None}


def prepare(images: int, cores: int, folder: Path, server: Any) -> dict[str, Any]:
    """The JPEGs, written by remote_loader's uploader and by WebDataset's writer."""
    import data
    import systems

    from remote_loader import upload_cv_dataset

    started = time.perf_counter()
    items = data.build_parallel(folder, images, cores)
    made = time.perf_counter() - started
    target = systems.Target(server.endpoint_url, BUCKET, server.access_key, server.secret_key)

    summary = upload_cv_dataset(data.Files(items), client=server.client(), bucket=BUCKET, base_folder="ours",
                                maxsize=64e6, workers=min(cores, 8), progress=False)
    systems.write("webdataset", [(str(p), label) for p, label in items], target, "wds")
    import gpu

    gpu.dali_index(target, "wds", folder)  # what DALI's rows read the shards by
    return {"images": images, "sample_kb": summary.bytes / summary.samples / 1e3, "generate_seconds": made,
            "prepare_seconds": time.perf_counter() - started}


def gil(images: int, budget: float) -> dict[str, Any] | None:
    """``gil_cost.py`` on this node (A and B-fused from memory), its JSON."""
    result = _script(["gil_cost.py", "--images", str(images), "--repeats", "1", "--scenarios", "A", "B-fused",
                      "--cores", str(os.cpu_count())], budget)
    return result.get("this", result)


def beside_python(images: int, device: str, budget: float) -> dict[str, Any]:
    """``beside_python.py`` on this node: the GPU stage's ``loader()`` alone and beside a
    spinning Python thread, and the GIL-held microseconds an image in the process that
    iterates, with DALI in that process (the default) and with the decoding process; its JSON."""
    return _script(["beside_python.py", "--images", str(images), "--size", "400", "300", "--crop", "224",
                    "--workers", "4", "--device", device, "--repeats", "1", "--decoding", "dali", "process"],
                   budget)


def _script(arguments: list[str], budget: float) -> dict[str, Any]:
    """A script of ``benchmarks/`` that writes ``--json``: what it wrote, or why it failed
    (the end of its standard error, where it exited with an error)."""
    out = Path(tempfile.mkdtemp(prefix="node-script-")) / "result.json"
    command = [sys.executable, str(BENCHMARKS / arguments[0]), *arguments[1:], "--json", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # its children end with it, below
    try:
        _, err = process.communicate(timeout=budget)
        if process.returncode:
            return {"error": f"{arguments[0]} exited with {process.returncode}: {err[-1500:]}"}
        return json.loads(out.read_text())
    except subprocess.TimeoutExpired:
        return {"error": f"{arguments[0]} took more than {budget:.0f} s"}
    except (OSError, ValueError) as error:
        return {"error": str(error)[-500:]}
    finally:
        _end_group(process)
        shutil.rmtree(out.parent, ignore_errors=True)


def _end_group(process: subprocess.Popen[str]) -> None:
    """End ``process`` and every process of its group (a script's own children: an epoch
    child left behind would spin on, stealing a core from every later row)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def smoke(shared: dict[str, str], images: Path, out: Path) -> dict[str, Any]:
    """``smoke.py`` in a fresh process, before any row: its checks, or why it failed."""
    path = out / "smoke.json"
    command = [sys.executable, str(HERE / "smoke.py"), "--images", str(images), "--endpoint", shared["endpoint"],
               "--access-key", shared["access_key"], "--secret-key", shared["secret_key"], "--bucket", BUCKET,
               "--json", str(path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=SMOKE_SECONDS)
        print(stdout[-6000:], stderr[-3000:], flush=True)
    except subprocess.TimeoutExpired:
        print(f"the smoke check took more than {SMOKE_SECONDS} s", flush=True)
    finally:
        _end_group(process)
    return json.loads(path.read_text()) if path.exists() else {"error": "no result"}


def summary(results: dict[str, Any]) -> list[str]:
    """The table, the default set-up against the best of the sweep per scenario, and the GPU
    stage's targets (``gpu_targets``)."""
    lines = ["| set-up | samples/s | after the first batch | cores busy | first batch (s) | loader PSS (MB) |",
             "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error'][-80:]} | | | | |")
            continue
        kept = f" (the thread kept {row['spinner_share']:.2f})" if "spinner_share" in row else ""
        steady = "" if row["steady_rate"] is None else f"{row['steady_rate']:,.0f}"
        lines.append(f"| {row['name']} | {row['rate']:,.0f} | {steady}{kept} | {row['cores']:.1f} |"
                     f" {row['first_batch_seconds']:.2f} | {row['peak_pss_mb']:,.0f} |")
    for scenario in ("A", "B-fused", "B", "B-gpu"):
        ours = [r for r in results["rows"] if r.get("system") == "ours" and r["scenario"] == scenario and "rate" in r
                and not r.get("train") and not r.get("spinner")]
        default = [r["rate"] for r in ours if r.get("default")]
        if default and len(ours) > 1:
            best = max(ours, key=lambda r: r["rate"])
            lines.append(f"\n{scenario}: the default gives {default[0] / best['rate']:.0%} of the best row"
                         f" ({best['name']}, {best['rate']:,.0f}/s)")
    return lines + read_targets(results) + gpu_targets(results)


def read_targets(results: dict[str, Any]) -> list[str]:
    """The read path's figures on a node, each from rows of this run (whole-epoch rates): one
    process streaming bytes (target 25,000 samples/s), and the default set-up's memory against
    WebDataset's at its best row, the fastest, in each scenario (target <= 1.2x)."""
    done = [r for r in results["rows"] if "rate" in r and not r.get("train") and not r.get("spinner")]
    out = ["\nThe read path (whole epochs):"]
    one = [r for r in done if r.get("system") == "ours" and r["scenario"] == "A" and r.get("workers") == 0]
    if one:
        best = max(one, key=lambda r: r["rate"])
        out.append(f"- one process, bytes only: {best['rate']:,.0f}/s ({best['name']}); target >= 25,000")
    for ours, theirs in (("A", "A"), ("B-fused", "B")):
        default = [r for r in done if r.get("system") == "ours" and r["scenario"] == ours and r.get("default")]
        peers = [r for r in done if r.get("system") == "webdataset" and r["scenario"] == theirs]
        if default and peers:
            mine, best = default[0], max(peers, key=lambda r: r["rate"])
            out.append(f"- memory, {ours}: the default set-up's PSS {mine['peak_pss_mb']:,.0f} MB is"
                       f" {mine['peak_pss_mb'] / best['peak_pss_mb']:.2f}x WebDataset's at its best row"
                       f" ({best['name']}, {best['peak_pss_mb']:,.0f} MB); target <= 1.2")
    return out


def gpu_targets(results: dict[str, Any]) -> list[str]:
    """The GPU stage's figures against its targets, each a ratio of rows of this run (rates
    after the first batch): the ceiling, DALI, beside training and a Python thread, the first
    batch, and the GIL-held time per image of the process that iterates."""
    done = [r for r in results["rows"] if r["scenario"] == "B-gpu" and r.get("steady_rate") is not None]

    def pick(**match: Any) -> dict[str, Any] | None:
        found = [r for r in done if all(r.get(k) == v for k, v in match.items())]
        return max(found, key=lambda r: r["steady_rate"]) if found else None

    ours = pick(system="ours", default=True, train=None, spinner=None)
    out = ["\nGPU stage (rates after the first batch):"]
    ceiling = pick(system="raw")
    if ours and ceiling:
        out.append(f"- 1. ceiling: ours {ours['steady_rate']:,.0f}/s on {ours['cores']:.1f} cores busy is"
                   f" {ours['steady_rate'] / ceiling['steady_rate']:.2f}x of {ceiling['name']}"
                   f" ({ceiling['steady_rate']:,.0f}/s); target >= 0.80")
    dali = pick(system="dali", source="bucket", train=None)
    if ours and dali:
        out.append(f"- 2. DALI: ours is {ours['steady_rate'] / dali['steady_rate']:.2f}x of {dali['name']}"
                   f" ({dali['steady_rate']:,.0f}/s); target >= 1.0")
    model, fed = pick(system="model"), pick(system="ours", default=True, train=True)
    if ours and model and fed:
        slower = min(model["steady_rate"], ours["steady_rate"])
        out.append(f"- 3. training: fed by ours {fed['steady_rate']:,.0f}/s, the step alone"
                   f" {model['steady_rate']:,.0f}/s, ours alone {ours['steady_rate']:,.0f}/s:"
                   f" {fed['steady_rate'] / slower:.2f}x of the slower;"
                   f" target >= 0.90")
    fed_by_dali = pick(system="dali", train=True)
    if fed and fed_by_dali:
        out.append(f"- 3. training fed by DALI's own pipeline: {fed_by_dali['steady_rate']:,.0f}/s; ours"
                   f" {fed['steady_rate'] / fed_by_dali['steady_rate']:.2f}x of it; target >= 1.0")
    spun = pick(system="ours", default=True, spinner=True)
    if ours and spun:
        out.append(f"- 3. beside a spinning Python thread: {spun['steady_rate']:,.0f}/s,"
                   f" {spun['steady_rate'] / ours['steady_rate']:.2f}x of ours alone (the thread kept"
                   f" {spun['spinner_share']:.2f} of its loops); target >= 0.50")
    webdataset = pick(system="webdataset")
    if ours and webdataset:
        out.append(f"- 4. first batch: ours {ours['first_batch_seconds']:.2f} s, WebDataset + torchvision"
                   f" {webdataset['first_batch_seconds']:.2f} s; target <= 1.0x")
    beside = results.get("beside_python", {}).get("summary", {})
    for name, row in beside.items():
        if row.get("gil_us") is not None:
            out.append(f"- 5. {name}: GIL held {row['gil_us']:.1f} us an image in the process that iterates"
                       f" ({row['cpu_us']:.1f} us of its CPU); beside a Python thread {row['ratio']:.2f}x;"
                       f" target <= 10 us")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epoch", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    parser.add_argument("--gil-images", type=int, default=4000,
                        help="images for gil_cost.py (0: skip it; --gpu-only skips it)")
    parser.add_argument("--beside-images", type=int, default=2048,
                        help="images for beside_python.py, where there are GPU rows (0: skip it)")
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
                try:  # every object read once: no row reads cold
                    measure({**shared, **warm}, timeout=args.budget)
                except RuntimeError as error:  # that system's rows will say why; the others run
                    print(f"warming {warm['system']} failed: {str(error)[-300:]}", flush=True)
            results["smoke"] = smoke(shared, folder, args.out)
            chosen = rows(cores, results["environment"]["gpu_rows"], results["environment"]["dali"] is not None)
            if args.gpu_only:
                chosen = [row for row in chosen if row["scenario"] == "B-gpu"]
            for row in chosen:
                reserved = (60 if args.gil_images and not args.gpu_only else 0) + (
                    90 if args.beside_images and results["environment"]["gpu_rows"] else 0)
                left = args.budget - (time.monotonic() - started) - reserved
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
    gpu_rows = results["environment"]["gpu_rows"]
    if args.beside_images and gpu_rows:
        left = args.budget - (time.monotonic() - started)
        results["beside_python"] = (beside_python(args.beside_images, gpu_rows, left) if left > 30
                                    else {"skipped": "out of time"})
    if args.gil_images and not args.gpu_only:
        left = args.budget - (time.monotonic() - started)
        results["gil"] = gil(args.gil_images, max(30.0, left)) if left > 30 else {"skipped": "out of time"}
    results["seconds"] = time.monotonic() - started
    results["rates"] = {r["name"]: r["rate"] for r in results["rows"] if "rate" in r}
    path.write_text(json.dumps(results, indent=1))
    print("\n".join(summary(results)))
    print(f"\n{path} written in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
