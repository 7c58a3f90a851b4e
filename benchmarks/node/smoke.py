"""The node benchmark's smoke check: the GPU stage on this machine, each check reported
whatever the others do, in well under 90 s. ``run.py`` runs it first, in a fresh process,
against the bucket it has just written; without a GPU it checks the same path on
nvImageCodec's CPU backend.

    python benchmarks/node/smoke.py --images DIR --endpoint URL --access-key K --secret-key S
        [--bucket node] [--prefix ours] [--json FILE]

- first batch: from the start of this process (CUDA's start-up, the codec's probe) to the
  first decoded batch of 256 from the bucket, through ``loader()``;
- ``device="cuda"`` and ``"cuda:0"``: where each resolves, and where JPEGs are decoded
  (``decoded_on``: the hardware decoder expected on an H100 or H200);
- crops against the CPU path's, on 256 of the JPEGs: exact settings and the defaults
  (mean and largest difference, in levels), by nvImageCodec and by DALI;
- the same batch decoded 200 times by each, the allocator churned in between: batches that
  differ from the first (torchvision #9606's out-of-order writes of the hardware decoder);
- damaged JPEGs in a batch (cut short, garbage inside the scan, the scan's second half
  zeroed): raised, skipped, or decoded into garbage (the mean difference from the intact
  image's crop); and an EXIF-rotated JPEG against the CPU path;
- an epoch left after one batch with persistent workers, then a whole epoch: its samples;
- where the decoding process spends its time while ``loader()`` streams from the bucket
  (py-spy, by function);
- the decoding thread's CPU microseconds per image on 2,048 JPEGs from memory, and the rate
  (``benchmarks/device_cost.py``);
- how much of the GIL a decoding thread leaves to a pure-Python thread beside it, and its
  rate then (for at most ``GIL_SECONDS``).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
GIL_SECONDS = 5.0


def first_batch(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The first batch's time from this process's start, and its phases: imports, the chain
    (``decode`` resolves the device and starts the decoding process), the loader, and the
    batch itself (in the decoding process: Python and torch's start, the workers' start and
    the first shards beside CUDA's start-up and the decoder's probe, the first decode; its
    own seconds from its start to its imports done and its decoder open)."""
    phases = {"start": time.perf_counter() - STARTED}
    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    phases["imports"] = time.perf_counter() - STARTED
    client = make_client(args.endpoint, args.access_key, args.secret_key)
    ds = (RemoteDataset(client, args.bucket, args.prefix, seed=0).shuffle(1000)
          .decode(RandomResizedCrop(224), device=device, batched=True).to_tuple("jpg", "cls").batched(256))
    phases["chain"] = time.perf_counter() - STARTED
    batches = loader(ds)
    phases["loader"] = time.perf_counter() - STARTED
    images, _ = next(iter(batches))
    _sync(device)
    phases["first_batch"] = time.perf_counter() - STARTED
    process = getattr(batches, "_process", None)  # the decoding process's own phases, where there is one
    return {"seconds_from_process_start": phases, "shape": list(images.shape),
            "decoded_on": batches.decoded_on, "workers": batches.num_workers,
            "decoding_process": getattr(process, "startup", None)}


def codec_startup(device: str) -> dict[str, Any]:
    """How long making a decoder of each set of backends and its first decode take (after
    the first batch: CUDA is up)."""
    import torch

    from remote_loader.pipeline.device import codec

    if device != "cuda":
        return {}
    module, kinds = codec.nvimgcodec(), codec.nvimgcodec().BackendKind
    out = {}
    for name, backends in (("hw", [kinds.HW_GPU_ONLY]), ("hw+hybrid", [kinds.HW_GPU_ONLY, kinds.HYBRID_CPU_GPU]),
                           ("gpu", [kinds.GPU_ONLY]), ("hybrid", [kinds.HYBRID_CPU_GPU])):
        started = time.perf_counter()
        decodes = codec._decodes(module, torch.cuda.current_device(), [module.Backend(k) for k in backends])
        out[name] = {"seconds": time.perf_counter() - started, "decodes": decodes}
    return out


def gil_share(datas: list[bytes], device: str) -> dict[str, Any]:
    """The share of the GIL the decoding thread leaves to a pure-Python thread beside it:
    that thread's loops a second while batches decode, over its loops a second alone."""
    import threading

    import numpy as np

    from remote_loader import RandomResizedCrop
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, prepare
    from remote_loader.pipeline.device.place import _resolved  # where it decodes, starting nothing

    crop = RandomResizedCrop(224)
    place = _resolved(device, True)
    assert place is not None
    decoder = DeviceDecoder(crop, place)
    rng = np.random.default_rng(0)
    batches = [EncodedBatch([prepare(crop, d, rng, str(i), "m") for i, d in enumerate(datas[f : f + 256])])
               for f in range(0, len(datas), 256)]
    batches = [b.pin_memory() for b in batches] if device == "cuda" else batches

    def spin(stop: threading.Event) -> float:  # alone and beside, the same loop
        loops, started = 0, time.perf_counter()
        while not stop.is_set():
            loops += 1
        return loops / (time.perf_counter() - started)

    for b in batches[:2]:
        decoder.decode(b)
    timer = threading.Event()
    threading.Timer(0.5, timer.set).start()
    alone = spin(timer)
    stop, rates = threading.Event(), []
    spinner = threading.Thread(target=lambda: rates.append(spin(stop)))
    spinner.start()
    started, images = time.perf_counter(), 0
    for b in batches:  # at most about GIL_SECONDS: beside a thread that never lets go, each retake waits
        decoder.decode(b)
        images += len(b)
        if time.perf_counter() - started > GIL_SECONDS:
            break
    _sync(device)
    seconds = time.perf_counter() - started
    stop.set()
    spinner.join()
    return {"spinner_share": rates[0] / alone, "rate_with_spinner": images / seconds, "images": images}


def devices(device: str) -> dict[str, Any]:
    from remote_loader import RandomResizedCrop
    from remote_loader.pipeline.device import DeviceDecoder
    from remote_loader.pipeline.device.place import _resolved  # where it decodes, starting nothing

    out = {}
    for name in ((device, f"{device}:0") if device == "cuda" else (device,)):
        place = _resolved(name, True)
        assert place is not None
        out[name] = {"resolved": str(place.device), "decoded_on": DeviceDecoder(RandomResizedCrop(8), place).decoded_on}
    return out


def _crops(datas: list[bytes], crop: Any, device: str, skip: bool = False,
           cpu_too: bool = True, dali: bool = False) -> tuple[Any, Any, list[int]]:
    """The CPU path's crops (None without ``cpu_too``) and the device path's (nvImageCodec's,
    or DALI's), each JPEG's box drawn from its own seed."""
    import numpy as np
    import torch

    from remote_loader.errors import OnError
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, prepare
    from remote_loader.pipeline.device.dali import DaliDecoder
    from remote_loader.pipeline.device.place import _resolved  # where it decodes, starting nothing

    cpu = torch.stack([crop.decode(d, np.random.default_rng(i)) for i, d in enumerate(datas)]) if cpu_too else None
    place = _resolved(device, True)
    assert place is not None
    batch = EncodedBatch([prepare(crop, d, np.random.default_rng(i), str(i), "smoke") for i, d in enumerate(datas)])
    decoder = (DaliDecoder if dali else DeviceDecoder)(crop, place, on_error=OnError.SKIP if skip else OnError.RAISE)
    images, kept = decoder.decode(batch)
    return cpu, images.cpu(), kept


def crops(datas: list[bytes], device: str) -> dict[str, Any]:
    from remote_loader import RandomResizedCrop

    out = {}
    exact, default = RandomResizedCrop(224, reduced=False, fast=False), RandomResizedCrop(224)
    for name, crop in (("exact", exact), ("default", default)):
        cpu, ours, _ = _crops(datas, crop, device)
        diff = (cpu.int() - ours.int()).abs().float()
        out[name] = {"mean": float(diff.mean()), "max": float(diff.max()),
                     "worst_image_mean": float(diff.mean(dim=(1, 2, 3)).max())}
    return out


def dali_crops(datas: list[bytes], device: str) -> dict[str, Any]:
    """DALI's crops (``decoding="dali"``) against the CPU path's, as ``crops`` does, with the
    outermost ring of pixels apart (DALI's resize repeats a crop's edge pixels)."""
    from remote_loader import RandomResizedCrop

    out = {}
    exact, default = RandomResizedCrop(224, reduced=False, fast=False), RandomResizedCrop(224)
    for name, crop in (("exact", exact), ("default", default)):
        cpu, ours, _ = _crops(datas, crop, device, dali=True)
        diff = (cpu.int() - ours.int()).abs().float()
        out[name] = {"mean": float(diff.mean()), "max": float(diff.max()),
                     "inner_max": float(diff[..., 1:-1, 1:-1].max())}
    return out


REPEATS = 200


def repeatable(datas: list[bytes], device: str) -> dict[str, Any]:
    """The same batch decoded ``REPEATS`` times by each decoder, torch's allocator given back
    and taken again in between (torchvision #9606: nvJPEG's hardware decoder wrote into memory
    the allocator had just reused, out of stream order, and 134 of 200 batches came wrong on an
    H100): how many batches differ from the first."""
    import numpy as np
    import torch

    from remote_loader import RandomResizedCrop
    from remote_loader.pipeline.device import DeviceDecoder, EncodedBatch, prepare
    from remote_loader.pipeline.device.dali import DaliDecoder
    from remote_loader.pipeline.device.place import _resolved

    crop, place = RandomResizedCrop(224), _resolved(device, True)
    assert place is not None
    batch = EncodedBatch([prepare(crop, d, np.random.default_rng(i), str(i), "smoke") for i, d in enumerate(datas)])
    out = {}
    for name, kind in (("nvimagecodec", DeviceDecoder), ("dali", DaliDecoder)):
        decoder = kind(crop, place)
        first, _ = decoder.decode(batch)
        differ = 0
        for k in range(REPEATS if device == "cuda" else 3):
            churn = torch.empty(int(first.numel()) * (1 + k % 3), dtype=torch.uint8, device=place.device)
            images, _ = decoder.decode(batch)
            del churn
            differ += not torch.equal(images, first)
        out[name] = {"batches": REPEATS if device == "cuda" else 3, "differing": differ}
    return out


def damaged(datas: list[bytes], device: str) -> dict[str, Any]:
    import numpy as np

    from remote_loader import DecodeError, RandomResizedCrop

    good = datas[0]
    scan = good.find(b"\xff\xda")
    rng = np.random.default_rng(0)
    garbage = bytearray(good)
    noise = rng.integers(0, 255, size=(len(good) - scan) // 3, dtype=np.uint8).tobytes()  # no 0xff: markers kept
    garbage[scan + 200 : scan + 200 + len(noise)] = noise
    zeroed = bytearray(good)
    zeroed[(scan + len(good)) // 2 : len(good) - 2] = bytes(len(good) - 2 - (scan + len(good)) // 2)
    cases = {"cut short": good[: len(good) // 2], "garbage in the scan": bytes(garbage),
             "second half zeroed": bytes(zeroed)}
    crop = RandomResizedCrop(224, reduced=False, fast=False)
    intact, _, _ = _crops([good], crop, device)
    out: dict[str, Any] = {}
    for name, data in cases.items():
        row: dict[str, Any] = {}
        try:
            _, images, kept = _crops([datas[1], data, datas[2]], crop, device, cpu_too=False)
            row["raised"] = None
            row["mean_difference_from_intact"] = float((images[1].int() - intact[0].int()).abs().float().mean())
        except DecodeError as error:
            row["raised"] = str(error).splitlines()[0]
            _, images, kept = _crops([datas[1], data, datas[2]], crop, device, skip=True, cpu_too=False)
            row["kept_with_skip"] = kept
        out[name] = row
    return out


def exif(datas: list[bytes], device: str) -> dict[str, Any]:
    from PIL import Image

    from remote_loader import RandomResizedCrop

    image = Image.open(io.BytesIO(datas[3])).convert("RGB")
    tags = Image.Exif()
    tags[0x0112] = 6  # rotate 90 degrees clockwise to view
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, exif=tags.tobytes())
    width, height = image.size
    out = {}
    for name, crop in (("random box", RandomResizedCrop(224, reduced=False, fast=False)),
                       ("whole image", RandomResizedCrop(224, (1.0, 1.0), (width / height, width / height),
                                                         reduced=False, fast=False))):
        cpu, ours, _ = _crops([buffer.getvalue()], crop, device)
        out[name] = {"mean": float((cpu.int() - ours.int()).abs().float().mean())}
    return out


def early_break(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import threading

    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    client = make_client(args.endpoint, args.access_key, args.secret_key)
    ds = (RemoteDataset(client, args.bucket, args.prefix, seed=0).shuffle(1000)
          .decode(RandomResizedCrop(64), device=device, batched=True).to_tuple("jpg", "cls").batched(256))
    batches = loader(ds, num_workers=2, persistent_workers=True)
    for _ in batches:
        break
    samples = sum(len(labels) for _, labels in batches)
    _sync(device)
    stages = [t.name for t in threading.enumerate() if t.name.startswith("remote-loader-stage")]
    total = len(RemoteDataset(client, args.bucket, args.prefix))
    return {"second_epoch_samples": samples, "dataset_samples": total, "stage_threads_left": stages}


PROFILE_SECONDS = 5


def decoding_profile(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Where the decoding process spends its time while ``loader()`` streams from the bucket:
    py-spy's samples of it (its busy threads, for ``PROFILE_SECONDS``), by the function on
    top and by the first of remote_loader's functions under it, the most first."""
    import collections
    import shutil
    import subprocess
    import tempfile

    from remote_loader import RandomResizedCrop, RemoteDataset, loader, make_client

    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        return {"skipped": "no py-spy"}
    client = make_client(args.endpoint, args.access_key, args.secret_key)
    ds = (RemoteDataset(client, args.bucket, args.prefix, seed=0).shuffle(1000)
          .decode(RandomResizedCrop(224), device=device, batched=True).to_tuple("jpg", "cls").batched(256))
    batches = loader(ds)
    epoch = iter(batches)
    next(epoch)
    out = Path(tempfile.mkdtemp(prefix="decoding-profile-")) / "raw.txt"
    spy = subprocess.Popen([py_spy, "record", "--pid", str(batches.pid), "--duration", str(PROFILE_SECONDS),
                            "--rate", "250", "--nonblocking", "--format", "raw", "--output", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    images = 0
    while spy.poll() is None:
        try:
            images += len(next(epoch)[1])
        except StopIteration:
            epoch = iter(batches)
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines() if out.exists() else []:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        leaves[frames[-1]] += int(count)
        mine = [f for f in frames if "remote_loader/" in f]
        ours[mine[-1] if mine else "(not remote_loader)"] += int(count)
    shutil.rmtree(out.parent, ignore_errors=True)
    batches.close()
    total = sum(leaves.values()) or 1
    return {"images": images, "samples": total,
            "top": [(f, round(n / total, 3)) for f, n in leaves.most_common(15)],
            "ours": [(f, round(n / total, 3)) for f, n in ours.most_common(10)]}


def from_memory(datas: list[bytes], device: str) -> dict[str, Any]:
    """``device_cost.py``'s figures: the decoding thread's CPU per image, and the rate."""
    import device_cost

    return device_cost.measure(datas, 256, device)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, required=True, help="a folder of the suite's JPEGs")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--access-key", required=True)
    parser.add_argument("--secret-key", required=True)
    parser.add_argument("--bucket", default="node")
    parser.add_argument("--prefix", default="ours")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    datas = [p.read_bytes() for p in sorted(args.images.glob("*.jpg"))[:2048]]
    checks: list[tuple[str, Callable[[], Any]]] = [
        ("first_batch", lambda: first_batch(args, device)), ("codec_startup", lambda: codec_startup(device)),
        ("devices", lambda: devices(device)),
        ("crops", lambda: crops(datas[:256], device)), ("dali_crops", lambda: dali_crops(datas[:256], device)),
        ("repeatable", lambda: repeatable(datas[:256], device)), ("damaged", lambda: damaged(datas, device)),
        ("exif", lambda: exif(datas, device)), ("early_break", lambda: early_break(args, device)),
        ("decoding_profile", lambda: decoding_profile(args, device)),
        ("from_memory", lambda: from_memory(datas if device == "cuda" else datas[:256], device)),
        ("gil_share", lambda: gil_share(datas if device == "cuda" else datas[:256], device))]
    results: dict[str, Any] = {"device": device}
    for name, check in checks:
        started = time.perf_counter()
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - every check is reported
            results[name] = {"error": traceback.format_exc()[-1500:]}
        results[name + "_seconds"] = round(time.perf_counter() - started, 2)
        print(name, json.dumps(results[name]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
