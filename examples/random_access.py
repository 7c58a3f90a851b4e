"""Random access to any sample with RemoteMapDataset, split across ranks by DistributedSampler.

    python examples/random_access.py --url s3://datasets/imagenet-val --world-size 8 --rank 3
    torchrun --nproc_per_node=2 examples/random_access.py --url s3://datasets/imagenet-val
    python examples/random_access.py --local-server     # a tiny generated dataset, both ranks here

``ds[i]`` costs one ranged GET; DataLoader batches go through ``__getitems__``, which
fetches a batch's samples concurrently and merges neighbours of one shard into one GET.
Under torchrun the sampler takes rank and world size from torch.distributed; otherwise
from ``--rank`` and ``--world-size``. ``--local-server`` reads every rank's part in this
process and checks that the parts cover the dataset exactly once and that ``ds[i]`` is
byte-identical to the i-th sample of a sequential read.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
from typing import Any

import torch.distributed as dist
from common import add_location_args, maybe_local_server
from torch.utils.data import DataLoader, DistributedSampler

from remote_loader import DatasetReader, RemoteMapDataset, make_client, upload_cv_dataset
from remote_loader.storage import parse_location
from remote_loader.testing.synthetic import SyntheticImages


def key_and_label(sample: dict[str, Any]) -> tuple[str, int]:
    """The transform: what this example keeps of each sample (decode images here for training)."""
    return sample["__key__"], int(bytes(sample["cls"]))


def as_bytes(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample with its fields as bytes (they arrive as memoryviews into the fetched range)."""
    return {k: v if isinstance(v, str) else bytes(v) for k, v in sample.items()}


def read_part(url: str, rank: int, world_size: int, *, epoch: int, workers: int, batch_size: int) -> list[str]:
    """The keys rank ``rank`` of ``world_size`` reads in ``epoch``, through a DataLoader."""
    dataset = RemoteMapDataset(url, transform=key_and_label)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    loader = DataLoader(dataset, sampler=sampler, batch_size=batch_size, num_workers=workers)
    keys: list[str] = []
    for batch_keys, _labels in loader:
        keys.extend(batch_keys)
    dataset.close()
    return keys


def local_story(args: argparse.Namespace) -> None:
    """Upload a tiny dataset, read it as 2 ranks and check coverage and byte identity."""
    location = parse_location(args.url)
    client = make_client()
    upload_cv_dataset(SyntheticImages(args.images, num_classes=4, size=(96, 72)), client=client,
                      bucket=location.bucket, base_folder=location.base_folder, maxcount=25, workers=0, progress=False)
    sequential = list(DatasetReader(client, location.bucket, location.base_folder))
    client.close()
    world_size = 2
    parts = [read_part(args.url, rank, world_size, epoch=0, workers=args.workers, batch_size=args.batch_size)
             for rank in range(world_size)]
    counts = collections.Counter(key for part in parts for key in part)
    exactly_once = sorted(counts) == sorted(s["__key__"] for s in sequential) and set(counts.values()) == {1}
    dataset = RemoteMapDataset(args.url)
    probes = random.Random(0).sample(range(len(dataset)), 10)
    identical = all(as_bytes(dataset[i]) == as_bytes(sequential[i]) for i in probes)
    report = {"samples": len(sequential), "ranks": world_size, "per_rank": [len(p) for p in parts],
              "exactly_once": exactly_once, "identical_probes": identical, "gets": dataset.metrics.gets}
    dataset.close()
    print(json.dumps(report))
    if not (exactly_once and identical):
        raise SystemExit("random access check failed")
    print(f"{world_size} ranks read {len(sequential)} samples exactly once; ds[i] matched a sequential read at"
          f" {len(probes)} random indices")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_location_args(parser, "random-access")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--images", type=int, default=100, help="images to generate with --local-server")
    args = parser.parse_args()
    if args.local_server:
        with maybe_local_server(args):
            local_story(args)
        return
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    keys = read_part(args.url, args.rank, args.world_size, epoch=args.epoch, workers=args.workers,
                     batch_size=args.batch_size)
    print(f"rank {args.rank} of {args.world_size} read {len(keys)} samples; first keys {keys[:3]}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
