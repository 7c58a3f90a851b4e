"""``RemoteDataset``: stream an uploaded dataset into PyTorch, split across ranks and workers."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from remote_loader.pipeline import stages
from remote_loader.pipeline.decode import decode_sample
from remote_loader.pipeline.split import assign, rank_size
from remote_loader.reader import DatasetReader
from remote_loader.storage import Store, open_location

Stage = Callable[[Any], Any]


def _bytes_fields(sample: Any) -> Any:
    """Copy buffer views to bytes so samples can leave a worker process (memoryviews do not pickle)."""
    if isinstance(sample, dict):
        return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}
    return sample


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class RemoteDataset(IterableDataset):
    """Samples of an uploaded dataset, in a fresh shard order every epoch.

    Args:
        client: A store from ``make_client``, or an ``s3://bucket/prefix`` URL.
        bucket: The bucket (omit with a URL).
        base_folder: The dataset's prefix (omit with a URL).
        seed: Seed of the per-epoch shard order and the shuffle buffer.
        shuffle_shards: Shuffle the shard order each epoch.
        rank: This process's rank; default from torch.distributed, else ``RANK``.
        world_size: Number of ranks; default from torch.distributed, else ``WORLD_SIZE``.
        equalize: Give every rank the same sample count (wrapping around); default on when
            ``world_size > 1``.
        verify: Check member crc32s.
        **connection: ``endpoint_url``, ``access_key``, ``secret_key``, ``region``,
            ``backend`` for a URL.
    """

    def __init__(
        self,
        client: Store | str,
        bucket: str | None = None,
        base_folder: str | None = None,
        *,
        seed: int = 0,
        shuffle_shards: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        equalize: bool | None = None,
        verify: bool = True,
        **connection: Any,
    ) -> None:
        if isinstance(client, str):
            client, location = open_location(client, **connection)
            bucket, base_folder = location.bucket, location.prefix
        if bucket is None or base_folder is None:
            raise TypeError("RemoteDataset needs (client, bucket, base_folder) or an s3:// URL")
        self.reader = DatasetReader(client, bucket, base_folder, verify=verify)
        self.seed, self.shuffle_shards, self.epoch = seed, shuffle_shards, 0
        self.rank, self.world_size, self.equalize = rank, world_size, equalize
        self.stages: list[Stage] = []

    def _with(self, stage: Stage) -> RemoteDataset:
        clone = copy.copy(self)
        clone.stages = [*self.stages, stage]
        return clone

    def shuffle(self, bufsize: int, initial: int | None = None) -> RemoteDataset:
        """Mix samples in a buffer of ``bufsize`` (output starts at ``initial``, default bufsize // 4)."""
        return self._with(partial(stages.shuffle_stage, bufsize=bufsize, initial=bufsize // 4 if initial is None else initial, seed=()))

    def decode(self, mode: str | Callable[[str, Any], Any] = "pil") -> RemoteDataset:
        """Decode images (``pil``, ``rgb8``, ``torchrgb``, ``raw`` or a callable) and labels."""
        return self._with(partial(stages.map_stage, fn=partial(decode_sample, mode=mode)))

    def to_tuple(self, *fields: str) -> RemoteDataset:
        """Samples become tuples of these fields (``"jpg;png"``: the first present)."""
        return self._with(partial(stages.to_tuple_stage, fields=fields))

    def map(self, fn: Callable[[Any], Any]) -> RemoteDataset:
        return self._with(partial(stages.map_stage, fn=fn))

    def map_tuple(self, *fns: Callable[[Any], Any] | None) -> RemoteDataset:
        return self._with(partial(stages.map_tuple_stage, fns=fns))

    def select(self, predicate: Callable[[Any], bool]) -> RemoteDataset:
        return self._with(partial(stages.select_stage, predicate=predicate))

    def batched(self, batchsize: int, collation_fn: Callable[[list[Any]], Any] | None = None, partial_batch: bool = True) -> RemoteDataset:
        """Group samples into batches; the default collation stacks tensors, numbers and tuples."""
        collate = collation_fn or torch.utils.data.default_collate
        return self._with(partial(stages.batched_stage, batchsize=batchsize, collation_fn=collate, partial=partial_batch))

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows."""
        self.epoch = epoch

    def _split(self) -> tuple[int, int, bool]:
        rank, world_size = _world(self.rank, self.world_size)
        equalize = world_size > 1 if self.equalize is None else self.equalize
        return rank, world_size, equalize

    def __len__(self) -> int:
        """Samples this rank reads per epoch (before any select or batching)."""
        rank, world_size, equalize = self._split()
        return rank_size(self.reader.manifest.num_samples, rank, world_size, equalize)

    def _samples(self) -> Iterator[dict[str, Any]]:
        rank, world_size, equalize = self._split()
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        shards = self.reader.manifest.shards
        spans = assign([s.samples for s in shards], seed=self.seed, epoch=self.epoch, rank=rank, world_size=world_size,
                       worker=worker, num_workers=num_workers, shuffle=self.shuffle_shards, equalize=equalize)
        for span in spans:
            view = self.reader.open_shard(shards[span.shard])
            for i in range(span.start, span.end):
                yield view.sample(i)

    def __iter__(self) -> Iterator[Any]:
        rank, _, _ = self._split()
        info = get_worker_info()
        data: Any = self._samples()
        for stage in self.stages:
            if isinstance(stage, partial) and stage.func is stages.shuffle_stage:
                seed = (self.seed, self.epoch, rank, info.id if info else 0)
                stage = partial(stage.func, *stage.args, **{**stage.keywords, "seed": seed})
            data = stage(data)
        if info is not None:
            data = map(_bytes_fields, data)
        yield from data
