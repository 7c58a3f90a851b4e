"""What a checkpoint state is checked against and a worker's share is cut from: the dataset,
its seed, this rank's place in the world and the pipeline's stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remote_loader.errors import ResumeError
from remote_loader.pipeline.resume.states import WorkerState
from remote_loader.pipeline.split import worker_bounds
from remote_loader.pipeline.stages import Stage
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
    stages: Sequence[Stage]

    def align(self) -> int:
        """The samples each output item holds, when fixed: workers' shares are cut in
        multiples of it, so batches come out whole and as many as ``len()`` says."""
        align = 1
        for stage in self.stages:
            group = stage.group()
            if group is None:
                return 1
            align *= group
        return align

    def worker_samples(self, worker: int, num_workers: int) -> int:
        """Samples worker ``worker`` of this rank reads per epoch."""
        low, high = worker_bounds(len(self.reader), rank=self.rank, world_size=self.world_size, worker=worker,
                                  num_workers=num_workers, equalize=self.equalize, align=self.align())
        return high - low

    def header(self, epoch: int, worker: int, num_workers: int) -> dict[str, Any]:
        """What every state of this worker in ``epoch`` starts with."""
        return {"epoch": epoch, "seed": self.seed, "shuffle": self.shuffle, "samples": len(self.reader),
                "shards": len(self.reader.counts), "dataset": self.reader.identity, "run": 0, "rank": self.rank,
                "world_size": self.world_size, "worker": worker, "num_workers": num_workers}

    def skip_point(self) -> tuple[int, int]:
        """(stages run before skipping, samples per output item) for a count-based resume."""
        reorders = [i for i, s in enumerate(self.stages) if s.reorders]
        after = reorders[-1] + 1 if reorders else 0
        tail = list(self.stages[after:])
        per_item = 1
        batch = tail[-1].batch() if tail else None
        if batch is not None:
            per_item = batch[0]
            tail = tail[:-1]
        if not all(s.one_to_one for s in tail):
            raise ResumeError(
                "resume needs every stage after the last shuffle to map one sample to one (decode, map, "
                "map_tuple, to_tuple), optionally ending with batched; select or an inner batched breaks that"
            )
        return after, per_item

    def replay_point(self) -> tuple[int, bool]:
        """(stages before the replay point, the end of the last shuffle or batched; whether
        a replay's placeholders can pass every stage before it, none of which looks at a
        sample's content), see ``replay.py``."""
        marks = [i for i, s in enumerate(self.stages) if s.reorders or s.batch() is not None]
        point = marks[-1] + 1 if marks else 0
        return point, all(s.one_to_one or s.reorders or s.batch() is not None for s in self.stages[:point])

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
            raise ResumeError(f"the state was saved on another upload to {self.reader.location} (manifest"
                              f" {saved:08x}, now {self.reader.identity:08x}): the dataset was replaced since, so"
                              " the state's positions name other samples; start the epoch afresh")
