"""The memory of each process of a loader, at a node's worker counts: the node benchmark's
rows (``node/run.py``: ours in A and B-fused, WebDataset in A and B), each epoch in a fresh
process, with the PSS and USS (private memory) of the process and of each worker at the
moment their sum peaked. Memory does not depend on the cores, so a node's 16 workers can be
measured here; their rates cannot.

    python benchmarks/worker_memory.py [--images 20000] [--repeats 1] [--against CHECKOUT...]
        [--rows '[{"system": "ours", "scenario": "B-fused", "workers": 16}, ...]']

``--against`` runs each of ours again with the remote_loader of each other checkout given
(a ``git worktree`` of an earlier commit, or one with a change tried), alternating. Needs what ``node/run.py`` needs
(scikit-image, webdataset, psutil).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "node"), str(HERE), str(HERE / "suite")]

ROWS = [
    {"system": "ours", "scenario": "B-fused", "workers": 16, "threads": 0},
    {"system": "webdataset", "scenario": "B", "workers": 16},
    {"system": "ours", "scenario": "A", "workers": 4, "threads": 0},
    {"system": "ours", "scenario": "A", "workers": 16, "threads": 0},
    {"system": "webdataset", "scenario": "A", "workers": 8},
]


def measure(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One epoch of ``node/run.py``'s row ``spec`` in a fresh process, sampled every 0.1 s."""
    import run

    process = subprocess.Popen([sys.executable, run.__file__, "--epoch", json.dumps(spec)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    peak: list[Any] = [0, []]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            parts = run.tree_memory(process.pid)
            if sum(p[1] for p in parts) > peak[0]:
                peak[:] = [sum(p[1] for p in parts), parts]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        stop.set()
        sampler.join()
    if process.returncode != 0:
        raise RuntimeError(err[-2000:])
    result = json.loads(out.strip().splitlines()[-1])
    workers = sorted((p[1], p[2]) for p in peak[1] if not p[0])
    main = [p for p in peak[1] if p[0]]
    return {"rate": result["rate"], "first_batch_seconds": result["first_batch_seconds"], "peak_pss_mb": peak[0] / 1e6,
            "process_pss_uss_mb": [round(v / 1e6) for v in main[0][1:]] if main else None,
            "workers_pss_uss_mb": [[round(a / 1e6), round(b / 1e6)] for a, b in workers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--against", nargs="+", default=[],
                        help="other checkouts: each of ours runs with each of them too, alternating")
    parser.add_argument("--rows", type=json.loads, default=ROWS, help="rows as node/run.py names them (JSON)")
    args = parser.parse_args()
    import run

    from remote_loader.testing.server import EmbeddedS3

    checkouts = {"this": {}} | {path: {"PYTHONPATH": path} for path in args.against}
    folder = Path(tempfile.mkdtemp(prefix="worker-memory-images-"))
    try:
        with EmbeddedS3(buckets=[run.BUCKET]) as server:
            print(json.dumps(run.prepare(args.images, os.cpu_count() or 1, folder, server)), flush=True)
            shared = {"endpoint": server.endpoint_url, "access_key": server.access_key,
                      "secret_key": server.secret_key, "images": str(folder)}
            for warm in ({"system": "ours", "scenario": "A", "workers": 0, "threads": 0},
                         {"system": "webdataset", "scenario": "A", "workers": 0}):
                run.measure({**shared, **warm}, timeout=900)  # every object read once: no row reads cold
            for _ in range(args.repeats):
                for row in args.rows:
                    for name, env in checkouts.items() if row["system"] == "ours" else [("this", {})]:
                        result = measure({**shared, **row}, env, timeout=900)
                        print(json.dumps({**row, "checkout": name, **result}), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
