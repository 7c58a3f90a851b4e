"""Each system's writer and reader, driven the same way.

``write(name, items, target, prefix)`` converts ``(path, label)`` pairs with the system's
own writer and puts the result at ``s3://<bucket>/<prefix>``. ``loader(name, target,
prefix, scenario, workers)`` returns an iterable of batches for one shuffled epoch:

- scenario ``A`` (bytes only): batches of 64 counted in the worker, ``(samples, bytes)``;
- scenario ``B`` (plain): ``plain_augment`` on every sample, batches of 64 uint8 tensors;
- scenario ``B-fused`` (remote_loader only): its fused decode + random-resized-crop.

A system may have more than one documented setting worth trying (``SETTINGS``); each is
measured at each worker count and the system is compared at its best one.

``target`` holds the endpoint and credentials (``Target``). Peers are imported lazily:
each measurement runs in its own process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from augment import BATCH, augment_batch, count_batch, plain_augment, read_batch, stack_batch

SYSTEMS = ("remote_loader", "webdataset", "streaming", "litdata")
SHARD_BYTES = int(os.environ.get("BENCH_SHARD_BYTES", 64_000_000))
SHUFFLE_BUFFER = 1000
STAGE_THREADS = os.cpu_count() or 2
"""remote_loader's stage threads when it runs without DataLoader workers (its documented set-up)."""
SETTINGS: dict[str, tuple[str, ...]] = {"litdata": ("1", "all")}
"""Settings tried besides worker counts. LitData's ``batch_decode`` (how many rows it
deserializes at once once a chunk is local): its docs give 1 for images ("each row is
decoded once"), which its ``auto`` does not pick for rows stored as ``bytes``; ``"all"``
(the whole chunk) avoids its re-reading a chunk file shared between two workers once per
window. Measured: auto 2,920 and 488 samples/s at 0 and 2 workers; 1: 8,028 and 248;
all: 5,744 and 5,190 (docs/performance.md)."""


def settings(name: str) -> tuple[str | None, ...]:
    return SETTINGS.get(name, (None,))


def label(workers: int, setting: str | None) -> str:
    """How a measured set-up is named in the results: the worker count, and the setting if any."""
    return str(workers) if setting is None else f"{workers}, batch_decode={setting}"


def configuration(name: str, workers: int, setting: str | None = None) -> str:
    """How each system is set up, as its own documentation shows: recorded with the results."""
    return {
        "remote_loader": (
            f"RemoteDataset(shuffle {SHUFFLE_BUFFER}), one boto3 client per process, defaults;"
            + (
                f" stages on {STAGE_THREADS} threads, no DataLoader workers"
                if workers == 0
                else f" DataLoader(num_workers={workers}), stages unthreaded"
            )
        ),
        "webdataset": (
            f"WebDataset(shardshuffle, split_by_worker).shuffle({SHUFFLE_BUFFER}); an s3:// opener in"
            f" gopen_schemes keeping one boto3 client per process (streaming GET); DataLoader(num_workers={workers})"
        ),
        "streaming": (
            f"StreamingDataset(remote, local cache, shuffle=True, batch_size=64), defaults (predownload,"
            f" cache limit unset); DataLoader(num_workers={workers})"
            + ("; each worker makes its own S3 client (see _load_streaming)" if workers else "")
        ),
        "litdata": (
            f"litdata.StreamingDataset(shuffle=True, batch_decode={setting!r}), obstore with allow_http;"
            f" StreamingDataLoader(num_workers={workers})"
        ),
    }[name]


@dataclass(frozen=True)
class Target:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str

    def environ(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "LITDATA_DISABLE_VERSION_CHECK": "1",
        }

    def boto3(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(max_pool_connections=16, s3={"addressing_style": "path"}),
        )


def _read(path: str | Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


class _Files:
    """``(path, label)`` pairs as a torchvision-style dataset of original file bytes."""

    def __init__(self, items: Sequence[tuple[str, int]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[str, int]:
        return self.items[i]


def prepare(name: str) -> None:
    """Import what the system's loader needs, so imports stay out of the timings."""
    import stubs

    stubs.install()
    modules = {
        "remote_loader": ["remote_loader"],
        "webdataset": ["webdataset", "boto3"],
        "streaming": ["streaming"],
        "litdata": ["litdata"],
    }[name]
    for module in ["torch.utils.data", *modules]:
        __import__(module)


# ---------------------------------------------------------------------------- writers


def write(name: str, items: Sequence[tuple[str, int]], target: Target, prefix: str) -> None:
    os.environ.update(target.environ())
    {
        "remote_loader": _write_remote_loader,
        "webdataset": _write_webdataset,
        "streaming": _write_streaming,
        "litdata": _write_litdata,
    }[name](items, target, prefix)


def _write_remote_loader(items: Sequence[tuple[str, int]], target: Target, prefix: str) -> None:
    from remote_loader import make_client, upload_cv_dataset

    client = make_client(target.endpoint, target.access_key, target.secret_key)
    upload_cv_dataset(
        _Files(items),
        client=client,
        bucket=target.bucket,
        base_folder=prefix,
        maxsize=SHARD_BYTES,
        workers=int(os.environ.get("BENCH_UPLOAD_WORKERS", "2")),  # benchmarks/convert.py --workers
        progress=False,
        overwrite=True,
    )
    client.close()


def _write_webdataset(items: Sequence[tuple[str, int]], target: Target, prefix: str) -> None:
    import webdataset as wds

    s3 = target.boto3()
    with tempfile.TemporaryDirectory() as tmp:
        with wds.ShardWriter(f"{tmp}/shard-%06d.tar", maxsize=SHARD_BYTES, verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{i:08d}", "jpg": _read(path), "cls": str(label).encode()})
        for shard in sorted(Path(tmp).glob("*.tar")):
            s3.upload_file(str(shard), target.bucket, f"{prefix}/{shard.name}")


def _write_streaming(items: Sequence[tuple[str, int]], target: Target, prefix: str) -> None:
    import stubs

    stubs.install()
    from streaming import MDSWriter

    with MDSWriter(
        out=f"s3://{target.bucket}/{prefix}",
        columns={"jpg": "bytes", "cls": "int"},
        size_limit=SHARD_BYTES,
        progress_bar=False,
    ) as writer:
        for path, label in items:
            writer.write({"jpg": _read(path), "cls": int(label)})


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    return {"jpg": _read(path), "cls": int(label)}


def _litdata_options(target: Target) -> dict[str, Any]:
    return {
        "endpoint_url": target.endpoint,
        "aws_access_key_id": target.access_key,
        "aws_secret_access_key": target.secret_key,
        "region_name": "us-east-1",
    }


def _litdata_allow_http() -> None:
    """litdata's obstore client refuses plain-http endpoints unless told otherwise."""
    import litdata.streaming.downloader as downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None) or {}
    downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": True}


def _write_litdata(items: Sequence[tuple[str, int]], target: Target, prefix: str) -> None:
    import stubs

    stubs.install()
    import litdata

    _litdata_allow_http()
    litdata.optimize(
        fn=_litdata_item,
        inputs=list(items),
        output_dir=f"s3://{target.bucket}/{prefix}",
        chunk_bytes=SHARD_BYTES,
        num_workers=2,
        storage_options=_litdata_options(target),
        mode="overwrite",
        verbose=False,
        reorder_files=False,
        start_method="fork",
    )


# ---------------------------------------------------------------------------- readers


def loader(name: str, target: Target, prefix: str, scenario: str, workers: int, cache: str,
           setting: str | None = None) -> Iterable[Any]:
    """System ``name``'s DataLoader (or iterable of batches) for one epoch, set up as its
    documentation shows, with ``setting`` one of ``settings(name)`` (None where it has none)."""
    if setting not in settings(name):
        raise ValueError(f"{name} has no setting {setting!r}; it has {settings(name)}")
    os.environ.update(target.environ())
    return {
        "remote_loader": _load_remote_loader,
        "webdataset": _load_webdataset,
        "streaming": _load_streaming,
        "litdata": _load_litdata,
    }[name](target, prefix, scenario, workers, cache, setting)


def _collate(scenario: str) -> Any:
    if scenario == "A-read":
        return read_batch
    return count_batch if scenario.startswith("A") else augment_batch


def _augment_pair(pair: tuple[Any, Any]) -> tuple[Any, int]:
    data, label = pair
    return plain_augment(data), int(label)


def _load_remote_loader(target: Target, prefix: str, scenario: str, workers: int, cache: str,
                        setting: None) -> Iterable[Any]:
    from torch.utils.data import DataLoader

    from remote_loader import RandomResizedCrop, RemoteDataset, make_client

    client = make_client(target.endpoint, target.access_key, target.secret_key)
    threads = STAGE_THREADS if workers == 0 else 0
    base = RemoteDataset(client, target.bucket, prefix, seed=0, rank=0, world_size=1).shuffle(SHUFFLE_BUFFER)
    if scenario == "B-fused":
        stream = base.decode(RandomResizedCrop(224), threads=threads).to_tuple("jpg", "cls").batched(BATCH, stack_batch)
    elif scenario == "B":  # the same Pillow augmentation as the peers, as a user transform on threads
        stream = base.to_tuple("jpg", "cls").map(_augment_pair, threads=threads).batched(BATCH, stack_batch)
    else:
        stream = base.to_tuple("jpg", "cls").batched(BATCH, _collate(scenario))
    return DataLoader(stream, batch_size=None, num_workers=workers)


_S3_CLIENT: tuple[int, Any] | None = None


def _s3_opener(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """WebDataset's opener for s3:// URLs: one boto3 client per process, as users write it."""
    from urllib.parse import urlsplit

    import boto3

    global _S3_CLIENT
    if _S3_CLIENT is None or _S3_CLIENT[0] != os.getpid():
        _S3_CLIENT = (
            os.getpid(),
            boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1"),
        )
    parts = urlsplit(url)
    return _S3_CLIENT[1].get_object(Bucket=parts.netloc, Key=parts.path.lstrip("/"))["Body"]


def _load_webdataset(target: Target, prefix: str, scenario: str, workers: int, cache: str,
                     setting: None) -> Iterable[Any]:
    import webdataset as wds
    from torch.utils.data import DataLoader

    wds.gopen_schemes["s3"] = _s3_opener
    listing = target.boto3().list_objects_v2(Bucket=target.bucket, Prefix=f"{prefix}/")
    urls = sorted(f"s3://{target.bucket}/{o['Key']}" for o in listing.get("Contents", []) if o["Key"].endswith(".tar"))
    dataset = (
        wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            seed=0,
            nodesplitter=wds.single_node_only,
            workersplitter=wds.split_by_worker,
            empty_check=False,
        )
        .shuffle(SHUFFLE_BUFFER)
        .to_tuple("jpg", "cls")
        .batched(BATCH, collation_fn=_collate(scenario))
    )
    return DataLoader(dataset, batch_size=None, num_workers=workers)


def _load_streaming(target: Target, prefix: str, scenario: str, workers: int, cache: str,
                    setting: None) -> Iterable[Any]:
    import stubs

    stubs.install()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    shutil.rmtree(cache, ignore_errors=True)

    class Pairs(StreamingDataset):
        def __getitem__(self, i: int) -> tuple[bytes, int]:
            sample = super().__getitem__(i)
            return sample["jpg"], sample["cls"]

    dataset = Pairs(
        remote=f"s3://{target.bucket}/{prefix}", local=cache, shuffle=True, batch_size=BATCH, shuffle_seed=0
    )
    if workers:
        # The dataset fetched index.json with a boto3 client it keeps; forked workers would share
        # its pooled connection and read each other's responses (whole shards of wrong bytes, or
        # "Relative sample index ... is not present": 3 of 5 epochs at 2 workers). Dropping it
        # before the fork makes each worker open its own, as its downloader does when it has none.
        for stream in dataset.streams:
            stream._downloader.clean_up()
    return DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=_collate(scenario))


def _load_litdata(target: Target, prefix: str, scenario: str, workers: int, cache: str,
                  batch_decode: str | None) -> Iterable[Any]:
    import stubs

    stubs.install()
    import litdata

    _litdata_allow_http()
    shutil.rmtree(cache, ignore_errors=True)

    class Pairs(litdata.StreamingDataset):
        def __getitem__(self, index: Any) -> tuple[bytes, int]:
            sample = super().__getitem__(index)
            return sample["jpg"], sample["cls"]

    dataset = Pairs(
        f"s3://{target.bucket}/{prefix}",
        cache_dir=cache,
        shuffle=True,
        seed=0,
        storage_options=_litdata_options(target),
        batch_decode=batch_decode,
    )
    return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=_collate(scenario))
