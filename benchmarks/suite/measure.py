"""One measurement in a fresh process; prints one JSON line. Started by ``run.py``.

    measure.py write  SYSTEM PREFIX ITEMS_JSON        conversion + upload time
    measure.py epoch  SYSTEM PREFIX SCENARIO WORKERS [SETTING]  one shuffled epoch: rate, first batch

The endpoint, bucket and credentials come from ``BENCH_ENDPOINT``, ``BENCH_BUCKET``,
``BENCH_ACCESS_KEY`` and ``BENCH_SECRET_KEY``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import systems  # noqa: E402


def target() -> systems.Target:
    return systems.Target(os.environ["BENCH_ENDPOINT"], os.environ["BENCH_BUCKET"], os.environ["BENCH_ACCESS_KEY"],
                          os.environ["BENCH_SECRET_KEY"])


def write(system: str, prefix: str, items_file: str) -> dict[str, float]:
    items = [tuple(pair) for pair in json.loads(Path(items_file).read_text())]
    started = time.perf_counter()
    systems.write(system, items, target(), prefix)  # type: ignore[arg-type]
    return {"seconds": time.perf_counter() - started}


def epoch(system: str, prefix: str, scenario: str, workers: int, setting: str | None = None) -> dict[str, float]:
    systems.prepare(system)  # imports happen before the clock starts
    cache = tempfile.mkdtemp(prefix="bench-cache-")
    try:
        started = time.perf_counter()
        first = 0.0
        samples = nbytes = first_samples = 0
        for batch in systems.loader(system, target(), prefix, scenario, workers, cache, setting):
            if scenario.startswith("A"):
                count, size = batch
                samples, nbytes = samples + count, nbytes + size
            else:
                samples += len(batch[1])
            if not first:
                first = time.perf_counter() - started
                first_samples = samples
                if scenario == "A-first":
                    break
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    steady = (samples - first_samples) / (seconds - first) if seconds > first else 0.0
    return {"samples": samples, "bytes": nbytes, "seconds": seconds, "first_batch_seconds": first,
            "steady_samples_per_s": steady}


def main() -> None:
    command, system, prefix, *rest = sys.argv[1:]
    if command == "write":
        result = write(system, prefix, rest[0])
    else:
        result = epoch(system, prefix, rest[0], int(rest[1]), rest[2] if len(rest) > 2 else None)
    print(json.dumps(result), flush=True)
    os._exit(0)  # peers leave non-daemon threads behind; the result is out


if __name__ == "__main__":
    main()
