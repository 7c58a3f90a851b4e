"""A device pipeline's loader beside a pure-Python thread of the same process, against the
loader alone; and what the loader costs the process that iterates it, per image.

A training step has Python between its kernels (logging, metrics, a loss written in
Python, a tokenizer), and a thread that holds the GIL gives it up only every switch
interval (5 ms): a loader that needs the GIL thousands of times a batch in the training
process runs at a fraction of its rate beside it. Here that Python is a thread spinning a
pure-Python loop, the worst case.

    python benchmarks/beside_python.py [--images 2048] [--size 48 32] [--crop 16] [--batch 256]
        [--workers 1] [--device cpu] [--decoding dali process thread] [--repeats 3]
        [--against CHECKOUT] [--json FILE]

The set-up is the GPU stage's on the decoders' CPU backends (``device="cpu", batched=True``:
DALI's CPU operators, nvImageCodec's CPU backend; the same code path as on a GPU), so it
runs anywhere: ``loader(ds)`` over
``--images`` generated JPEGs of ``--size`` in the embedded SeaweedFS, decoded with
``RandomResizedCrop(--crop)``, batches of ``--batch``, ``--workers`` DataLoader workers. On
a GPU node, ``--device cuda`` measures the same on the GPU.

Each row runs in a fresh process: one epoch to start the workers and the decoder, then
epochs for at least ``MEASURE_SECONDS`` each: alone; beside the spinning thread (images/s,
and the loops/s the thread kept, against its loops/s alone); and alone again under py-spy
(``--gil``), which gives the GIL-held microseconds per image of the iterating process, all
its threads (py-spy's samples of a held GIL, scaled by a pure-Python calibration, as
``gil_cost.py`` does), with its CPU microseconds per image (``getrusage``: this process, not
its decoding process or workers). ``--decoding`` picks ``loader(..., decoding=...)``;
``--against`` runs the same rows with the remote_loader of another checkout (as it was, with
its default decoding), alternating with this one's. Needs ``py-spy`` for the GIL column.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
BUCKET, PREFIX = "beside", "small"
MEASURE_SECONDS = 3.0


def _spin(stop: threading.Event, out: list[float]) -> None:
    loops, started = 0, time.perf_counter()
    while not stop.is_set():
        loops += 1
    out.append(loops / (time.perf_counter() - started))


def _spin_alone(seconds: float) -> float:
    stop, out = threading.Event(), []
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    _spin(stop, out)
    return out[0]


def _epochs(batches: Any, seconds: float) -> tuple[int, float, float]:
    """Whole epochs for at least ``seconds``: images, wall seconds, this process's CPU seconds."""
    images, started = 0, time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    while not images or time.perf_counter() - started < seconds:
        images += sum(len(labels) for _, labels in batches)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime
    return images, time.perf_counter() - started, cpu


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    torch.set_num_threads(1)
    client = make_client(spec["endpoint"], *spec["keys"])
    ds = (RemoteDataset(client, BUCKET, PREFIX, seed=0)
          .decode(RandomResizedCrop(spec["crop"]), device=spec["device"], batched=True)
          .to_tuple("jpg", "cls").batched(spec["batch"]))
    options = {"decoding": spec["decoding"]} if spec["decoding"] else {}
    batches = loader(ds, num_workers=spec["workers"], **options)
    warm = sum(len(labels) for _, labels in batches)
    spin_alone = _spin_alone(0.5)
    images, wall, cpu = _epochs(batches, MEASURE_SECONDS)
    alone = {"rate": images / wall, "cpu_us": cpu / images * 1e6}
    stop, spun = threading.Event(), []
    spinner = threading.Thread(target=_spin, args=(stop, spun))
    spinner.start()
    images, wall, _ = _epochs(batches, MEASURE_SECONDS)
    stop.set()
    spinner.join()
    beside = {"rate": images / wall, "spinner_share": spun[0] / spin_alone}
    gil: dict[str, float] = {}
    if spec["py_spy"]:
        from gil_cost import Spy

        spy = Spy(spec["py_spy"], spec["rate"])
        images, _, _ = _epochs(batches, MEASURE_SECONDS)
        gil = spy.stop(images)
    return {"warm_images": warm, "alone": alone, "beside": beside, "ratio": beside["rate"] / alone["rate"],
            "gil_us": sum(gil.values()) if gil else None, "gil_parts": gil,
            "decoded_on": getattr(batches, "decoded_on", None), "decoding": spec["decoding"] or "default"}


def upload(server: Any, images: int, size: tuple[int, int], batch: int) -> None:
    from remote_loader import upload_cv_dataset
    from remote_loader.testing.synthetic import SyntheticImages

    upload_cv_dataset(SyntheticImages(images, size=size), client=server.client(), bucket=BUCKET, base_folder=PREFIX,
                      maxcount=batch, workers=0, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--size", type=int, nargs=2, default=(48, 32), metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--crop", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decoding", nargs="+", default=["dali", "process", "thread"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--against", help="another checkout, measured alternating with this one")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    from remote_loader.testing.server import EmbeddedS3

    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    rows = [(f"this, decoding={mode}", str(HERE.parent), mode) for mode in args.decoding]
    if args.against:
        rows.append((f"against {Path(args.against).name}", args.against, None))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in rows}
    with EmbeddedS3(buckets=[BUCKET]) as server:
        upload(server, args.images, tuple(args.size), args.batch)
        base = {"endpoint": server.endpoint_url, "keys": [server.access_key, server.secret_key],
                "crop": args.crop, "batch": args.batch, "workers": args.workers, "device": args.device,
                "py_spy": py_spy, "rate": args.rate}
        for repeat in range(args.repeats):
            for name, path, mode in rows:
                env = {**os.environ, "PYTHONPATH": path}
                spec = json.dumps({**base, "decoding": mode})
                done = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True,
                                      text=True, timeout=600)
                if done.returncode:
                    sys.exit(f"{name}: {done.stderr[-3000:]}")
                run = json.loads(done.stdout.strip().splitlines()[-1])
                runs[name].append(run)
                print(f"[{repeat + 1}/{args.repeats}] {name:28s} alone {run['alone']['rate']:8,.0f}/s"
                      f"  beside {run['beside']['rate']:8,.0f}/s ({run['ratio']:.2f}x)"
                      f"  spinner kept {run['beside']['spinner_share']:.2f}"
                      f"  process CPU {run['alone']['cpu_us']:6.1f} us/image"
                      f"  GIL {run['gil_us'] if run['gil_us'] is None else round(run['gil_us'], 1)} us/image",
                      flush=True)
    summary = {name: _medians(rows) for name, rows in runs.items()}
    print(f"\nmedians of {args.repeats}, {args.images} JPEGs of {args.size[0]}x{args.size[1]},"
          f" RandomResizedCrop({args.crop}) on {args.device}, batches of {args.batch}, {args.workers} worker(s)")
    print("| loader | alone (images/s) | beside a Python thread | ratio | the thread kept | process CPU us/image"
          " | GIL-held us/image |")
    print("|---|---|---|---|---|---|---|")
    for name, row in summary.items():
        gil = "" if row["gil_us"] is None else f"{row['gil_us']:.1f}"
        print(f"| {name} | {row['alone']:,.0f} | {row['beside']:,.0f} | {row['ratio']:.2f}x |"
              f" {row['spinner_share']:.2f} | {row['cpu_us']:.1f} | {gil} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "summary": summary,
                                         "runs": runs}, indent=1, default=str))


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    gils = [r["gil_us"] for r in rows if r["gil_us"] is not None]
    return {"alone": statistics.median(r["alone"]["rate"] for r in rows),
            "beside": statistics.median(r["beside"]["rate"] for r in rows),
            "ratio": statistics.median(r["ratio"] for r in rows),
            "spinner_share": statistics.median(r["beside"]["spinner_share"] for r in rows),
            "cpu_us": statistics.median(r["alone"]["cpu_us"] for r in rows),
            "gil_us": statistics.median(gils) if gils else None, "decoded_on": rows[0]["decoded_on"]}


if __name__ == "__main__":
    main()
