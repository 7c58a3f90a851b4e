"""``remote-loader bench``: how fast a dataset streams here, and what limits it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch.utils.data import DataLoader

from remote_loader.checks import require_int
from remote_loader.config import MAX_WORKERS, FetchConfig
from remote_loader.errors import ConfigError
from remote_loader.format import fields
from remote_loader.format.video import VIDEO_EXTENSIONS
from remote_loader.pipeline.dataset import RemoteDataset
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.video import VideoClip
from remote_loader.storage import Store

BATCH = 64
CLIP_FRAMES = 16


@dataclass(frozen=True)
class BenchResult:
    """One streaming run."""

    decode: str
    samples: int
    seconds: float
    first_sample_seconds: float
    megabytes: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.megabytes / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": round(self.samples_per_s, 1), "mb_per_s": round(self.mb_per_s, 2)}

    def __str__(self) -> str:
        return (
            f"{self.decode:>9}: {self.samples} samples in {self.seconds:.2f} s, {self.samples_per_s:,.0f} samples/s,"
            f" {self.mb_per_s:,.1f} MB/s, first sample after {self.first_sample_seconds:.2f} s"
        )


def _pipeline(base: RemoteDataset, decode: str, size: int, min_size: int | None) -> RemoteDataset:
    if decode == "none":
        return base.map(lambda s: len(s["__key__"]))  # bytes stay in the worker: measures the loader
    if decode == "pil":  # every field decoded (masks, arrays, JSON), whatever the samples hold
        return base.decode("pil", min_size=min_size).map(len)
    require_fit(base.reader.manifest.fields, decode, str(base.reader.location))
    if decode == "clip":  # a clip of CLIP_FRAMES frames, 2 apart, cropped to size, of each video field
        return base.decode(video=VideoClip(CLIP_FRAMES, step=2, crop=RandomResizedCrop(size))).map(len)
    # Fixed-size crops travel in batches of 64, as in training: one shared-memory tensor per batch.
    crops = base.decode(RandomResizedCrop(size, reduced=decode == "rrc")).to_tuple("jpg;png;webp", "cls")
    return crops.batched(BATCH)


def require_fit(names: Sequence[str], decode: str, where: str) -> None:
    """ConfigError where ``decode`` cannot run on samples of these fields: the crops take a
    classification pair (an image and its class), ``clip`` a video field; ``none`` and ``pil``
    take any sample."""
    if decode in ("none", "pil") or not names:
        return
    if decode == "clip":
        if not any(fields.parse(name).ext in VIDEO_EXTENSIONS for name in names):
            raise ConfigError(f"bench --decode clip decodes video fields; {where} has none (fields"
                              f" {', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
        return
    try:
        kind = fields.kind(list(names))
    except ValueError:
        kind = "mixed"
    if kind != "pair":
        raise ConfigError(f"bench --decode {decode} crops an image beside its class; {where} holds {kind} samples"
                          f" (fields {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}):"
                          " bench it with --decode pil or none")


def run(
    client: Store,
    bucket: str,
    prefix: str,
    *,
    decode: str = "none",
    samples: int | None = None,
    workers: int = 2,
    size: int = 224,
    min_size: int | None = None,
    fetch: FetchConfig | None = None,
    verify: bool = True,
    progress: Callable[[int], object] | None = None,
) -> BenchResult:
    """Stream ``samples`` samples (default: one epoch) through a DataLoader and time it.

    ``progress(n)`` is called with 0 when the timed span starts (a progress bar restarts its
    clock there, so its rate is this result's), then with the number of samples each item
    brought.
    """
    workers = require_int("workers", workers, 0, MAX_WORKERS)  # RemoteDataset's bound: checked before they start
    base = RemoteDataset(client, bucket, prefix, fetch=fetch, rank=0, world_size=1, verify=verify)
    manifest = base.reader.manifest
    total = manifest.num_samples if samples is None else min(samples, manifest.num_samples)
    loader = DataLoader(_pipeline(base, decode, size, min_size), batch_size=None, num_workers=workers)
    started = time.perf_counter()
    if progress is not None:
        progress(0)
    first = 0.0
    count = 0
    for item in loader:
        brought = min(
            len(item[1]) if decode.startswith("rrc") else 1, total - count
        )  # the last batch counts up to total
        count += brought
        if progress is not None:
            progress(brought)
        if not first:
            first = time.perf_counter() - started
        if count >= total:
            break
    seconds = time.perf_counter() - started
    return BenchResult(decode, count, seconds, first, count * manifest.num_bytes / manifest.num_samples / 1e6)


def verdict(bytes_only: BenchResult, decoded: BenchResult | None) -> str:
    """Say whether storage or decoding limits the rate."""
    if decoded is None:
        return "bytes only: this is the rate storage and the loader can deliver; add --decode to compare"
    ratio = decoded.samples_per_s / bytes_only.samples_per_s if bytes_only.samples_per_s else 0.0
    if ratio < 0.8:
        if decoded.decode == "rrc":
            helps = "more DataLoader workers (cores), or decoding on a GPU (decode(..., device='cuda'))"
        elif decoded.decode == "clip":
            helps = "more DataLoader workers (cores: each decodes its clips on one thread)"
        else:
            helps = "more DataLoader workers, or --decode rrc (a crop fused with reduced-size JPEG decoding)"
        return f"decoding limits the rate: with decoding {ratio:.0%} of the bytes-only rate; {helps} help"
    return f"storage limits the rate: decoding keeps up ({ratio:.0%} of the bytes-only rate)"
