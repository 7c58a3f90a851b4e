"""Which of nvImageCodec's backends decode a GPU batch, and what each set costs the process:
the rate and the process's CPU-seconds per image (the codec's own threads counted), on the
suite's JPEGs held in memory, each set timed on the same decoder input after a warm-up.

    python benchmarks/node/backends.py [--images 2048] [--json FILE]

Run on a GPU node with the node bundle's paths (``run.sh`` sets them).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "suite"))
sys.path.insert(0, str(HERE.parent))


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def measure(decoder: Any, batches: list[Any], passes: int) -> dict[str, float]:
    import torch

    for b in batches[:2]:  # warm-up
        decoder.decode(b)
    torch.cuda.synchronize()
    started, cpu, images = time.perf_counter(), _cpu(), 0
    for _ in range(passes):
        for b in batches:
            out, _ = decoder.decode(b)
            images += len(b)
    torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - started, _cpu() - cpu
    return {"rate": images / seconds, "process_cpu_us": cpu / images * 1e6, "cores": cpu / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import numpy as np
    import simplejpeg
    import torch

    torch.set_num_threads(1)
    import device_cost
    from nvidia import nvimgcodec as m

    from remote_loader import RandomResizedCrop, rank_cores
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, prepare
    from remote_loader.pipeline.device.codec import open_codec

    datas = device_cost.jpegs(args.images)
    crop, rng = RandomResizedCrop(224), np.random.default_rng(0)
    batches = [
        EncodedBatch([prepare(crop, d, rng, str(i), "memory") for i, d in enumerate(datas[f : f + 256])]).pin_memory()
        for f in range(0, len(datas), 256)
    ]
    place = torch.device("cuda", 0)
    codec = open_codec(place)
    default = codec._decoder
    kinds = m.BackendKind
    sets: dict[str, Any] = {
        "default": None,
        "hw": [m.Backend(kinds.HW_GPU_ONLY)],
        "hw+hybrid": [m.Backend(kinds.HW_GPU_ONLY), m.Backend(kinds.HYBRID_CPU_GPU)],
        "hw fixed+hybrid": [m.Backend(kinds.HW_GPU_ONLY, 1.0, m.LoadHintPolicy.FIXED), m.Backend(kinds.HYBRID_CPU_GPU)],
        "hybrid": [m.Backend(kinds.HYBRID_CPU_GPU)],
    }
    results: dict[str, Any] = {"rank_cores": rank_cores(), "decoded_on": codec.decoded_on}
    for side in (16, 64, 256):  # a decoder used for a probe's one JPEG first, then for the batches
        probe = simplejpeg.encode_jpeg(np.full((side, side, 3), 128, np.uint8), quality=90)
        for fresh in (False, True):
            label = f"hw+hybrid after a {side} px probe{', then a fresh decoder' if fresh else ''}"
            made = m.Decoder(
                device_id=0,
                max_num_cpu_threads=rank_cores(),
                backends=[m.Backend(kinds.HW_GPU_ONLY), m.Backend(kinds.HYBRID_CPU_GPU)],
            )
            made.decode(m.CodeStream(probe))
            codec._decoder = (
                made
                if not fresh
                else m.Decoder(
                    device_id=0,
                    max_num_cpu_threads=rank_cores(),
                    backends=[m.Backend(kinds.HW_GPU_ONLY), m.Backend(kinds.HYBRID_CPU_GPU)],
                )
            )
            results[label] = measure(DeviceDecoder(crop, place, codec=codec), batches, args.passes)
            print(label, results[label], flush=True)
    for threads in (rank_cores(),):
        for name, backends in [*sets.items(), ("default again", None)]:
            label = f"{name}, {threads} codec threads"
            try:
                codec._decoder = (
                    default
                    if backends is None and threads == rank_cores()
                    else m.Decoder(
                        device_id=0,
                        max_num_cpu_threads=threads,
                        backends=backends or [m.Backend(kinds.HW_GPU_ONLY), m.Backend(kinds.HYBRID_CPU_GPU)],
                    )
                )
                results[label] = measure(DeviceDecoder(crop, place, codec=codec), batches, args.passes)
            except Exception as exc:  # noqa: BLE001 - every set is reported
                results[label] = {"error": repr(exc)[:300]}
            print(label, results[label], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
