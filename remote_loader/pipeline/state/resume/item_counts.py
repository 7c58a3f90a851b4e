"""Position-based resume: how many items each DataLoader worker had delivered.

A worker's output this epoch is fixed by (seed, epoch, rank, worker), so a position is
just a count per worker. The DataLoader takes items from its workers in turn (worker 0,
1, ..., skipping workers that are done), so the count of items the training loop consumed
fixes each worker's count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from remote_loader.checks import require_int, shown
from remote_loader.config import MAX_WORKERS
from remote_loader.errors import ResumeError
from remote_loader.pipeline.order.delivery import Mixing
from remote_loader.pipeline.state.resume.layout import Layout
from remote_loader.pipeline.state.resume.states import parse_mixing

log = logging.getLogger("remote_loader")

STATE_VERSION = 1


def _count(state: Mapping[str, Any], name: str, low: int = 0, high: int = 2**62) -> int:
    return require_int(f"RemoteDataset state field {name!r}", state.get(name), low, high, error=ResumeError, exact=True)


def consumed_per_worker(items: Sequence[int], consumed: int) -> list[int]:
    """Split ``consumed`` round-robin items among workers that produce ``items[w]`` items each."""
    if consumed < 0 or consumed > sum(items):
        raise ResumeError(f"consumed={consumed} is outside this epoch's 0..{sum(items)} items")
    taken = [0] * len(items)
    left = consumed
    while left:
        active = [w for w in range(len(items)) if taken[w] < items[w]]
        rounds = min(min(items[w] - taken[w] for w in active), left // len(active))
        if rounds == 0:
            for w in active[:left]:
                taken[w] += 1
            break
        for w in active:
            taken[w] += rounds
        left -= rounds * len(active)
    return taken


@dataclass(frozen=True)
class ResumeState:
    """Where an epoch stopped: the samples each worker's stream had delivered."""

    epoch: int
    seed: int
    num_workers: int
    skip: list[int]
    dataset: int | None = None
    """The manifest's identity (its crc32 trailer); None in states saved before it existed."""
    split: tuple[int, int] | None = None
    """(samples per item, world size) of the pipeline counted: the workers' shares are cut by
    them, so the counts mean nothing in another; None in states saved before."""
    mixing: Mixing | None = None
    """The spans read at once and the shuffle buffer the counts were taken in: a worker's
    order depends on them, so the counts mean nothing in a pipeline that mixes otherwise;
    None in states saved before."""

    def as_dict(self) -> dict[str, Any]:
        state = {"version": STATE_VERSION, **asdict(self)}
        for optional in ("dataset", "split", "mixing"):
            if state[optional] is None:
                del state[optional]
        if self.split is not None:
            state["split"] = list(self.split)
        if self.mixing is not None:
            state["mixing"] = self.mixing.as_list()
        return state

    @classmethod
    def from_dict(cls, state: Any) -> ResumeState:
        """Check every field's type and range; raise ResumeError naming the first bad one."""
        if not isinstance(state, Mapping):
            raise ResumeError(f"a RemoteDataset state_dict is a dict, got {type(state).__name__}")
        missing = [k for k in ("version", "epoch", "seed", "num_workers", "skip") if k not in state]
        if missing:
            raise ResumeError(f"not a RemoteDataset state_dict: it lacks {', '.join(missing)}")
        if type(state["version"]) is not int or state["version"] != STATE_VERSION:  # an array compares per item
            raise ResumeError(f"RemoteDataset state version {shown(state['version'])} is not {STATE_VERSION}")
        epoch = _count(state, "epoch")
        seed = _count(state, "seed", -(2**63), 2**64 - 1)
        num_workers = _count(state, "num_workers", 1, MAX_WORKERS)
        skip = state["skip"]
        if not isinstance(skip, (list, tuple)) or len(skip) != num_workers:
            raise ResumeError(f"RemoteDataset state field 'skip' must list one count per worker ({num_workers})")
        counts = [_count({f"skip[{w}]": n}, f"skip[{w}]") for w, n in enumerate(skip)]
        dataset = _count(state, "dataset", 0, 2**32 - 1) if "dataset" in state else None
        unchecked = [field for field in ("dataset", "split", "mixing") if field not in state]
        if unchecked:  # saved before states held them, or cut short: nothing to check the counts against
            log.warning("this RemoteDataset count state holds no %s (saved before states did, or cut short): it cannot"
                        " be checked against the pipeline it resumes, where another upload, world size or shuffle"
                        " buffer would repeat or skip samples", ", ".join(unchecked))
        split = None
        if "split" in state:
            saved = state["split"]
            if not isinstance(saved, (list, tuple)) or len(saved) != 2:
                raise ResumeError("RemoteDataset state field 'split' must be [samples per item, world size]")
            per_item, world = (_count({f"split[{i}]": v}, f"split[{i}]", 1) for i, v in enumerate(saved))
            split = (per_item, world)
        mixing = parse_mixing(state) if "mixing" in state else None
        return cls(epoch, seed, num_workers, counts, dataset, split, mixing)


def count_state(layout: Layout, epoch: int, consumed: int, num_workers: int,
                before: Sequence[int] | None = None) -> dict[str, Any]:
    """The state after ``consumed`` items of ``epoch`` came out of a DataLoader with
    ``num_workers`` workers (``RemoteDataset.state_dict(consumed=...)``). ``before``: the
    samples each worker had delivered where this iteration resumed from a count state: a
    DataLoader starts its round-robin anew there, and ``consumed`` counts those items too."""
    per_item = layout.per_item()
    workers = max(1, num_workers)
    items = [layout.worker_items(worker, workers) for worker in range(workers)]
    done = [-(-s // per_item) for s in before] if before is not None and len(before) == workers else [0] * workers
    if consumed < sum(done):
        raise ResumeError(f"consumed={consumed}, but the state this epoch resumed from had delivered {sum(done)} items:"
                          " count every item of the epoch, those before the resume included")
    rest = consumed_per_worker([n - d for n, d in zip(items, done, strict=True)], consumed - sum(done))
    taken = [d + t for d, t in zip(done, rest, strict=True)]
    return ResumeState(epoch, layout.seed, workers, [t * per_item for t in taken], layout.reader.identity,
                       (per_item, layout.world_size), layout.mixing).as_dict()
