"""Distributed training from a bucket with RemoteDataset: DDP on the CPU with gloo, resumable mid-epoch.

    torchrun --nproc_per_node=2 examples/train_ddp.py --url s3://datasets/imagenet-train --epochs 90
    torchrun --nproc_per_node=4 examples/train_ddp.py --url ... --resume     # continue from --checkpoint
    python examples/train_ddp.py --local-server    # the whole story on a tiny dataset, see below

Each rank streams its own part of every epoch (``set_epoch`` gives a fresh shard order
each epoch); DataLoader workers split the rank's part further. The checkpoint holds the
model, the optimizer and every rank's loader state, so a run stopped in the middle of an
epoch resumes with exactly the samples it had not seen.

With torchdata installed (the ``torchdata`` extra: ``pip install '.[torchdata]'``) the loader is a
``StatefulDataLoader``: its ``state_dict()`` holds each worker's position, with no
counting. A resume on the same ranks and workers gives each rank's loader its own state
back; on other numbers of ranks or workers every rank's dataset gets all the states
(``RemoteDataset.load_state_dict``), which divides the rest of the epoch anew. Without
torchdata a plain DataLoader's position is computed from the batches consumed, and the
resume needs the same ranks and workers.

The model is ResNet-18 when torchvision is installed, a small CNN otherwise.

``--local-server`` starts an embedded S3 server, uploads a small generated dataset and
runs ``torchrun --nproc_per_node=2`` stopping (as if pre-empted) after ``--stop-after``
steps, then resumes from the checkpoint to the end: on 1 rank with 1 worker per rank
under StatefulDataLoader, on the same 2 ranks without torchdata. It then checks from the
logged sample keys that each epoch saw every sample exactly once across both runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from common import add_location_args, maybe_local_server
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from remote_loader import DatasetReader, RandomResizedCrop, RemoteDataset, loader, make_client, upload_cv_dataset
from remote_loader.storage import parse_location
from remote_loader.testing.synthetic import SyntheticImages

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on a newer torch
try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the plain DataLoader, with positions counted from the batches consumed
    StatefulDataLoader = None

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def _kind(batches: object) -> str:
    """Which DataLoader ``loader()`` made."""
    return "StatefulDataLoader" if StatefulDataLoader is not None and isinstance(batches, StatefulDataLoader) \
        else "DataLoader"


def build_model(num_classes: int) -> tuple[nn.Module, str]:
    """ResNet-18 if torchvision is there, else a small CNN."""
    try:
        from torchvision.models import resnet18
    except Exception:  # not installed, or a build that does not import beside this torch
        pass
    else:
        return resnet18(num_classes=num_classes), "resnet18"
    small = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )
    return small, "small-cnn"


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    loader_state: dict | None, workers: int) -> None:
    """Gather every rank's loader state; rank 0 writes one checkpoint file."""
    states: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader_state)
    if dist.get_rank() == 0:
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                    "loader": states, "world_size": dist.get_world_size(), "workers": workers}, tmp)
        tmp.replace(path)  # a crash while saving leaves the previous checkpoint whole
    dist.barrier()


def train(args: argparse.Namespace) -> None:
    """One rank's training loop (started by torchrun)."""
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dataset = RemoteDataset(args.url, seed=args.seed)  # rank and world size come from torch.distributed
    num_classes = len(dataset.reader.manifest.params.get("classes") or []) or 1000
    stream = (dataset.shuffle(args.shuffle_buffer).decode(RandomResizedCrop(args.size))
              .to_tuple("jpg;png;webp", "cls", "__key__").batched(args.batch_size))
    model, model_name = build_model(num_classes)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # One worker per core of this rank by default; persistent_workers off: the resumed run below makes its own.
    batches = loader(stream, num_workers=args.workers, stateful=StatefulDataLoader is not None,
                     persistent_workers=False)
    args.workers = batches.num_workers
    start_epoch = 0
    if args.resume and args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"]
        states = checkpoint["loader"]
        if states[rank] is not None:
            same = (checkpoint["world_size"], checkpoint["workers"]) == (world_size, args.workers)
            if StatefulDataLoader is not None and same:
                batches.load_state_dict(states[rank])  # each worker gets its own position back
            elif StatefulDataLoader is not None:
                stream.load_state_dict(states)  # every rank's states: the rest of the epoch, divided anew
            else:
                stream.load_state_dict(states[rank])  # counted: same ranks and workers only
        if rank == 0:
            print(f"resumed from {args.checkpoint} in epoch {start_epoch}, saved by {checkpoint['world_size']} ranks"
                  f" x {checkpoint['workers']} workers", flush=True)
    if rank == 0:
        print(f"{model_name}, {world_size} rank(s) x {args.workers} DataLoader worker(s) ({_kind(batches)}),"
              f" {len(dataset)} samples per rank per epoch", flush=True)
    log = (args.log_keys / f"keys-rank{rank}.jsonl").open("a") if args.log_keys else None
    steps = 0
    for epoch in range(start_epoch, args.epochs):
        stream.set_epoch(epoch)  # a pending resume position applies to its own epoch only
        consumed, total_loss, stopping = 0, 0.0, False
        with model.join():  # tolerates ranks with unequal batch counts
            for images, labels, keys in batches:
                inputs = (images.float() - MEAN) / STD
                loss = nn.functional.cross_entropy(model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                consumed, steps, total_loss = consumed + 1, steps + 1, total_loss + loss.item()
                if log:
                    log.write(json.dumps({"epoch": epoch, "keys": list(keys)}) + "\n")
                    log.flush()
                if rank == 0 and args.log_every and steps % args.log_every == 0:
                    m = stream.metrics  # summed over this rank's DataLoader workers, read from shared memory
                    print(f"step {steps}: loader {m.samples} samples, {m.bytes / 1e6:.1f} MB, {m.gets} GETs,"
                          f" {m.retries} retries, {m.wait_seconds:.2f} s waiting on storage", flush=True)
                stopping = steps == args.stop_after
                if stopping:
                    break
        if stopping:  # as if pre-empted: save where each rank is and stop
            if StatefulDataLoader is not None:
                state = batches.state_dict()
            else:
                state = stream.state_dict(consumed, num_workers=args.workers)
            save_checkpoint(args.checkpoint, model, optimizer, epoch, state, args.workers)
            if rank == 0:
                print(f"stopping in epoch {epoch} after {steps} steps; checkpoint {args.checkpoint}", flush=True)
            break
        save_checkpoint(args.checkpoint, model, optimizer, epoch + 1, None, args.workers)
        if rank == 0:
            print(f"epoch {epoch}: {consumed} batches on rank 0, mean loss {total_loss / max(1, consumed):.3f}",
                  flush=True)
    if log:
        log.close()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(args: argparse.Namespace, ranks: int, workers: int, *extra: str) -> None:
    """Run this script on local ranks (gloo over loopback)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__,
               "--url", args.url, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
               "--size", str(args.size), "--workers", str(workers), "--checkpoint", str(args.checkpoint),
               "--log-keys", str(args.log_keys), *extra]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    subprocess.run(command, env=env, check=True)


def local_story(args: argparse.Namespace) -> None:
    """Upload a tiny dataset, train with a pre-emption and a resume, check every epoch's coverage."""
    location = parse_location(args.url)
    client = make_client()
    images = SyntheticImages(args.images, num_classes=4, size=(96, 72))
    upload_cv_dataset(images, client=client, bucket=location.bucket, base_folder=location.base_folder, maxcount=24,
                      workers=0, progress=False)
    keys = sorted(sample["__key__"] for sample in DatasetReader(client, location.bucket, location.base_folder))
    client.close()
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint, args.log_keys = Path(tmp) / "checkpoint.pt", Path(tmp)
        torchrun(args, 2, args.workers, "--stop-after", str(args.stop_after))
        # StatefulDataLoader's states resume on other ranks and workers; counted positions need the same.
        ranks, workers = (1, max(1, args.workers - 1)) if StatefulDataLoader else (2, args.workers)
        torchrun(args, ranks, workers, "--resume")
        seen: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for path in Path(tmp).glob("keys-rank*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                seen[record["epoch"]].update(record["keys"])
    exact = {epoch: sorted(counter.elements()) == keys for epoch, counter in sorted(seen.items())}
    print(json.dumps({"epochs": args.epochs, "samples": len(keys), "exactly_once": exact}))
    if sorted(exact) != list(range(args.epochs)) or not all(exact.values()):
        raise SystemExit("an epoch did not see every sample exactly once across the stop and the resume")
    print("every epoch saw every sample exactly once across the stop and the resume")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_location_args(parser, "train")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--size", type=int, default=64, help="crop size (224 for ImageNet)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers per rank (default: one per core of the rank; 2 with --local-server)")
    parser.add_argument("--shuffle-buffer", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoint.pt"))
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--stop-after", type=int, default=0, help="save a checkpoint and stop after this many steps")
    parser.add_argument("--log-keys", type=Path, default=None, help="append each rank's sample keys to files here")
    parser.add_argument("--log-every", type=int, default=5, help="print the loader's metrics every N steps (0: never)")
    parser.add_argument("--images", type=int, default=192, help="images to generate with --local-server")
    args = parser.parse_args()
    if "RANK" in os.environ:
        train(args)
        return
    if not args.local_server:
        parser.error("start this script with torchrun, or use --local-server")
    args.stop_after = args.stop_after or 4
    args.workers = 2 if args.workers is None else args.workers
    with maybe_local_server(args):
        local_story(args)


if __name__ == "__main__":
    main()
