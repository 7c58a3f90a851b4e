"""What a checkpoint state is checked against and a worker's share is cut from: the dataset,
its seed, this rank's place in the world, the delivery order's mixing and the stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remote_loader.errors import ResumeError
from remote_loader.pipeline.order.delivery import Mixing
from remote_loader.pipeline.order.split import worker_bounds
from remote_loader.pipeline.stages.chain import Chain, Stage
from remote_loader.pipeline.state.resume.states import WorkerState
from remote_loader.read import DatasetReader


@dataclass(frozen=True)
class Layout:
    """What a state is checked against and a worker's share is cut from."""

    reader: DatasetReader
    seed: int
    shuffle: bool
    rank: int
    world_size: int
    equalize: bool
    mixing: Mixing
    stages: Sequence[Stage]

    @property
    def chain(self) -> Chain:
        return Chain.of(self.stages)

    def align(self) -> int:
        """The samples each output item holds, when fixed (``Chain.align``)."""
        return self.chain.align()

    def worker_samples(self, worker: int, num_workers: int) -> int:
        """Samples worker ``worker`` of this rank reads per epoch."""
        low, high = worker_bounds(len(self.reader), rank=self.rank, world_size=self.world_size, worker=worker,
                                  num_workers=num_workers, equalize=self.equalize, align=self.align())
        return high - low

    def worker_items(self, worker: int, num_workers: int) -> int:
        """Items worker ``worker`` of this rank gives per epoch, for a state counted in items."""
        self.per_item()  # a ResumeError where items do not count samples
        items = self.chain.outputs(self.worker_samples(worker, num_workers))
        assert items is not None  # the stages map one sample to one, but for a last batched
        return items

    def header(self, epoch: int, worker: int, num_workers: int) -> dict[str, Any]:
        """What every state of this worker in ``epoch`` starts with."""
        return {"epoch": epoch, "seed": self.seed, "shuffle": self.shuffle, "samples": len(self.reader),
                "shards": len(self.reader.counts), "dataset": self.reader.identity, "run": 0, "rank": self.rank,
                "world_size": self.world_size, "worker": worker, "num_workers": num_workers}

    def per_item(self) -> int:
        """Samples per item, for a state counted in items (a plain DataLoader's): every stage
        must map one sample to one, the last may batch them."""
        per_item = self.chain.per_item()
        if per_item is None:
            raise ResumeError("a state counted in items needs every stage to map one sample to one (decode, map,"
                              " map_tuple, to_tuple), optionally ending with batched; select or an inner batched"
                              " breaks that: use torchdata's StatefulDataLoader, whose states need neither")
        return per_item

    def check(self, state: WorkerState) -> WorkerState:
        expected = {"seed": self.seed, "shuffle": self.shuffle, "samples": len(self.reader),
                    "shards": len(self.reader.counts)}
        for key, value in expected.items():
            if state.header[key] != value:
                raise ResumeError(f"the state of {state.where} has {key}={state.header[key]!r}, this dataset has"
                                  f" {value!r}: it was saved for another dataset or seed")
        self.check_identity(state.header.get("dataset"))
        return state

    def check_identity(self, saved: int | None) -> None:
        if saved is not None and saved != self.reader.identity:
            raise ResumeError(f"the state was saved on another upload than {self.reader.location}'s (its manifest"
                              f" {saved:08x}, this one {self.reader.identity:08x}): another dataset, or this one"
                              " replaced since, so the state's positions name other samples; start the epoch afresh")
