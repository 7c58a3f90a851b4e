"""Position-based resume: how many items each DataLoader worker had delivered.

A worker's output this epoch is fixed by (seed, epoch, rank, worker), so a position is
just a count per worker. The DataLoader takes items from its workers in turn (worker 0,
1, ..., skipping workers that are done), so the count of items the training loop consumed
fixes each worker's count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from remote_loader.errors import ConfigError

STATE_VERSION = 1


def consumed_per_worker(items: Sequence[int], consumed: int) -> list[int]:
    """Split ``consumed`` round-robin items among workers that produce ``items[w]`` items each."""
    if consumed < 0 or consumed > sum(items):
        raise ConfigError(f"consumed={consumed} is outside this epoch's 0..{sum(items)} items")
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

    def as_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> ResumeState:
        try:
            if state["version"] != STATE_VERSION:
                raise ConfigError(f"loader state version {state['version']} is not {STATE_VERSION}")
            resume = cls(int(state["epoch"]), int(state["seed"]), int(state["num_workers"]), [int(s) for s in state["skip"]])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("not a RemoteDataset state_dict") from None
        if len(resume.skip) != resume.num_workers:
            raise ConfigError("loader state lists a count per worker; their number differs from num_workers")
        return resume
