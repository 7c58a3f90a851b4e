"""This machine's limits: how fast the server hands out bytes, how fast Pillow decodes + augments."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context

import torch
from augment import plain_augment
from systems import Target

from remote_loader import RandomResizedCrop

PART = 8 * 1024 * 1024
THREADS = 8
REPEATS = 3


def _objects(target: Target, prefix: str) -> list[tuple[str, int]]:
    listing = target.boto3().list_objects_v2(Bucket=target.bucket, Prefix=f"{prefix}/")
    return [(o["Key"], o["Size"]) for o in listing.get("Contents", []) if o["Key"].endswith(".tar")]


def get_throughput(target: Target, prefix: str, sample_bytes: float) -> dict[str, float]:
    """MB/s of one GET streaming a whole shard, and of 8 threads of 8 MB ranged GETs over all shards."""
    client = target.boto3()
    objects = _objects(target, prefix)
    key, size = max(objects, key=lambda o: o[1])
    single = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        body = client.get_object(Bucket=target.bucket, Key=key)["Body"]
        while body.read(1 << 20):
            pass
        single.append(size / (time.perf_counter() - started) / 1e6)
    ranges = [(k, start, min(s, start + PART) - 1) for k, s in objects for start in range(0, s, PART)]
    total = sum(end - start + 1 for _, start, end in ranges)

    def fetch(job: tuple[str, int, int]) -> int:
        k, start, end = job
        return len(client.get_object(Bucket=target.bucket, Key=k, Range=f"bytes={start}-{end}")["Body"].read())

    parallel = []
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(REPEATS):
            started = time.perf_counter()
            assert sum(pool.map(fetch, ranges)) == total
            parallel.append(total / (time.perf_counter() - started) / 1e6)
    single_mb, parallel_mb = statistics.median(single), statistics.median(parallel)
    return {"single_stream_mb_s": single_mb, "parallel_ranged_mb_s": parallel_mb,
            "single_stream_samples_s": single_mb * 1e6 / sample_bytes,
            "parallel_ranged_samples_s": parallel_mb * 1e6 / sample_bytes}


_fused = RandomResizedCrop(224)


def _plain_file(path: str) -> int:
    with open(path, "rb") as handle:
        return plain_augment(handle.read()).numel()


def _fused_file(path: str) -> int:
    with open(path, "rb") as handle:
        return _fused.decode(handle.read()).numel()


def decode_throughput(paths: list[str]) -> dict[str, float]:
    """Images/s of decode + random-resized-crop 224 + flip from local files, 1 and 2 processes."""
    out: dict[str, float] = {}
    context = get_context("fork")
    for processes in (1, 2):
        for name, func in (("plain", _plain_file), ("fused", _fused_file)):
            rates = []
            with context.Pool(processes, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                pool.map(func, paths[:processes * 8])  # warm the workers
                for _ in range(REPEATS):
                    started = time.perf_counter()
                    pool.map(func, paths, chunksize=16)
                    rates.append(len(paths) / (time.perf_counter() - started))
            out[f"{name}_{processes}proc_images_s"] = statistics.median(rates)
    return out
